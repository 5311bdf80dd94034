"""Transport: object collectives (pickles in uint8 tensors) over the bounded wait of
:mod:`pyckpt._collective.liveness`."""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from typing import Any

from pyckpt._collective.group import Group, _device, _pg
from pyckpt._collective.liveness import _run

__all__ = ["broadcast", "all_gather", "all_to_all_single", "gather_inline", "gather", "scatter"]


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


def _framed(obj: Any, group: Group, inline: int | None) -> tuple[Any, Any, bytes, Any, int]:
    """For a gather: the group's process group and device, ``obj``'s pickle, its frame and the
    inline bytes (default :func:`gather_inline` of the group's size)."""
    if inline is None:
        inline = gather_inline(group.world)
    pg = _pg(group)
    dev = _device(pg)
    data = pickle.dumps(obj)
    return pg, dev, data, _frame(data, inline, dev), inline


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

    pg, dev, data, mine, inline = _framed(obj, group, inline)
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


def _p2p(group: Group, what: str, send: bool, tensor: Any, peer: int) -> None:
    """One point-to-point transfer over the bounded wait (the options only carry a timeout)."""
    pg = _pg(group)
    _run(group, what, _options("AllgatherOptions"),
         lambda _opts: (pg.send if send else pg.recv)([tensor], peer, _TAIL_TAG))


_TAIL_TAG = 0x7C3


def gather(obj: Any, group: Group, root: int = 0, what: str = "a gather",
           inline: int | None = None) -> list[Any] | None:
    """Every rank's ``obj`` on group rank ``root`` (indexed by group rank), None elsewhere.

    One collective in which each rank sends a frame of ``inline`` bytes (default
    :func:`gather_inline`): a rank whose pickle is longer sends the rest to ``root`` point to
    point. A rank other than ``root`` sends what its own object needs and receives nothing.

    Raises:
        PeerLostError: a rank died or did not answer within :func:`bound_s`.
    """
    if not group.distributed:
        return [obj]
    import torch

    pg, dev, data, mine, inline = _framed(obj, group, inline)
    is_root = group.rank == root
    outs = [torch.empty_like(mine) for _ in range(group.world)] if is_root else []

    def start(opts: Any) -> Any:
        opts.rootRank = root
        return pg.gather([outs] if is_root else [], [mine], opts)

    _run(group, what, _options("GatherOptions"), start)
    if not is_root:
        if len(data) > inline:
            rest = torch.frombuffer(bytearray(data[inline:]), dtype=torch.uint8).to(dev)
            _p2p(group, what, True, rest, root)
        return None
    parts = [_unframe(o, inline) for o in outs]
    values: list[Any] = []
    for r, (length, head) in enumerate(parts):
        if r == root:
            values.append(obj)
            continue
        if length > inline:
            rest = torch.empty(length - inline, dtype=torch.uint8, device=dev)
            _p2p(group, what, False, rest, r)
            head += _to_bytes(rest, length - inline)
        values.append(pickle.loads(head))
    return values


def scatter(objs: list[Any] | None, group: Group, root: int = 0, what: str = "a scatter",
            inline: int | None = None) -> Any:
    """``objs[rank]`` of group rank ``root`` on every rank (``objs`` is read on ``root`` only).

    One collective of ``inline``-byte frames (default :func:`gather_inline`); a longer object
    travels on from ``root`` point to point, so a rank receives what its own object needs.

    Raises:
        PeerLostError: a rank died or did not answer within :func:`bound_s`.
    """
    if not group.distributed:
        assert objs is not None
        return objs[0]
    import torch

    if inline is None:
        inline = gather_inline(group.world)
    pg = _pg(group)
    dev = _device(pg)
    is_root = group.rank == root
    datas: list[bytes] = []
    frames: list[Any] = []
    if is_root:
        assert objs is not None and len(objs) == group.world
        datas = [pickle.dumps(o) for o in objs]
        frames = [_frame(d, inline, dev) for d in datas]
    mine = torch.empty(_LEN.size + inline, dtype=torch.uint8, device=dev)

    def start(opts: Any) -> Any:
        opts.rootRank = root
        return pg.scatter([mine], [frames] if is_root else [], opts)

    _run(group, what, _options("ScatterOptions"), start)
    if is_root:
        for r, d in enumerate(datas):
            if r != root and len(d) > inline:
                rest = torch.frombuffer(bytearray(d[inline:]), dtype=torch.uint8).to(dev)
                _p2p(group, what, True, rest, r)
        assert objs is not None
        return objs[root]
    length, head = _unframe(mine, inline)
    if length > inline:
        rest = torch.empty(length - inline, dtype=torch.uint8, device=dev)
        _p2p(group, what, False, rest, root)
        head += _to_bytes(rest, length - inline)
    return pickle.loads(head)
