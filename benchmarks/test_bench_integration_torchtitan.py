"""Smoke run of benchmarks/integration_torchtitan.py (tiny model, one save per variant)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan")


def test_integration_torchtitan_smoke() -> None:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration_torchtitan.py")
    out = subprocess.run([sys.executable, script, "--dim", "32", "--saves", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pyckpt+zstd async" in out.stdout and "torchtitan disabled" in out.stdout
