"""Python-side background work: the one module that makes Python worker threads for it.

One of the thread models of docs/ARCHITECTURE.md ("Threads"). Two shapes of work use it:

* **Fan-out inside one call** (:func:`map_parallel`): the ranged GETs of an S3 read batch, the
  downloads that stage an S3 checkpoint, the compressed-size estimates of a save plan, the
  disk probe of ``pyckpt.bench``. They share the process's one executor (threads named
  ``pyckpt-bg``, started on demand up to :data:`MAX_WORKERS` and reused while idle) and the
  calling thread, which takes items too: a call never waits for a helper that has not started,
  so fan-outs nested inside each other, or many at once, cannot deadlock on a busy executor
  (they only get less parallel). The call returns once every item that started has finished.
* **Long-lived ordered work** (:func:`lane`): a lane is an executor with one thread of its own,
  whose tasks run one at a time in the order submitted, all on that thread (thread-local state,
  such as a Writer's save in progress or torch's current stream, stays with the lane). The
  checkpoint manager's fast-tier saves and its persistence run on shared lanes
  (:func:`shared_lane`), one per gloo group they use (so the work of several managers over the
  same ranks takes its turns in the order the training submitted it: on every rank the same
  order, which the group's collectives need), and :func:`pyckpt.async_save`'s saves on one
  lane for the process. A :func:`lane`'s owner shuts it down; the shared lanes and the async
  saves' lane live as long as the process (the interpreter's exit joins them).

Exit: both are :mod:`concurrent.futures` executors, so the interpreter's exit (threading's exit
hook, before :mod:`atexit` handlers) lets the work already submitted finish and joins their
threads. They accept no new work from then on: a fan-out started by such work (a background
save's planning) runs on its calling thread alone. Ctrl-C in a fan-out's calling thread stops
handing out items, waits for the ones running and raises. Threads that must *not* hold up the
exit (loops in native calls that may never return) are :mod:`pyckpt._daemons`; the progress
poller is :mod:`pyckpt._progress`.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

__all__ = ["MAX_WORKERS", "idle", "lane", "map_parallel", "shared_lane"]

T = TypeVar("T")
R = TypeVar("R")

# Threads of the shared executor, at most (they start only when work waits for one).
MAX_WORKERS = 64

_lock = threading.Lock()
_shared: ThreadPoolExecutor | None = None
# shared lanes by owner and name (an owner freed, e.g. a destroyed process group, drops them)
_lanes: weakref.WeakKeyDictionary[Any, dict[str, ThreadPoolExecutor]] = weakref.WeakKeyDictionary()


def _executor() -> ThreadPoolExecutor:
    global _shared
    with _lock:
        if _shared is None:
            _shared = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="pyckpt-bg")
        return _shared


def _forget_after_fork() -> None:
    # A forked child has none of the parent's threads: it starts its own executor on demand.
    global _lock, _shared, _lanes
    _lock = threading.Lock()
    _shared = None
    _lanes = weakref.WeakKeyDictionary()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def map_parallel(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """``[fn(x) for x in items]`` on up to ``workers`` threads: the calling thread and helpers
    of the shared executor, each taking the next item until none is left.

    Returns the results in item order. When ``fn`` raises, no further item is started, the
    running ones finish, and the failure of the first failing item (in item order) is raised.
    With ``workers <= 1`` or a single item everything runs on the calling thread.
    """
    todo = list(items)
    n = len(todo)
    helpers = min(workers, n) - 1
    if helpers <= 0:
        return [fn(x) for x in todo]
    results: list[Any] = [None] * n
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()
    taken = 0

    def take() -> int | None:
        nonlocal taken
        with lock:
            if errors or taken >= n:
                return None
            taken += 1
            return taken - 1

    def work() -> None:
        while (i := take()) is not None:
            try:
                results[i] = fn(todo[i])
            except BaseException as e:
                with lock:
                    errors[i] = e
                return

    ex = _executor()
    futures: list[Future[None]] = []
    for _ in range(helpers):
        try:
            futures.append(ex.submit(work))
        except RuntimeError:
            # The interpreter is exiting (a background save it waits for): no new work is
            # accepted, and the calling thread takes every item.
            break
    try:
        work()
    except BaseException as e:  # Ctrl-C outside fn (fn's own failures are recorded by work)
        with lock:
            errors.setdefault(-1, e)
    finally:
        # Helpers that have not started are cancelled (their items are done or skipped); only
        # the running ones are waited for (a cancelled future counts as done only once the
        # executor dequeues it, which a busy executor may never get to while we wait).
        wait_futures([f for f in futures if not f.cancel()])
    if errors:
        raise errors[min(errors)]
    return results


class _Process:
    """The owner of the shared lanes of None (work without a process group)."""


_PROCESS = _Process()


def lane(name: str) -> ThreadPoolExecutor:
    """A lane for long-lived ordered work: an executor with one thread named ``name``; its
    owner shuts it down (``shutdown(wait=True)`` waits for the tasks submitted)."""
    return ThreadPoolExecutor(1, thread_name_prefix=name)


def shared_lane(owner: object, name: str) -> ThreadPoolExecutor:
    """The process's lane named ``name`` for ``owner`` (e.g. a process group: the work of every
    user of that group then runs one task at a time, in the order submitted; None: the
    process), made by the first call and held while ``owner`` lives (weakly: a destroyed
    process group is freed). Never shut down (the interpreter's exit joins it): its users wait
    for their own futures instead."""
    with _lock:
        lanes = _lanes.setdefault(_PROCESS if owner is None else owner, {})
        if name not in lanes:
            lanes[name] = lane(name)
        return lanes[name]


def idle(ex: ThreadPoolExecutor) -> None:
    """Waits until every task submitted to lane ``ex`` so far has ended."""
    ex.submit(lambda: None).result()
