"""Counting the bytes this rank sends and receives in collectives, per kind of collective.

    with count_collective_bytes() as counts:
        pyckpt.save(state, path)
    counts.sent_total, counts.received_total, counts.as_dict()

Every collective of torch.distributed ends in a method of the ``ProcessGroup`` it runs on
(``dist.all_gather`` -> ``pg.allgather``, ``dist.gather_object`` -> ``pg.allgather`` of the sizes
and ``pg.gather`` of the pickles, ...), and pyckpt's own exchanges call those methods directly
(pyckpt/_collective/transport.py). The methods are wrapped here, at the class, so each tensor
collective is counted once however it was reached; ``by_api`` also attributes its bytes to the
outermost ``torch.distributed`` function that led to it (``gather_object``...), or to
``ProcessGroup.<method>`` when it was called directly.

Bytes are *logical*: the tensor bytes of this rank that other ranks receive, and the bytes of
other ranks this rank receives, each destination counted once (a broadcast's root sends its
tensor to each of the W - 1 others; a gatherer receives W - 1 pieces). Forwarding inside tree
or ring algorithms is not counted, so the figures compare methods, not wire traffic. An
all-reduce (or reduce-scatter) is counted as if each rank sent its contribution to every other
rank. A rank's own piece never counts. Counting is process-wide (every thread) while the
context is open; nesting is refused.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup

__all__ = ["CollectiveBytes", "count_collective_bytes"]

#: torch.distributed functions whose calls name the bytes of the tensor collectives below them.
API_FUNCTIONS = (
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced",
    "all_reduce_coalesced", "reduce_scatter_single", "gather", "scatter", "broadcast", "all_reduce",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier",
)


@dataclass
class CollectiveBytes:
    """What this rank sent and received while counting: bytes per tensor collective
    (``ProcessGroup`` method name), per outermost API function, and the calls of each."""

    sent: Counter[str] = field(default_factory=Counter)
    received: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)
    by_api: Counter[str] = field(default_factory=Counter)  # sent + received per API function
    uncounted: Counter[str] = field(default_factory=Counter)  # calls whose shape was unknown

    @property
    def sent_total(self) -> int:
        return sum(self.sent.values())

    @property
    def received_total(self) -> int:
        return sum(self.received.values())

    def as_dict(self) -> dict[str, Any]:
        return {"sent": dict(self.sent), "received": dict(self.received),
                "calls": dict(self.calls), "by_api": dict(self.by_api),
                "uncounted": dict(self.uncounted), "sent_total": self.sent_total,
                "received_total": self.received_total}


def _nb(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _tensors(x: Any) -> list[Any]:
    """A tensor or a (nested) list of tensors, flattened."""
    if isinstance(x, torch.Tensor):
        return [x]
    out: list[Any] = []
    for item in x:
        out.extend(_tensors(item))
    return out


def _total(x: Any) -> int:
    return sum(_nb(t) for t in _tensors(x))


def _others(pieces: list[Any], rank: int) -> int:
    return sum(_nb(t) for i, t in enumerate(pieces) if i != rank)


def _root(args: tuple[Any, ...], at: int) -> int:
    """The root rank of a rooted collective: its options' ``rootRank`` or a plain int."""
    arg = args[at]
    return int(getattr(arg, "rootRank", arg))


def _split_bytes(t: Any, splits: list[int], world: int, rank: int) -> int:
    """Bytes of ``t`` bound for (or coming from) the other ranks in an all-to-all."""
    if t.numel() == 0:
        return 0
    if not splits:
        return _nb(t) - _nb(t) // world
    row = _nb(t) // max(1, t.shape[0])
    return sum(n for i, n in enumerate(splits) if i != rank) * row


