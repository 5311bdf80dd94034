"""The agreement rounds of an export: :func:`pyckpt._collective.agree` in one collective.

An export agrees three times (on the plan, on every rank's share being written, on the commit).
:func:`pyckpt._collective.agree` moves each outcome with two collectives, its length and then
its bytes. Here the first collective carries the length together with the first bytes, in a
buffer of fixed capacity: outcomes that fit (a status, a byte count, the file names, the plan of
a model of a few hundred tensors) need that one collective; a larger one sends the rest in a
second. The rules are those of ``agree``: ``fn``'s exceptions are caught, every rank learns
every outcome, and on a failure every rank runs ``on_failure`` and raises (its own failure, or
the lowest failing rank's, with a note naming it); lost peers raise
:class:`~pyckpt.errors.PeerLostError` within the same bounds.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from typing import Any, TypeVar

from pyckpt._collective import (
    Group,
    _device,
    _options,
    _pg,
    _run,
    _to_bytes,
    add_note,
    portable,
)

__all__ = ["agree", "ROOT_INLINE", "ALL_INLINE"]

T = TypeVar("T")

#: Bytes of a broadcast from rank 0 carried by its first collective (the plan of an export of a
#: few hundred tensors fits).
ROOT_INLINE = 64 << 10
#: Bytes of each rank's contribution to an all-gather carried by the first collective (a status
#: and a byte count fit; an exception with a long message may not).
ALL_INLINE = 1 << 10

_LEN = struct.Struct("<Q")


def _frame(data: bytes, inline: int) -> Any:
    """A uint8 tensor of 8 + ``inline`` bytes: the length of ``data``, then its first bytes."""
    import torch

    buf = bytearray(_LEN.size + inline)
    _LEN.pack_into(buf, 0, len(data))
    head = data[:inline]
    buf[_LEN.size:_LEN.size + len(head)] = head
    return torch.frombuffer(buf, dtype=torch.uint8)


def _unframe(frame: Any, inline: int) -> tuple[int, bytes]:
    raw = _to_bytes(frame, _LEN.size + inline)
    (length,) = _LEN.unpack_from(raw, 0)
    return length, raw[_LEN.size:_LEN.size + min(length, inline)]


def broadcast(obj: Any, group: Group, what: str, inline: int = ROOT_INLINE) -> Any:
    """Rank 0's ``obj`` on every rank (one collective when its pickle fits ``inline`` bytes)."""
    if not group.distributed:
        return obj
    import torch

    pg = _pg(group)
    dev = _device(pg)
    root = group.rank == 0
    data = pickle.dumps(obj) if root else b""

    def bcast(t: Any) -> Callable[[Any], Any]:
        def start(opts: Any) -> Any:
            opts.rootRank, opts.rootTensor = 0, 0
            return pg.broadcast([t], opts)
        return start

    frame = _frame(data, inline).to(dev)
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


def all_gather(obj: Any, group: Group, what: str, inline: int = ALL_INLINE) -> list[Any]:
    """Every rank's ``obj`` by rank (one collective when every pickle fits ``inline`` bytes)."""
    if not group.distributed:
        return [obj]
    import torch

    pg = _pg(group)
    dev = _device(pg)
    data = pickle.dumps(obj)
    mine = _frame(data, inline).to(dev)
    outs = [torch.empty_like(mine) for _ in range(group.world)]
    _run(group, what, _options("AllgatherOptions"), lambda opts: pg.allgather([outs], [mine], opts))
    parts = [_unframe(o, inline) for o in outs]
    longest = max(length for length, _ in parts)
    if longest > inline:  # every rank sees the same lengths, so all take this second round
        extra = longest - inline
        tail = torch.zeros(extra, dtype=torch.uint8, device=dev)
        if len(data) > inline:
            tail[:len(data) - inline] = torch.frombuffer(bytearray(data[inline:]),
                                                         dtype=torch.uint8)
        tails = [torch.empty_like(tail) for _ in range(group.world)]
        _run(group, what, _options("AllgatherOptions"),
             lambda opts: pg.allgather([tails], [tail], opts))
        parts = [(length, head + (_to_bytes(t, length - inline) if length > inline else b""))
                 for (length, head), t in zip(parts, tails)]
    return [obj if r == group.rank else pickle.loads(parts[r][1]) for r in range(group.world)]


def agree(
    fn: Callable[[], T],
    group: Group,
    *,
    ranks: str = "all",
    on_failure: Callable[[], None] | None = None,
    what: str = "operation",
) -> tuple[T | None, list[Any]]:
    """:func:`pyckpt._collective.agree` (same arguments, results and failures), moving each
    outcome in one collective when it fits (see the module docstring)."""
    if ranks not in ("all", "root"):
        raise ValueError(f"ranks must be 'all' or 'root', got {ranks!r}")
    runs = ranks == "all" or group.rank == 0
    value: T | None = None
    error: BaseException | None = None
    if runs:
        try:
            value = fn()
        except Exception as e:
            error = e
    status = None if error is None else portable(error)
    if ranks == "root":
        value, status = broadcast((value, status), group, what)
        outcomes = [status]
        values: list[Any] = [value]
    else:
        gathered = all_gather((value, status) if group.distributed else (None, status), group,
                              what)
        outcomes = [s for _, s in gathered]
        values = [v for v, _ in gathered] if group.distributed else [value]
    failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
    if not failed:
        return value, values
    if on_failure is not None:
        on_failure()
    if error is not None:
        raise error
    bad_rank, remote = failed[0]
    add_note(remote, f"pyckpt: {what} failed on rank {bad_rank}")
    raise remote
