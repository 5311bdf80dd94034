"""The atheris harnesses in fuzz/ still run against the current bindings.

CI's fuzz stage runs each harness for a minute; this smoke run (a few hundred inputs from the
committed seed corpus) fails in the test stage when a binding a harness calls changes shape,
instead of only in the fuzz stage's log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris (the 'fuzz' extra) is not installed")

ROOT = Path(__file__).resolve().parent.parent
HARNESSES = sorted((ROOT / "fuzz").glob("fuzz_*.py"))


def test_harnesses_exist() -> None:
    assert len(HARNESSES) >= 3, HARNESSES


@pytest.mark.parametrize("harness", HARNESSES, ids=lambda p: p.stem)
def test_harness_runs_its_corpus(harness: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(ROOT / "fuzz" / "corpus" / harness.stem, corpus)  # never write the repo's
    env = dict(os.environ)
    import pyckpt

    # The pyckpt the tests import (installed, or the checkout via PYTHONPATH).
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(pyckpt.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, str(harness), str(corpus), "-runs=400", "-timeout=10",
         f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Done 400 runs" in proc.stderr, proc.stderr[-2000:]
