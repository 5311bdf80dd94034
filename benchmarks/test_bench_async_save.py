"""Smoke run of benchmarks/bench_async_save.py (2 ranks, a few tensors, one timed save)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_bench_async_save_smoke() -> None:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_async_save.py")
    out = subprocess.run([sys.executable, script, "--ranks", "2", "--tensors", "8", "--kib", "4",
                          "--saves", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "every load bit-exact" in out.stdout
    assert "pyckpt.async_save" in out.stdout and "dcp.async_save" in out.stdout
