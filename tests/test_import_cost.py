"""``import pyckpt`` and the commands that move bytes without tensors never import torch.

Importing torch takes seconds (1.7 s on a quiet 2-core VM, 5 s while the test suite loads it):
``pyckpt --help`` and ``pyckpt consolidate`` of a 19 MiB checkpoint took that long, against
0.15 and 0.19 s without it.
Each check runs in a fresh interpreter and fails when any ``torch`` module was loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import pyckpt

# Runs `pyckpt ARGS...` (or the Python given with -c) in this interpreter, then exits 99 if any
# torch module was imported; the command's own exit status otherwise.
_PROBE = r"""
import runpy, sys
args = sys.argv[1:]
code = 0
try:
    if args[0] == "-c":
        exec(args[1])
    else:
        sys.argv = ["pyckpt", *args]
        runpy.run_module("pyckpt", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
if loaded:
    print("torch modules loaded:", len(loaded), loaded[:5], file=sys.stderr)
sys.exit(99 if loaded else code)
"""


def _probe(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=300,
        cwd=cwd, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A zstd pyckpt checkpoint and a directory of safetensors shards."""
    root = tmp_path_factory.mktemp("inputs")
    sd = {"w": torch.randn(64, 32), "b": torch.arange(10, dtype=torch.int64)}
    pyckpt.save(sd, root / "ckpt", compression="zstd")
    (root / "shards").mkdir()
    save_file(sd, str(root / "shards" / "model.safetensors"))
    return root / "ckpt", root / "shards"


@pytest.mark.parametrize("command", ["import", "help", "inspect", "verify", "consolidate",
                                     "consolidate-shards", "api-consolidate"])
def test_command_does_not_import_torch(command: str, inputs: tuple[Path, Path],
                                       tmp_path: Path) -> None:
    ckpt, shards = inputs
    out = tmp_path / "out"
    args = {
        "import": ["-c", "import pyckpt, pyckpt.cli"],
        "help": ["--help"],
        "inspect": ["inspect", str(ckpt)],
        "verify": ["verify", str(ckpt)],
        "consolidate": ["consolidate", str(ckpt), str(out)],
        "consolidate-shards": ["consolidate", str(shards), str(out)],
        "api-consolidate": ["-c", f"import pyckpt; pyckpt.consolidate({str(ckpt)!r}, "
                                  f"{str(out)!r}).files"],
    }[command]
    res = _probe(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    if command.startswith(("consolidate", "api")):
        got = load_file(str(out / "model-00001-of-00001.safetensors"))
        assert got.keys() == {"w", "b"}


def test_the_probe_sees_torch_when_it_is_imported(tmp_path: Path) -> None:
    res = _probe("-c", "import torch", cwd=tmp_path)
    assert res.returncode == 99 and "torch modules loaded" in res.stderr
