"""Shared fixtures for the pyckpt benchmarks (pytest-benchmark; not part of ``testpaths``).

``PYCKPT_BENCH_SCALE`` (float, default 1) multiplies every data size; the default keeps
``pytest benchmarks --benchmark-disable`` a quick smoke test on a 2-core CI machine. Full runs:
``PYCKPT_BENCH_SCALE=16 pytest benchmarks --benchmark-json=out.json``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import pytest


@pytest.fixture(scope="session")
def bench_scale() -> float:
    """The PYCKPT_BENCH_SCALE multiplier."""
    raw = os.environ.get("PYCKPT_BENCH_SCALE", "1")
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"PYCKPT_BENCH_SCALE={raw!r} is not a number") from None
    if value <= 0:
        raise pytest.UsageError(f"PYCKPT_BENCH_SCALE={raw!r} must be > 0")
    return value


@pytest.fixture(scope="session")
def scaled(bench_scale: float) -> Callable[..., int]:
    """``scaled(nbytes, align=1 MiB)``: nbytes * scale, a multiple of ``align`` (at least one)."""

    def size(nbytes: int, align: int = 1 << 20) -> int:
        return max(align, int(nbytes * bench_scale) // align * align)

    return size


@pytest.fixture(scope="session")
def bf16_bytes() -> Callable[[int], np.ndarray]:
    """``bf16_bytes(n)``: n bytes (uint8 array) of bf16 values like trained weights (std 0.02)."""
    torch = pytest.importorskip("torch")
    cache: dict[int, np.ndarray] = {}

    def make(nbytes: int) -> np.ndarray:
        if nbytes not in cache:
            gen = torch.Generator().manual_seed(0)
            t = (torch.randn(nbytes // 2, generator=gen) * 0.02).to(torch.bfloat16)
            cache[nbytes] = t.view(torch.uint8).numpy().copy()
        return cache[nbytes]

    return make


@pytest.fixture
def run_timed(benchmark) -> Callable[..., float]:
    """``run_timed(fn, rounds=3)``: runs ``fn`` under the benchmark fixture, returns the best
    wall time in seconds.

    Timing is taken here too, so throughput can go to ``extra_info`` even when
    ``--benchmark-disable`` runs ``fn`` only once.
    """

    def run(fn: Callable[[], object], rounds: int = 3) -> float:
        times: list[float] = []

        def timed() -> None:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)

        benchmark.pedantic(timed, rounds=rounds, iterations=1, warmup_rounds=1)
        return min(times)

    return run
