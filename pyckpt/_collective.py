"""Small collectives over a ``torch.distributed`` process group (objects, not tensors).

Used by consolidation and by node-local checkpoints. ``torch`` is imported lazily: a single
process without ``torch.distributed`` works too (every function then acts on one rank).

No collective here waits forever on a lost rank (docs/RELIABILITY.md, "Peers that die"):

* a rank that sees a collective fail (gloo reports a closed connection at once when a peer
  dies) marks the group lost, sets a key in the group's store, and raises
  :class:`~pyckpt.errors.PeerLostError`; every waiting rank polls that key each second, so a
  survivor that waits on another survivor (one that left the collective) stops too;
* a wait longer than :func:`bound_s` (``PYCKPT_PEER_TIMEOUT``, default 300 s) checks the other
  ranks' heartbeats (a counter each rank's daemon thread advances in the store every 2 s): a
  rank that stopped beating is lost; ranks that still beat are busy with local work, and the
  wait goes on (up to the group's own timeout);
* the survivors report in through the store (:func:`_missing_ranks`), so each names the rank
  that did not;
* any later collective of pyckpt on a lost group raises at once instead of entering an
  operation the other ranks will never match.
"""

from __future__ import annotations

import atexit
import contextlib
import pickle
import queue
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from pyckpt import _daemons, _knobs
from pyckpt.errors import PeerLostError, PyckptError

__all__ = ["Group", "group_info", "broadcast", "all_gather", "all_to_all_single", "bound_s",
           "peer_errors", "bounded_group", "peer_group", "portable", "add_note", "agree",
           "agree_then_root"]

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


@dataclass(frozen=True)
class Group:
    """This process's place in a process group (``pg`` is None when not distributed)."""

    pg: Any
    rank: int
    world: int
    distributed: bool


def group_info(process_group: Any) -> Group:
    """Rank and size of ``process_group`` (default: the default group when initialised).

    Raises:
        ValueError: ``process_group`` was given but ``torch.distributed`` is unavailable or not
            initialised, or this process is not a member of it.
    """
    if process_group is None and "torch.distributed" not in sys.modules:
        # No group can be initialised before torch.distributed is imported: a single process,
        # told without importing torch (seconds: a CLI command or a script that never uses it).
        return Group(None, 0, 1, False)
    try:
        import torch.distributed as dist
    except ImportError:  # torch is optional: a single process then
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is unavailable") from None
        return Group(None, 0, 1, False)
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is not initialised")
        return Group(None, 0, 1, False)
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("this process is not a member of process_group")
    return Group(process_group, rank, dist.get_world_size(process_group), True)


def _pg(group: Group) -> Any:
    import torch.distributed as dist

    return group.pg if group.pg is not None else dist.group.WORLD


def bound_s(group: Group) -> float:
    """Seconds one collective of pyckpt waits before it checks the other ranks' heartbeats:
    ``PYCKPT_PEER_TIMEOUT`` (default 300), capped at the process group's own timeout where it
    can be read."""
    bound = float(_knobs.peer_timeout())
    try:
        import torch

        own = _pg(group)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        if own > 0:
            bound = min(bound, own)
    except Exception:  # another backend or torch version: the knob alone
        pass
    return bound


# Groups made by peer_group: group -> the seconds pyckpt's own collectives on it wait for ranks
# that still beat (the job's own timeout; the group's default, which DCP's collectives use, is
# the peer bound). Weak, as _beating.
_patience: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def peer_group(ranks: list[int]) -> Any:
    """A new gloo group over the global ``ranks`` for pyckpt's background work (the manager's),
    bounded as every exchange of pyckpt is.

    Its default timeout, which collectives pyckpt does not run itself use (DCP's planning and
    result exchanges), is :func:`bound_s` of the default group (``PYCKPT_PEER_TIMEOUT``, capped
    at the job's own timeout), not torch's 30 minutes: a frozen or dead rank there fails the
    collective within the bound. pyckpt's own collectives on it keep their heartbeat check and
    wait for ranks that still beat up to the job's own timeout (the default group's).
    """
    import torch
    import torch.distributed as dist

    job = None
    try:
        world: Any = dist.group.WORLD
        job = world._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # another backend or torch version: torch's default
        pass
    if not job or job <= 0:
        job = dist.default_pg_timeout.total_seconds()
    bound = min(float(_knobs.peer_timeout()), job)
    pg = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                        timeout=timedelta(seconds=bound))
    _patience[pg] = job
    return pg


