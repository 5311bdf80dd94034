"""The extension module exports its init function and nothing else.

A compiler that links libstdc++ statically by default made the extension export thousands of
``std::`` symbols; the loader bound some of the extension's own references to the libstdc++.so
that Python and torch had loaded first, and the first ``std::ostringstream`` that formatted a
number crashed in a locale facet of the other copy. CMakeLists.txt links the extension with a
version script (csrc/bindings/exports.map) and ``--exclude-libs,ALL``; this checks the result on
the extension the tests import.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from _fake_cudart import double_path

from pyckpt import _C

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF only")


def _exported(path: str) -> list[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True,
                         check=True).stdout
    return sorted(line.split()[-1] for line in out.splitlines() if line.strip())


def test_extension_exports_only_its_module_init() -> None:
    assert _exported(_C.__file__) == ["PyInit__C"]


def test_the_export_check_sees_a_library_s_symbols() -> None:
    # The same reading of a library that does export symbols (the CUDA runtime test double,
    # built beside the extension): the check above cannot pass by reading nothing.
    names = _exported(double_path())
    assert {"cudaMemcpyAsync", "cudaHostRegister", "fake_cudart_reset"} <= set(names)
