"""Benchmark configuration: PYCKPT_BENCH_SCALE sets workload sizes (default fits CI smoke runs)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def bench_scale() -> float:
    """Multiplier for benchmark sizes (PYCKPT_BENCH_SCALE, default 1 -> ~32 MiB workloads)."""
    return float(os.environ.get("PYCKPT_BENCH_SCALE", "1"))