def _device(pg: Any) -> Any:
    import torch
    import torch.distributed as dist

    if dist.get_backend(pg) == "nccl":  # object collectives then travel as CUDA tensors
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


def _options(name: str) -> Any:
    from torch._C import _distributed_c10d as c10d

    return getattr(c10d, name)()


def _to_bytes(t: Any, n: int) -> bytes:
    return bytes(t[:n].cpu().numpy().tobytes())


#: Bytes of a broadcast's pickle carried by its first collective: the outcome of a step, a
#: file list, the plan of an export of a few hundred tensors fit, and need one collective; a
#: larger object sends the rest in a second.
BROADCAST_INLINE = 64 << 10
#: Bytes of each rank's pickle carried by an all-gather's first collective (a status and a few
#: numbers fit): at most this, and less in large groups (:func:`gather_inline`).
GATHER_INLINE = 512
#: Bound on the whole gathered buffer of a first collective (world x per-rank inline bytes), so
#: a round in a group of thousands of ranks moves at most this much per rank however small its
#: outcome; per-rank inline bytes never drop below :data:`GATHER_INLINE_MIN`.
GATHER_INLINE_TOTAL = 256 << 10
GATHER_INLINE_MIN = 64


def gather_inline(world: int) -> int:
    """Per-rank inline bytes of an all-gather in a group of ``world`` ranks: 512 up to 512
    ranks, then ``GATHER_INLINE_TOTAL // world`` (64 from 4096 ranks on)."""
    return max(GATHER_INLINE_MIN, min(GATHER_INLINE, GATHER_INLINE_TOTAL // max(1, world)))

_LEN = struct.Struct("<Q")


def _frame(data: bytes, inline: int, dev: Any) -> Any:
    """A uint8 tensor of 8 + ``inline`` bytes: the length of ``data``, then its first bytes."""
    import torch

    buf = bytearray(_LEN.size + inline)
    _LEN.pack_into(buf, 0, len(data))
    head = data[:inline]
    buf[_LEN.size:_LEN.size + len(head)] = head
    return torch.frombuffer(buf, dtype=torch.uint8).to(dev)


def _unframe(frame: Any, inline: int) -> tuple[int, bytes]:
    """The length and the inline bytes of a frame made by :func:`_frame`."""
    raw = _to_bytes(frame, _LEN.size + inline)
    (length,) = _LEN.unpack_from(raw, 0)
    return length, raw[_LEN.size:_LEN.size + min(length, inline)]


def broadcast(obj: Any, group: Group, src: int = 0, what: str = "a broadcast",
              inline: int = BROADCAST_INLINE) -> Any:
    """``obj`` of group rank ``src`` on every rank: one collective when its pickle fits
    ``inline`` bytes (the length travels with the first bytes), a second for the rest.

    Raises:
        PeerLostError: a rank died or did not answer within :func:`bound_s`.
    """
    if not group.distributed:
        return obj
    import torch

    pg = _pg(group)
    dev = _device(pg)
    root = group.rank == src
    data = pickle.dumps(obj) if root else b""

    def bcast(t: Any) -> Callable[[Any], Any]:
        def start(opts: Any) -> Any:
            opts.rootRank, opts.rootTensor = src, 0
            return pg.broadcast([t], opts)
        return start

    frame = _frame(data, inline, dev)
    _run(group, what, _options("BroadcastOptions"), bcast(frame))
    if root:
        if len(data) > inline:
            rest = torch.frombuffer(bytearray(data[inline:]), dtype=torch.uint8).to(dev)
            _run(group, what, _options("BroadcastOptions"), bcast(rest))
        return obj
    length, head = _unframe(frame, inline)
    if length > inline:
        rest = torch.empty(length - inline, dtype=torch.uint8, device=dev)
        _run(group, what, _options("BroadcastOptions"), bcast(rest))
        head += _to_bytes(rest, length - inline)
    return pickle.loads(head)


def all_gather(obj: Any, group: Group, what: str = "an exchange of state",
               inline: int | None = None) -> list[Any]:
    """Every rank's ``obj``, indexed by group rank: one collective when every rank's pickle
    fits ``inline`` bytes (default :func:`gather_inline` of the group's size), a second (sized
    by the longest) for the rest.

    Raises:
        PeerLostError: a rank died or did not answer within :func:`bound_s`.
    """
    if not group.distributed:
        return [obj]
    import torch

    if inline is None:
        inline = gather_inline(group.world)
    pg = _pg(group)
    dev = _device(pg)
    data = pickle.dumps(obj)
    mine = _frame(data, inline, dev)
    outs = [torch.empty_like(mine) for _ in range(group.world)]
    _run(group, what, _options("AllgatherOptions"),
         lambda opts: pg.allgather([outs], [mine], opts))
    parts = [_unframe(o, inline) for o in outs]
    longest = max(length for length, _ in parts)
    if longest > inline:  # every rank saw the same lengths: all take this second collective
        tail = torch.zeros(longest - inline, dtype=torch.uint8, device=dev)
        if len(data) > inline:
            tail[:len(data) - inline] = torch.frombuffer(bytearray(data[inline:]),
                                                         dtype=torch.uint8)
        tails = [torch.empty_like(tail) for _ in range(group.world)]
        _run(group, what, _options("AllgatherOptions"),
             lambda opts: pg.allgather([tails], [tail], opts))
        parts = [(length, head + (_to_bytes(t, length - inline) if length > inline else b""))
                 for (length, head), t in zip(parts, tails)]
    return [obj if r == group.rank else pickle.loads(parts[r][1]) for r in range(group.world)]


def all_to_all_single(recv: Any, send: Any, recv_sizes: list[int], send_sizes: list[int],
                      group: Group, what: str = "a transfer between ranks") -> None:
    """``torch.distributed.all_to_all_single`` with pyckpt's bounded wait (CPU tensors).

    Raises:
        PeerLostError: a rank died or did not answer within :func:`bound_s`.
    """
    pg = _pg(group)
    _run(group, what, _options("AllToAllOptions"),
         lambda opts: pg.alltoall_base(recv, send, list(recv_sizes), list(send_sizes), opts))


def portable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a PyckptError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return PyckptError(f"{type(exc).__name__}: {exc}")


def add_note(exc: BaseException, text: str) -> None:
    """``exc.add_note(text)`` where Python has it (3.11+); a no-op on 3.10."""
    method = getattr(exc, "add_note", None)
    if method is not None:
        method(text)


def _check_root(group: Group, root: int) -> None:
    """Refuses a root that is not a rank of ``group`` (before any step runs)."""
    if not 0 <= root < max(group.world, 1):
        raise ValueError(f"root must be a rank of the group (0..{group.world - 1}), got {root}")


def agree(
    fn: Callable[[], T],
    group: Group,
    *,
    ranks: str = "all",
    on_failure: Callable[[], None] | None = None,
    what: str = "operation",
    root: int = 0,
) -> tuple[T | None, list[Any]]:
    """Runs ``fn`` on every rank (or only ``root``), agrees on success, re-raises the first
    failure.

    Every rank of ``group`` must call this at the same point. ``fn``'s exceptions (``Exception``
    only: a ``KeyboardInterrupt`` propagates at once) are caught; then every rank learns every
    rank's outcome. If any rank failed, ``on_failure`` runs on every rank (cleanup), and every
    rank raises: a rank whose ``fn`` failed raises its own exception; the others raise the
    failure of the lowest failing rank (the same type when it can be pickled, with a note
    naming that rank).

    Args:
        fn: the work of this rank.
        group: from :func:`group_info`.
        ranks: ``"all"`` (every rank runs ``fn``) or ``"root"`` (only group rank ``root``
            does; its result is returned on every rank, so it must be picklable).
        on_failure: cleanup run on every rank when any rank failed, before raising.
        what: names the step in the note added to a re-raised remote failure.
        root: the rank that runs ``fn`` with ``ranks="root"`` (default 0).

    Returns:
        ``(value, values)``: this rank's result (``root``'s for ``ranks="root"``) and the list
        of every rank's result (``[value]`` for ``ranks="root"``).
    """
    if ranks not in ("all", "root"):
        raise ValueError(f"ranks must be 'all' or 'root', got {ranks!r}")
    _check_root(group, root)
    runs = ranks == "all" or group.rank == root
    value: T | None = None
    error: BaseException | None = None
    if runs:
        try:
            value = fn()
        except Exception as e:
            error = e
    status = None if error is None else portable(error)
    if ranks == "root":
        value, status = broadcast((value, status), group, src=root, what=what)
        failed = [] if status is None else [(root, status)]
        values: list[Any] = [value]
    else:
        gathered = all_gather((value, status) if group.distributed else (None, status), group,
                              what=what)
        failed = [(r, s) for r, (_, s) in enumerate(gathered) if s is not None]
        values = [v for v, _ in gathered] if group.distributed else [value]
    if not failed:
        return value, values
    if on_failure is not None:
        on_failure()
    if error is not None:
        raise error
    bad_rank, remote = failed[0]
    add_note(remote, f"pyckpt: {what} failed on rank {bad_rank}")
    raise remote


#: Tag of the point-to-point messages of :func:`agree_then_root` (gloo takes 32-bit tags; user
#: messages on the same group use their own).
REPORT_TAG = 0x7079636B
#: Bytes of a report or an answer of :func:`agree_then_root` carried by its first message (a
#: status, or a short error, fits); a longer pickle sends the rest in a second message.
REPORT_INLINE = 512


def agree_then_root(
    fn: Callable[[], T],
    root_fn: Callable[[], Any],
    group: Group,
    *,
    on_failure: Callable[[], None] | None = None,
    what: str = "operation",
    root_what: str = "commit",
    root: int = 0,
) -> tuple[T | None, Any, float]:
    """``agree(fn, group)`` then, when every rank succeeded, ``agree(root_fn, group,
    ranks="root", root=root)``: the same outcomes on every rank, in two messages per rank
    instead of two rounds of collectives.

    Each rank reports its outcome to ``root``, and ``root`` answers every rank once it has run
    ``root_fn`` (an export's commit). Every receive is posted before ``fn`` runs, so the rank
    that finishes last sends its report straight into the root's waiting buffer and is answered
    without waiting on another rank in between. An all-gather after ``fn`` waits on the idle
    ranks too: with gloo its last rank to arrive needs a message back from each rank that was
    already waiting (and asleep): the two rounds after an export's copies took longer than these
    messages (``benchmarks/export_tail.py``; BENCHMARKS.md, "The rounds after the copies").

    When the root itself finishes ``fn`` last, the reports are already in when it does, and
    only its answer is on the way to the end: one message instead of two. A caller that knows
    which rank usually finishes last (an export's last rank, which starts copying after rank 0
    has planned) makes it the root.

    Failures follow :func:`agree`: when any rank's ``fn`` failed, ``root_fn`` does not run,
    ``on_failure`` runs on every rank, a failing rank raises its own exception and the others
    the lowest failing rank's (with a note naming it); when ``root_fn`` fails, the same with
    the root's exception. Waits are bounded as every collective's here (a lost rank raises
    :class:`~pyckpt.errors.PeerLostError`). A group whose collectives travel as CUDA tensors
    (NCCL) takes the two rounds of collectives instead.

    Returns:
        ``(value, root_value, root_seconds)``: this rank's ``fn`` result, ``root_fn``'s result
        on ``root`` (None on the others), and the seconds the root spent in ``root_fn`` (on
        every rank).
    """
    _check_root(group, root)
    if not group.distributed or group.world == 1 or _device(_pg(group)).type != "cpu":
        return _agree_then_root_rounds(fn, root_fn, group, on_failure, what, root_what, root)
    pg = _pg(group)
    if id(pg) in _lost:
        _raise_lost(group, what, None, None, 0.0)
    _start_heartbeat(group)  # a rank busy in fn keeps beating while rank 0 waits for it
    waiter = _Waiter.acquire()
    try:
        return _agree_then_root_messages(fn, root_fn, group, waiter, on_failure, what,
                                         root_what, root)
    finally:
        waiter.release()


def _agree_then_root_messages(
    fn: Callable[[], T],
    root_fn: Callable[[], Any],
    group: Group,
    waiter: _Waiter,
    on_failure: Callable[[], None] | None,
    what: str,
    root_what: str,
    root: int,
) -> tuple[T | None, Any, float]:
    """:func:`agree_then_root` in point-to-point messages (gloo)."""
    pg = _pg(group)
    others = [r for r in range(group.world) if r != root]
    if group.rank == root:
        posted = {r: _post_report(pg, waiter, r) for r in others}
    else:
        answer = _post_report(pg, waiter, root)
    value: T | None = None
    root_value: Any = None
    error: BaseException | None = None
    try:
        value = fn()
    except Exception as e:
        error = e
    except BaseException as e:  # Ctrl-C, exit: leave at once, after telling the others
        _tell_interrupted(group, waiter, e, what, root)
        raise
    status = None if error is None else portable(error)
    # The answer: None, or (failing rank, its exception, the step that failed there).
    failed: tuple[int, BaseException, str] | None
    if group.rank != root:
        sent = _send_report(group, waiter, status, root)
        failed, root_seconds = _receive_report(group, waiter, answer, root, root_what)
        for ticket in sent:  # answered, so received: these return at once
            waiter.wait(group, ticket, what)
    else:
        failed = None
        for r in range(group.world):  # the lowest failing rank's outcome is the one raised
            remote = status if r == root else _receive_report(group, waiter, posted[r], r, what)
            if remote is not None and failed is None:
                failed = (r, remote, what)
        root_seconds = 0.0
        if failed is None:
            t0 = time.perf_counter()
            try:
                root_value = root_fn()
            except Exception as e:
                error = e
                failed = (root, portable(e), root_what)
            root_seconds = time.perf_counter() - t0
        sent = [t for r in others for t in _send_report(group, waiter, (failed, root_seconds), r)]
        for ticket in sent:
            waiter.wait(group, ticket, root_what)
    if failed is None:
        return value, root_value, root_seconds
    if on_failure is not None:
        on_failure()
    if error is not None:
        raise error
    bad_rank, remote, step = failed
    add_note(remote, f"pyckpt: {step} failed on rank {bad_rank}")
    raise remote


def _tell_interrupted(group: Group, waiter: _Waiter, exc: BaseException, what: str,
                      root: int) -> None:
    """A rank interrupted in :func:`agree_then_root`'s step (``KeyboardInterrupt``,
    ``SystemExit``) sends what it owes without waiting: the others fail the step at once, with
    a PyckptError naming it, instead of waiting for a rank that is gone or has moved on, and
    every receive posted for this call is still matched (the group stays in step). The root
    answers every rank; another rank reports to the root. Its waiting thread is then retired and
    ends once those messages have gone and the answer has come."""
    failure = PyckptError(f"{type(exc).__name__} on rank {group.rank} during {what}")
    try:
        if group.rank == root:
            for r in range(group.world):
                if r != root:
                    _send_report(group, waiter, ((root, failure, what), 0.0), r)
        else:
            _send_report(group, waiter, failure, root)
    except Exception:  # the group is broken too: the interrupt is what this rank raises
        pass


def _agree_then_root_rounds(
    fn: Callable[[], T],
    root_fn: Callable[[], Any],
    group: Group,
    on_failure: Callable[[], None] | None,
    what: str,
    root_what: str,
    root: int = 0,
) -> tuple[T | None, Any, float]:
    """:func:`agree_then_root` as two rounds of collectives (one process, or NCCL)."""
    def timed() -> tuple[Any, float]:
        t0 = time.perf_counter()
        return root_fn(), time.perf_counter() - t0

    value, _ = agree(fn, group, on_failure=on_failure, what=what)
    done, _ = agree(timed, group, ranks="root", on_failure=on_failure, what=root_what,
                    root=root)
    assert done is not None
    return value, done[0] if group.rank == root else None, done[1]


class _Waiter:
    """Waits, on one daemon thread, for point-to-point works in the order they are added.

    Untimed waits: a timed wait on a gloo send or receive that times out closes every
    connection of the group ("Application timeout caused pair closure"), so pyckpt's bound
    cannot come from the work's own timeout. The thread waits; the caller waits for each work
    with :meth:`wait`, bounded as a collective is (:func:`_wait_bounded`).

    Reused from call to call (:meth:`acquire`, :meth:`release`): starting a thread per call was
    a measurable part of a small export (BENCHMARKS.md, "The rounds after the copies"). A call that leaves a work unfinished (its peer was
    lost) retires its waiter, whose thread may stay blocked in that work; concurrent calls get
    waiters of their own. The interpreter's exit ends the parked one (an exit handler
    registered after :mod:`pyckpt._daemons`'s runs before it).
    """

    _parked: _Waiter | None = None
    _lock = threading.Lock()
    _exit_registered = False

    @classmethod
    def acquire(cls) -> _Waiter:
        """The parked waiter, or a new one when none is parked (first use, a retired one, or
        another call holding it)."""
        with cls._lock:
            waiter, cls._parked = cls._parked, None
        if waiter is None:
            waiter = cls()
            with cls._lock:
                if not cls._exit_registered:  # after _daemons' handler: runs before it
                    cls._exit_registered = True
                    atexit.register(cls._close_parked)
        return waiter

    @classmethod
    def _close_parked(cls) -> None:
        with cls._lock:
            waiter, cls._parked = cls._parked, None
        if waiter is not None:
            waiter.close()

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: list[threading.Event] = []
        self._thread = _daemons.start(self._loop, "pyckpt-report-wait")

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, done, errors = item
            try:
                work.wait()
            except BaseException as e:  # the group's transport failed: the caller raises
                errors.append(e)
            done.set()

    def add(self, work: Any) -> tuple[Any, threading.Event, list[BaseException]]:
        """Queues ``work``; returns the ticket :meth:`wait` takes."""
        ticket: tuple[Any, threading.Event, list[BaseException]] = (work, threading.Event(), [])
        self._pending.append(ticket[1])
        self._queue.put(ticket)
        return ticket

    def wait(self, group: Group, ticket: tuple[Any, threading.Event, list[BaseException]],
             what: str) -> None:
        """Waits for a queued work, bounded; raises PeerLostError when a rank is lost."""
        _, done, errors = ticket

        def poll(seconds: float) -> bool:
            if not done.wait(seconds):
                return False
            if errors:
                raise errors[0]
            return True

        _wait_bounded(group, what, poll, done.is_set)

    def release(self) -> None:
        """At the end of a call: parks the waiter for the next call if every work it was given
        has finished (and no other is parked), else ends or retires it (see the class)."""
        pending, self._pending = self._pending, []
        if all(done.is_set() for done in pending):
            with _Waiter._lock:
                if _Waiter._parked is None:
                    _Waiter._parked = self
                    return
        self.close()

    def close(self) -> None:
        """Ends the thread once the works queued so far are waited for."""
        self._queue.put(None)


def _post_report(pg: Any, waiter: _Waiter, src: int) -> tuple[Any, Any]:
    """Posts the receive of the first message of a report from group rank ``src``: (buffer,
    ticket of ``waiter``)."""
    import torch

    buf = torch.empty(_LEN.size + REPORT_INLINE, dtype=torch.uint8)
    return buf, waiter.add(pg.recv([buf], src, REPORT_TAG))


def _send_report(group: Group, waiter: _Waiter, obj: Any, dst: int) -> list[Any]:
    """Sends ``obj`` to group rank ``dst``, whose receive of the first message is posted;
    returns the tickets of the sends (the tensors must live until they complete)."""
    import torch

    pg = _pg(group)
    data = pickle.dumps(obj)
    frame = _frame(data, REPORT_INLINE, torch.device("cpu"))
    tickets = [waiter.add(pg.send([frame], dst, REPORT_TAG))]
    if len(data) > REPORT_INLINE:
        rest = torch.frombuffer(bytearray(data[REPORT_INLINE:]), dtype=torch.uint8)
        tickets.append(waiter.add(pg.send([rest], dst, REPORT_TAG)))
    return tickets


def _receive_report(group: Group, waiter: _Waiter, posted: tuple[Any, Any], src: int,
                    what: str) -> Any:
    """Waits for the report posted by :func:`_post_report` (and its second message, if any)."""
    import torch

    buf, ticket = posted
    waiter.wait(group, ticket, what)
    length, head = _unframe(buf, REPORT_INLINE)
    if length > REPORT_INLINE:
        rest = torch.empty(length - REPORT_INLINE, dtype=torch.uint8)
        waiter.wait(group, waiter.add(_pg(group).recv([rest], src, REPORT_TAG)), what)
        head += _to_bytes(rest, length - REPORT_INLINE)
    return pickle.loads(head)
