"""libFuzzer (atheris) harness: the metadata reader, ``_format.read_index``.

Input: the bytes of ``pyckpt.json``, written into a checkpoint directory that also holds a
4 KiB data file ``0-0.000000000000.pyckpt`` (so documents naming it get past the file checks).
When the format under test seals its metadata with a checksum member, an input ending in ``}``
gets a valid checksum (an existing checksum member is replaced first, and a ``"version":1`` seed
is relabelled as the current version), so mutations reach the
parser and the schema checks behind the checksum instead of all dying at it.
Every input must be accepted or refused with a typed error (pyckpt.PyckptError / OSError), and
the metadata reader and the Python validator kept as its oracle must read it alike: the same
index, or the same error and message (tests/_index_compare.py; a difference is raised as an
AssertionError, i.e. a finding).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

import atheris

with atheris.instrument_imports(include=["pyckpt"]):  # not torch: minutes of start-up
    from pyckpt import _C, _format
    from pyckpt.errors import PyckptError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _index_compare import both_readers

_SEALS = int(_format.FORMAT_VERSION) >= 2
_SEAL_RE = re.compile(rb',"checksum":"xxh64:[0-9a-f]{16}"\}$')


def _seal(data: bytes) -> bytes:
    if not _SEALS or not data.endswith(b"}"):
        return data
    # The seeds are version-1 documents (no checksum); present them as the current version.
    data = data.replace(b'"version":1,', b'"version":%d,' % _format.FORMAT_VERSION, 1)
    head = _SEAL_RE.sub(b"}", data)[:-1]
    return head + b',"checksum":"xxh64:' + b"%016x" % _C.xxh64(head) + b'"}'

_DIR = tempfile.mkdtemp(prefix="fuzz-metadata-")
with open(os.path.join(_DIR, "0-0.000000000000.pyckpt"), "wb") as _f:
    _f.write(bytes(4096))
_META = os.path.join(_DIR, "pyckpt.json")


@atheris.instrument_func
def test_one_input(data: bytes) -> None:
    sealed = _seal(data)
    with open(_META, "wb") as f:
        f.write(sealed)
    native, reference = both_readers(sealed)
    if native != reference:
        raise AssertionError(f"the metadata reader gave {native!r:.300}, the Python validator "
                             f"{reference!r:.300}")
    try:
        _format.read_index(_DIR)
    except (PyckptError, OSError):
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
