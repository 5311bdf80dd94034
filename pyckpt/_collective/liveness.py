"""Liveness: bounded waits, heartbeats, and telling which rank was lost (the rules are in
:mod:`pyckpt._collective`'s docstring)."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

from pyckpt import _daemons
from pyckpt._collective.group import Group, _patience, _pg, bound_s, group_info
from pyckpt.errors import PeerLostError

__all__ = ["peer_errors", "bounded_group", "is_peer_failure"]

T = TypeVar("T")

# After a collective failed: how long this rank waits for the other survivors to report in,
# to tell which ranks are gone (the dead ones never do).
CHECK_IN_S = 5.0
# How often each rank's heartbeat counter advances in the group's store while it takes part
# in pyckpt's collectives (see _start_heartbeat).
HEARTBEAT_S = 2.0
_BEAT_PREFIX = "pyckpt/peer-beat/"
_STORE_PREFIX = "pyckpt/peer-alive/"
# Set in the group's store by the first rank that finds a collective of pyckpt failed.
_LOST_KEY = "pyckpt/peer-lost"
# How often a waiting collective asks the store whether another rank found the group broken.
_POLL_S = 1.0

# Process groups on which a collective of pyckpt failed: id -> (group object, what failed, the
# lost rank). The object is kept so that its id is not reused while the entry exists.
_lost: dict[int, tuple[Any, str, int | None]] = {}
_lost_lock = threading.Lock()


def _missing_ranks(group: Group) -> list[int] | None:
    """After a failed collective: the ranks that neither report in within :data:`CHECK_IN_S`
    nor beat meanwhile.

    Each survivor sets a key in the group's store and watches for the others' keys (every
    survivor's collective fails, so every survivor reports). None when the store cannot be
    reached either (it may be served by the lost process).
    """

    beats = [f"{_BEAT_PREFIX}{r}" for r in range(group.world)]

    def check_in(store: Any) -> list[int]:
        store.set(_LOST_KEY, str(group.rank))
        store.set(f"{_STORE_PREFIX}{group.rank}", "1")
        before = [store.add(k, 0) for k in beats]
        deadline = time.monotonic() + CHECK_IN_S
        while True:
            present = {r for r in range(group.world) if store.check([f"{_STORE_PREFIX}{r}"])}
            if len(present) == group.world or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        # A survivor still inside a collective pyckpt does not run (DCP's) cannot report in
        # yet; its heartbeat still advances.
        after = [store.add(k, 0) for k in beats]
        return [r for r in range(group.world) if r not in present and after[r] == before[r]]

    return _store_call(group, check_in, CHECK_IN_S + 2.0)


def _raise_lost(group: Group, what: str, cause: BaseException | None, waited: float | None,
                bound: float) -> None:
    pg = _pg(group)
    with _lost_lock:
        earlier = _lost.get(id(pg))
    if earlier is not None:
        _, during, lost = earlier
        who = "a rank" if lost is None else f"rank {lost}"
        raise PeerLostError(
            f"pyckpt: {what} on rank {group.rank}: the process group lost {who} during "
            f"{during}; it cannot be used any more (restart the job's ranks)", lost, what)
    missing = cause.ranks if isinstance(cause, _Silent) and cause.ranks else None
    if missing is None and not isinstance(cause, _StoreLost):
        missing = _missing_ranks(group)
    if missing is None and id(pg) in _dead_store:
        # The store refused the call: its process is gone. Where that is a rank's (rank 0's
        # with tcp:// or env:// initialisation), that rank is the one lost.
        host = _store_rank(group)
        missing = None if host is None or host == group.rank else [host]
    if missing:
        rank: int | None = missing[0]
        who = (f"rank {rank}" if len(missing) == 1
               else "ranks " + ", ".join(str(r) for r in missing))
        who += f" of {group.world}"
    else:
        rank = None
        who = "a rank" if missing is None else "a rank (every other rank is alive: one is stuck)"
    with _lost_lock:
        _lost[id(pg)] = (pg, what, rank)
    _never_free(pg)
    if isinstance(cause, _Reported):
        how = "another rank found the process group broken"
    elif isinstance(cause, _StoreLost) or (missing and id(pg) in _dead_store):
        how = "the process group's store, served by its process, closed its connection"
    elif isinstance(cause, _Silent):
        how = (f"no answer within {bound:g} s (PYCKPT_PEER_TIMEOUT) and no heartbeat for "
               f"{2.5 * HEARTBEAT_S:g} s")
    elif cause is None or "timed out" in str(cause).lower() or "timeout" in str(cause).lower():
        how = "no answer within the process group's timeout"
    else:
        how = "its connection closed"
    after = "" if waited is None else f" after {waited:.1f} s"
    detail = ""
    if cause is not None and not isinstance(cause, (_Reported, _Silent, _StoreLost)):
        detail = f" [{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]}]"
    raise PeerLostError(
        f"pyckpt: lost {who} during {what} on rank {group.rank}: {how}{after}; "
        f"the process group cannot be used any more (restart the job's ranks){detail}", rank,
        what) from cause


def _never_free(pg: Any) -> None:
    """Keeps a lost group alive until the process ends. Its operations still waiting on the
    lost rank (a frozen rank answers nothing; pyckpt's own collectives wait up to the job's
    timeout) hold its worker threads, and freeing the group joins them: the interpreter's exit
    then waited out that timeout after the job had handled PeerLostError. Never freed, the
    group's threads end with the process."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


class _Reported(Exception):
    """Another rank reported in the group's store that a collective of pyckpt failed there."""


# Process groups whose store did not answer (it may be served by the lost process): id -> group.
_no_store: dict[int, Any] = {}
# Those of them whose store refused the call (its connection closed: the process serving it is
# gone), as opposed to a call that only took too long: id -> group.
_dead_store: dict[int, Any] = {}


def _store_call(group: Group, fn: Callable[[Any], T], timeout: float) -> T | None:
    """``fn(store)`` on the group's store, given up after ``timeout`` s (None then, and the
    store is not asked again): a client of a store whose server died retries for the store's
    own timeout, which must not extend pyckpt's bound."""
    pg = _pg(group)
    if id(pg) in _no_store:
        return None
    out: list[T] = []

    failed: list[BaseException] = []

    def body() -> None:
        try:
            out.append(fn(pg.get_group_store()))
        except Exception as e:
            failed.append(e)

    thread = _daemons.start(body, "pyckpt-peer-store")  # in a store call: exit waits for it
    thread.join(timeout)
    if not out:
        _no_store[id(pg)] = pg
        if failed:
            _dead_store[id(pg)] = pg
        return None
    return out[0]


def _store_rank(group: Group) -> int | None:
    """The group rank whose process serves the group's store, when known: global rank 0's with
    ``init_method="tcp://..."`` or ``env://`` (torchrun's agent serves it instead:
    ``TORCHELASTIC_USE_AGENT_STORE``); None otherwise."""
    import os

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    try:
        import torch.distributed as dist

        return int(dist.get_group_rank(_pg(group), 0))
    except Exception:  # global rank 0 is not in the group, or no default group
        return None


class _StoreLost(Exception):
    """The group's store refused a call: the process serving it is gone."""


def _reported(group: Group) -> bool:
    return bool(_store_call(group, lambda store: store.check([_LOST_KEY]), 2.0))


class _Silent(Exception):
    """Ranks that stopped beating (see :func:`_silent_ranks`)."""

    def __init__(self, ranks: list[int] | None) -> None:
        super().__init__("no heartbeat")
        self.ranks = ranks


# Groups whose heartbeat thread runs. Weak: a group the job destroyed (and no longer holds) is
# freed then, not kept alive until the interpreter finalizes, where tearing down a gloo group
# can abort the process after its work is done.
_beating: weakref.WeakSet[Any] = weakref.WeakSet()


def _start_heartbeat(group: Group) -> None:
    """Starts (once per group and process) a daemon thread that increments this rank's counter
    in the group's store every :data:`HEARTBEAT_S`: a rank busy with local work between two
    collectives (stitching its own files, reading a large batch) keeps beating, a dead, stopped
    or wedged process does not."""
    pg = _pg(group)
    with _lost_lock:
        if pg in _beating:
            return
        _beating.add(pg)
    key = f"{_BEAT_PREFIX}{group.rank}"
    # The thread holds the group weakly (and its store, which does not keep the group alive):
    # it stops once the group is freed.
    group_ref = weakref.ref(pg)
    pg_id = id(pg)
    try:
        store = pg.get_group_store()
    except Exception:  # no store: waits fall back to the bound alone
        return
    del pg

    def beat() -> None:
        try:
            while (group_ref() is not None and pg_id not in _lost
                   and not _daemons.stopping.is_set()):
                store.add(key, 1)
                _daemons.stopping.wait(HEARTBEAT_S)
        except Exception:  # the store is gone: waits fall back to the bound alone
            pass

    # Not a bare daemon thread: one still inside store.add at interpreter exit aborts the
    # process (see _daemons); the exit stops the beat and waits for the call to return.
    _daemons.start(beat, "pyckpt-peer-heartbeat")


def _silent_ranks(group: Group) -> list[int] | None:
    """Ranks whose heartbeat did not advance over 2.5 beats; None when the store is gone."""
    keys = [f"{_BEAT_PREFIX}{r}" for r in range(group.world)]
    first = _store_call(group, lambda st: [st.add(k, 0) for k in keys], 5.0)
    if first is None:
        return None
    time.sleep(2.5 * HEARTBEAT_S)
    second = _store_call(group, lambda st: [st.add(k, 0) for k in keys], 5.0)
    if second is None:
        return None
    return [r for r in range(group.world) if r != group.rank and second[r] == first[r]]


def _run(group: Group, what: str, options: Any, start: Callable[[Any], Any]) -> None:
    """Starts one collective and waits for it; raises PeerLostError when a rank is lost.

    While waiting, every :data:`_POLL_S` the group's store is asked whether another rank has
    already found the group broken: a survivor that waits on another survivor (one that left
    the collective when its own transfer with the dead rank failed) learns it within a second.
    Each time :func:`bound_s` passes without the operation completing, the other ranks'
    heartbeats are checked: a rank that stopped beating is lost; if every rank still beats
    (busy with local work), the wait goes on, up to the group's own timeout, which then fails
    the operation.
    """
    pg = _pg(group)
    if id(pg) in _lost:
        _raise_lost(group, what, None, None, 0.0)
    _start_heartbeat(group)
    patience = _patience.get(pg)
    if patience is not None:  # the group's default is the bound: wait for busy ranks longer
        options.timeout = timedelta(seconds=patience)
    started: list[Any] = []

    def poll(seconds: float) -> bool:
        if not started:  # inside the bounded wait: a failure to start is a lost peer too
            started.append(start(options))
        work = started[0]
        try:
            work.wait(timedelta(seconds=seconds))
            return True
        except RuntimeError:
            if work.is_completed():
                # Either the operation itself failed, or it completed between the timed wait
                # giving up and this check (a loaded machine): a second wait returns or raises
                # the operation's own error, never the poll's timeout. (Raising the timeout
                # here reported a healthy group as lost.)
                work.wait()
                return True
            return False  # this rank's poll interval elapsed; the operation still runs

    def completed() -> bool:
        if started and started[0].is_completed():
            started[0].wait()
            return True
        return False

    _wait_bounded(group, what, poll, completed)


def _wait_bounded(group: Group, what: str, poll: Callable[[float], bool],
                  completed: Callable[[], bool]) -> None:
    """The bounded wait of :func:`_run`: ``poll(seconds)`` waits up to that long and says
    whether the operation completed (raising its error); ``completed()`` looks without
    waiting. Raises PeerLostError when a rank is lost."""
    bound = bound_s(group)
    t0 = time.monotonic()
    deadline = t0 + bound
    try:
        while not poll(_POLL_S):
            if _reported(group):
                raise _Reported("another rank found the process group broken")
            if id(_pg(group)) in _dead_store:
                # No survivor can report through the store any more: waiting out the bound
                # would only delay the error (the process serving the store is gone).
                raise _StoreLost("the process group's store closed its connection")
            if time.monotonic() >= deadline:
                silent = _silent_ranks(group)
                if completed():
                    # It completed during the heartbeat check: a rank that joined meanwhile may
                    # have left at once and stopped beating (its job ended), which is no loss.
                    return
                if silent is None or silent:
                    raise _Silent(silent)
                deadline = time.monotonic() + bound  # every rank is alive: wait on
    except (RuntimeError, _Reported, _Silent, _StoreLost) as e:  # gloo's (DistBackendError...)
        _raise_lost(group, what, e, time.monotonic() - t0, bound)


# gloo's reports of a peer that died or stopped answering (and Work.wait's timeout).
_PEER_FAILURES = ("Connection closed by peer", "Read error", "Write error", "Socket closed",
                  "Connection reset", "Broken pipe", "Timed out waiting",
                  "timeout caused pair closure", "Operation timed out!")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the transport's report of a peer that died or stopped answering."""
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError"):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in _PEER_FAILURES)


@contextlib.contextmanager
def peer_errors(process_group: Any, what: str) -> Iterator[None]:
    """Turns the transport's error about a lost peer, raised by collectives pyckpt does not run
    itself (DCP's planning and result exchanges of a save or load), into a
    :class:`~pyckpt.errors.PeerLostError` naming the rank. Those collectives keep the process
    group's own timeout: pyckpt cannot tell how long the slowest rank's writes take."""
    try:
        yield
    except PeerLostError:
        raise
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        try:
            group = group_info(process_group)
        except ValueError:
            raise e from None
        if not group.distributed:
            raise
        _raise_lost(group, what, e, None, bound_s(group))


@contextlib.contextmanager
def bounded_group(process_group: Any) -> Iterator[None]:
    """Lowers the process group's own timeout to :func:`bound_s` for the duration (restored
    after): for operations in which no collective waits for another rank's bulk I/O, so that
    collectives pyckpt does not run itself (DCP's planning exchanges of a node-local load, whose
    reads end with an exchange every rank takes part in) are bounded as well."""
    try:
        group = group_info(process_group)
    except ValueError:
        group = Group(None, 0, 1, False)
    backend = None
    if group.distributed:
        try:
            import torch

            backend = _pg(group)._get_backend(torch.device("cpu"))
            before = backend.options._timeout
            bound = timedelta(seconds=bound_s(group))
            if bound < before:
                backend.set_timeout(bound)
            else:
                backend = None
        except Exception:  # another backend: its own timeout applies
            backend = None
    try:
        yield
    finally:
        if backend is not None:
            backend.set_timeout(before)
