"""Daemon threads that call native code which releases the GIL, and the interpreter's exit.

A daemon thread still inside such a call (a ``torch.distributed`` store's ``add``/``check``,
bound with pybind11's ``gil_scoped_release``) when the interpreter finalizes is killed by
CPython with ``pthread_exit`` as it re-takes the GIL on the way out of the call. That forced
unwind runs through the binding's ``noexcept`` destructor, and the C++ runtime calls
``std::terminate``: the process prints "terminate called without an active exception" and dies
of SIGABRT after its work is done. A daemon thread asleep in Python (``time.sleep``,
``Event.wait``) is harmless: only C frames are unwound then.

So every such thread of pyckpt is started here. An :mod:`atexit` handler (atexit handlers run
before the interpreter starts finalizing, after non-daemon threads are joined) sets
:data:`stopping`, which the threads' loops watch, and joins them for up to :data:`EXIT_WAIT_S`:
a call to a healthy store returns in far less. A thread still inside a call after that waits on
a store that no longer answers (its server died or is wedged); the process then exits without
waiting out the store's own timeout.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable

__all__ = ["EXIT_WAIT_S", "start", "stopping"]

# How long the exit handler waits, in all, for the threads to leave their native calls.
EXIT_WAIT_S = 10.0

# Set when the interpreter exits: loops of the threads started here stop at their next check.
stopping = threading.Event()

_lock = threading.Lock()
_threads: set[threading.Thread] = set()
_registered = False


def start(target: Callable[[], None], name: str) -> threading.Thread:
    """Starts ``target`` in a daemon thread that the interpreter's exit waits for (up to
    :data:`EXIT_WAIT_S`). ``target`` should return soon once :data:`stopping` is set."""
    global _registered

    def run() -> None:
        try:
            target()
        finally:
            with _lock:
                _threads.discard(thread)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _lock:
        if not _registered:
            _registered = True
            atexit.register(_at_exit)
        _threads.add(thread)
    try:
        thread.start()
    except BaseException:
        with _lock:
            _threads.discard(thread)
        raise
    return thread


def _at_exit() -> None:
    stopping.set()
    deadline = time.monotonic() + EXIT_WAIT_S
    while True:
        with _lock:
            alive = [t for t in _threads if t.is_alive()]
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            return
        alive[0].join(left)
