"""FileWriter throughput against a plain O_DIRECT sequential write of the same bytes.

Both include fsync. The baseline is measured in the same run (DESIGN: timings on this kind of
machine are noisy, so only same-run ratios mean anything); ``extra_info["vs_odirect"]`` is
pyckpt's throughput over the baseline's. Compressed saves report the effective throughput
(raw bytes / wall), which can exceed the disk's.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest

from pyckpt import _C

BLOCK = 8 << 20
CHUNK = 4 << 20


def odirect_write(path: str, data: np.ndarray) -> None:
    """Sequential O_DIRECT pwrite of page-aligned 8 MiB blocks, then fsync (the disk's limit)."""
    buf = mmap.mmap(-1, BLOCK)  # page aligned, as O_DIRECT requires
    view = np.frombuffer(buf, np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    try:
        for off in range(0, data.nbytes, BLOCK):
            n = min(BLOCK, data.nbytes - off)
            view[:n] = data[off : off + n]
            os.pwrite(fd, memoryview(buf)[:n], off)  # sizes are multiples of 1 MiB here
        os.fsync(fd)
    finally:
        os.close(fd)
        del view
        buf.close()


@pytest.fixture(scope="module")
def baseline_bps(tmp_path_factory, scaled, bf16_bytes) -> float:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    data = bf16_bytes(scaled(64 << 20))
    path = str(tmp_path_factory.mktemp("baseline") / "odirect.bin")
    best = float("inf")
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            odirect_write(path, data)
            best = min(best, time.perf_counter() - t0)
            os.unlink(path)
    except OSError as e:
        pytest.skip(f"O_DIRECT refused here: {e}")
    return data.nbytes / best


def test_odirect_baseline(benchmark, tmp_path, scaled, run_timed, bf16_bytes, baseline_bps) -> None:
    data = bf16_bytes(scaled(64 << 20))
    path = str(tmp_path / "odirect.bin")
    best = run_timed(lambda: odirect_write(path, data))
    benchmark.extra_info.update(bytes_per_s=data.nbytes / best, baseline_bytes_per_s=baseline_bps)


@pytest.mark.parametrize("codec", ["none", "group_rotl1"])
def test_filewriter_throughput(benchmark, tmp_path, scaled, run_timed, bf16_bytes, baseline_bps, codec) -> None:
    data = bf16_bytes(scaled(64 << 20))
    params = _C.CodecParams("none", 1, 2, "none") if codec == "none" else _C.CodecParams("zstd", 1, 2, "group_rotl1")
    threads = os.cpu_count() or 1
    pool = _C.ThreadPool(threads)
    blocks = _C.BufferPool(CHUNK, 2 * threads + 2)
    staging = _C.BufferPool(BLOCK, 3)  # reused across rounds, like a long-lived writer
    path = tmp_path / "0-0.pyckpt"
    result: list = []

    def save() -> None:
        with _C.FileWriter(path, "auto", True, staging=staging) as w:
            result[:] = w.write_items([("w", data.ctypes.data, data.nbytes, params)], CHUNK, pool, blocks)
            w.commit()

    try:
        best = run_timed(save)
    finally:
        pool.shutdown()
    stored = result[0][1]
    assert path.stat().st_size == stored
    # Check the output after timing: it reads back to the same bytes.
    out = np.empty_like(data)
    with _C.ThreadPool(threads) as rpool:
        _C.read_requests([("w", [(str(path), 0, params, result[0][2])], 0, data.nbytes, out.ctypes.data)], rpool)
    assert np.array_equal(out, data)
    bps = data.nbytes / best
    benchmark.extra_info.update(
        bytes_per_s=bps,
        stored_bytes_per_s=stored / best,
        ratio=stored / data.nbytes,
        baseline_bytes_per_s=baseline_bps,
        vs_odirect=bps / baseline_bps,
    )