# Each: (args after self, world, rank) -> (sent, received).
def _allgather(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    outs = a[0]  # list (per input) of lists of W tensors
    return _total(a[1]) * (w - 1), sum(_others(list(o), r) for o in outs)


def _allgather_base(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    out, inp = _total(a[0]), _total(a[1])
    return inp * (w - 1), out - inp


def _gather(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    if _root(a, 2) == r:
        return 0, sum(_others(list(o), r) for o in a[0])
    return _total(a[1]), 0


def _scatter(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    if _root(a, 2) == r:
        return sum(_others(list(i), r) for i in a[1]), 0
    return 0, _total(a[0])


def _broadcast(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    n = _total(a[0])
    return (n * (w - 1), 0) if _root(a, 1) == r else (0, n)


def _allreduce(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    n = _total(a[0])
    return n * (w - 1), n * (w - 1)


def _reduce(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    n = _total(a[0])
    return (0, n * (w - 1)) if _root(a, 1) == r else (n, 0)


def _reduce_scatter(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    return sum(_others(list(i), r) for i in a[1]), _total(a[0]) * (w - 1)


def _reduce_scatter_base(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    out, inp = _total(a[0]), _total(a[1])
    return inp - out, out * (w - 1)


def _alltoall_base(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    out, inp, out_splits, in_splits = a[0], a[1], list(a[2]), list(a[3])
    return _split_bytes(inp, in_splits, w, r), _split_bytes(out, out_splits, w, r)


def _alltoall(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    return _others(list(a[1]), r), _others(list(a[0]), r)


def _send(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    return _total(a[0]), 0


def _recv(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    return 0, _total(a[0])


def _nothing(a: tuple[Any, ...], w: int, r: int) -> tuple[int, int]:
    return 0, 0


_METHODS: dict[str, Callable[[tuple[Any, ...], int, int], tuple[int, int]]] = {
    "allgather": _allgather,
    "allgather_coalesced": _allgather,
    "_allgather_base": _allgather_base,
    "allgather_into_tensor_coalesced": _allgather_base,
    "gather": _gather,
    "scatter": _scatter,
    "broadcast": _broadcast,
    "allreduce": _allreduce,
    "allreduce_coalesced": _allreduce,
    "reduce": _reduce,
    "reduce_scatter": _reduce_scatter,
    "_reduce_scatter_base": _reduce_scatter_base,
    "reduce_scatter_tensor_coalesced": _reduce_scatter_base,
    "alltoall_base": _alltoall_base,
    # torch >= 2.13's names (what its Python functions call now)
    "all_gather_single": _allgather_base,
    "all_gather_single_coalesced": _allgather_base,
    "reduce_scatter_single": _reduce_scatter_base,
    "reduce_scatter_single_coalesced": _reduce_scatter_base,
    "all_to_all_single": _alltoall_base,
    "alltoall": _alltoall,
    "send": _send,
    "recv": _recv,
    "recv_anysource": _recv,
    "barrier": _nothing,
}

_active_lock = threading.Lock()
_active = False


@contextlib.contextmanager
def count_collective_bytes() -> Iterator[CollectiveBytes]:
    """Counts this process's collective bytes while open (see the module docstring)."""
    global _active
    with _active_lock:
        if _active:
            raise RuntimeError("count_collective_bytes is already counting in this process")
        _active = True
    counts = CollectiveBytes()
    lock = threading.Lock()
    outer = threading.local()
    saved_methods: dict[str, Any] = {}
    saved_api: list[tuple[Any, str, Any]] = []

    def method_wrapper(name: str, orig: Any,
                       sizes: Callable[[tuple[Any, ...], int, int], tuple[int, int]]) -> Any:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            api = getattr(outer, "name", None) or f"ProcessGroup.{name}"
            try:
                sent, received = sizes(args, self.size(), self.rank())
                known = not kwargs
            except Exception:  # an overload this table does not know
                sent = received = 0
                known = False
            with lock:
                counts.calls[name] += 1
                counts.sent[name] += sent
                counts.received[name] += received
                counts.by_api[api] += sent + received
                if not known:
                    counts.uncounted[name] += 1
            return orig(self, *args, **kwargs)
        return wrapped

    def api_wrapper(name: str, orig: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if getattr(outer, "name", None) is not None:
                return orig(*args, **kwargs)
            outer.name = name
            try:
                return orig(*args, **kwargs)
            finally:
                outer.name = None
        return wrapped

    try:
        for name, sizes in _METHODS.items():
            orig = ProcessGroup.__dict__.get(name)
            if orig is None:
                continue
            saved_methods[name] = orig
            setattr(ProcessGroup, name, method_wrapper(name, orig, sizes))
        for name in API_FUNCTIONS:
            orig = getattr(c10d, name, None)
            if orig is None:
                continue
            wrapped = api_wrapper(name, orig)
            for module in (c10d, dist):
                if getattr(module, name, None) is orig:
                    saved_api.append((module, name, orig))
                    setattr(module, name, wrapped)
        yield counts
    finally:
        for module, name, orig in reversed(saved_api):
            setattr(module, name, orig)
        for name, orig in saved_methods.items():
            setattr(ProcessGroup, name, orig)
        with _active_lock:
            _active = False
