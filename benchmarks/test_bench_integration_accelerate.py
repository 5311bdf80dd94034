"""Smoke run of integration_accelerate.py at a tiny size: it runs end to end, in a child
process (an Accelerator's state is process-wide), and reports both methods."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_accelerate_report(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    out = tmp_path / "a.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "integration_accelerate.py"), "--hidden", "64",
         "--layers", "2", "--repeats", "1", "--work", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    for method in ("pyckpt", "accelerate"):
        assert report["save_blocking_s"][method]["median"] > 0
        assert report["bytes_on_disk"][method]["median"] > 0
    assert "| pyckpt |" in proc.stdout and "| accelerate |" in proc.stdout
    assert os.listdir(tmp_path) == ["a.json"]
