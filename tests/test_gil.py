"""Every native call that compresses, copies, does I/O or waits releases the GIL (STYLE G1/G2).

A Python thread counts in a tight loop while a large native call runs in another thread. If the
call held the GIL, the counter would stand still for the call's whole duration.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from pyckpt import _C

BF16 = _C.CodecParams("zstd", 1, 2, "group_rotl1")


def counter_progress_during(call: Callable[[], object]) -> tuple[float, float]:
    """Runs ``call`` in a thread while another thread counts.

    Returns (counter increments during the call / increments expected at the spinner's solo
    rate, duration of the call). About 0 when the call holds the GIL (the spinner only gets the
    switch intervals at either end), a large fraction when it releases it.
    """
    count = 0
    stop = threading.Event()
    started = threading.Event()

    def spin() -> None:
        nonlocal count
        started.set()
        while not stop.is_set():
            count += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    started.wait()
    c0, t0 = count, time.perf_counter()
    time.sleep(0.05)  # the spinner alone: calibrates its rate on this machine
    rate = (count - c0) / (time.perf_counter() - t0)
    box: dict[str, float] = {}
    err: list[BaseException] = []

    def native() -> None:
        try:
            box["before"] = count
            t = time.perf_counter()
            call()
            box["dt"] = time.perf_counter() - t
            box["after"] = count
        except BaseException as e:  # re-raised below, on the test's thread
            err.append(e)

    worker = threading.Thread(target=native)
    worker.start()
    worker.join()
    stop.set()
    spinner.join()
    if err:
        raise err[0]
    return (box["after"] - box["before"]) / (rate * box["dt"]), box["dt"]


@pytest.fixture(autouse=True)
def short_switch_interval() -> Iterator[None]:
    # Less slack at the ends of a GIL-holding call: the check below gets sharper.
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    yield
    sys.setswitchinterval(old)


@pytest.fixture(scope="module")
def big() -> np.ndarray:
    torch = pytest.importorskip("torch")
    t = (torch.randn(16 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    return t.view(torch.uint8).numpy().copy()  # 32 MiB


def assert_released(call: Callable[[], object], min_seconds: float = 0.15) -> None:
    def repeated() -> None:
        # Long enough that the switch intervals at the ends cannot explain the progress.
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < min_seconds:
            call()

    fraction, dt = counter_progress_during(repeated)
    assert dt >= min_seconds
    # Measured here: ~0.00 for a GIL-holding re.match() of similar duration (at most two 1 ms
    # switch intervals of counting, < 0.04), 0.2-1.0 for calls that release it (the spinner
    # shares 2 busy cores with the native threads).
    assert fraction > 0.1, f"counter ran at {fraction:.2f} of its solo rate during {dt:.3f}s"


def test_detector_sees_a_held_gil() -> None:
    """The check above can fail: a C call that keeps the GIL stops the counter."""
    # Exponential backtracking in the re engine: ~0.5-2 s inside one C call that never
    # releases the GIL, with no memory to speak of. Long enough that the counting at its ends
    # (a few ms per GIL hand-over, more on a loaded machine) stays far below the bound: at
    # 0.14 s ("a" * 22) it reached 0.07 in 5 of 90 loaded trials.
    fraction, dt = counter_progress_during(lambda: re.match(r"(a+)+b", "a" * 24))
    assert dt > 0.2
    assert fraction < 0.05


def test_xxh64_releases_gil(big) -> None:
    assert_released(lambda: [_C.xxh64(big) for _ in range(8)])


def test_replica_digests_release_gil(big) -> None:
    # The replica check's digests: every byte on several threads, and a 1 MiB sample per buffer.
    assert_released(lambda: _C.block_digests([big] * 4, 4 << 20, [big.nbytes] * 4, 2))
    parts = [big[k << 20 :] for k in range(24)]  # 8-32 MiB each: one 1 MiB sample per part
    assert_released(lambda: _C.sampled_digests(parts, 16 << 10, 64, 2))


def test_encode_and_decode_release_gil(big) -> None:
    stored, rec = _C.encode_chunk(big, BF16)
    out = np.empty_like(big)
    assert_released(lambda: _C.encode_chunk(big, BF16))
    assert_released(lambda: _C.decode_chunk(stored, rec, BF16, out))
    assert np.array_equal(out, big)


def test_write_and_read_release_gil(big, tmp_path, thread_pool_factory) -> None:
    pool = thread_pool_factory(1)
    blocks = _C.BufferPool(1 << 20, 4)
    path = tmp_path / "f"
    result: list = []

    def write() -> None:
        with _C.FileWriter(path, "auto", True, 1 << 20, 3) as w:
            result.extend(w.write_items([("w", big.ctypes.data, big.nbytes, BF16)], 1 << 20, pool, blocks))
            w.commit()

    assert_released(write)
    out = np.empty_like(big)
    seg = (str(path), 0, BF16, result[0][2])
    assert_released(lambda: _C.read_requests([("w", [seg], 0, big.nbytes, out.ctypes.data)], pool))
    assert np.array_equal(out, big)


def test_append_releases_gil(big, tmp_path) -> None:
    def write() -> None:
        with _C.FileWriter(tmp_path / "g", "auto", True, 1 << 20, 3) as w:
            for _ in range(2):
                w.append(big)
            w.commit()

    assert_released(write)
