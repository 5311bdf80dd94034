"""The Python-side background executor (pyckpt._background): fan-out and lanes."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pyckpt import _background


def test_map_parallel_keeps_item_order_and_uses_helper_threads() -> None:
    names: set[str] = set()
    barrier = threading.Barrier(3, timeout=30)

    def fn(x: int) -> int:
        names.add(threading.current_thread().name)
        if x < 3:
            barrier.wait()  # three items run at once: the caller and two helpers
        return x * x

    assert _background.map_parallel(fn, range(10), 3) == [x * x for x in range(10)]
    assert threading.current_thread().name in names
    assert any(n.startswith("pyckpt-bg") for n in names)


def test_map_parallel_with_one_worker_runs_on_the_calling_thread() -> None:
    seen = []
    out = _background.map_parallel(lambda x: seen.append(threading.get_ident()) or x, [1, 2], 1)
    assert out == [1, 2] and set(seen) == {threading.get_ident()}
    assert _background.map_parallel(lambda x: x, [], 8) == []


def test_map_parallel_raises_the_first_failure_and_starts_no_more_items() -> None:
    started = []

    def fn(x: int) -> int:
        started.append(x)
        if x in (2, 3):
            time.sleep(0.2 if x == 2 else 0)  # item 3 fails first; item 2's failure wins
            raise ValueError(f"item {x}")
        time.sleep(0.01)
        return x

    with pytest.raises(ValueError, match="item 2"):
        _background.map_parallel(fn, range(200), 4)
    assert 3 in started and len(started) < 100


def test_nested_fan_outs_finish_on_a_saturated_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    # One executor thread for fan-outs three deep: every level's caller takes items itself.
    tiny = ThreadPoolExecutor(1, thread_name_prefix="tiny")
    monkeypatch.setattr(_background, "_shared", tiny)
    try:
        def leaf(x: int) -> int:
            return x + 1

        def mid(x: int) -> int:
            return sum(_background.map_parallel(leaf, range(x, x + 4), 4))

        def top(x: int) -> int:
            return sum(_background.map_parallel(mid, range(x, x + 4), 4))

        assert _background.map_parallel(top, range(4), 4) == [
            sum(sum(z + 1 for z in range(y, y + 4)) for y in range(x, x + 4)) for x in range(4)
        ]
    finally:
        tiny.shutdown(wait=True)


def test_a_lane_runs_its_tasks_in_order_on_one_named_thread() -> None:
    lane = _background.lane("pyckpt-test-lane")
    try:
        seen: list[tuple[int, str]] = []
        futures = [lane.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
                   for i in range(5)]
        for f in futures:
            f.result(timeout=30)
    finally:
        lane.shutdown(wait=True)
    assert [i for i, _ in seen] == list(range(5))
    assert len({n for _, n in seen}) == 1 and seen[0][1].startswith("pyckpt-test-lane")
