"""Peer replicas of the fast tier: each node's data files copied to ``replicas`` other nodes.

Nodes are placed on a ring in a fixed order (:func:`node_order`); node ``i``'s files go to nodes
``i+1 .. i+replicas`` (mod the number of nodes), so a replica never sits on the node it protects.
Each rank sends the data files it wrote itself to one rank of every target node (its "partner":
the rank with the same position on that node, modulo the node's size).

The bytes move over the process group in rounds of at most ``window`` bytes per sender
(``all_to_all_single`` of ``uint8`` tensors, so the group must carry CPU tensors: gloo). The
files travel exactly as stored (already compressed and checksummed per chunk); each receiver
writes them at their offsets into temp files, checks a whole-file XXH64 the sender computed,
then fsyncs and renames (:class:`pyckpt._tier_io.ReplicaFile`). Every rank takes part in every
round; a failure on any rank (reading, writing, checking) is raised on every rank before the
next collective, and nothing of a failed replication is left under a final name.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyckpt import _C
from pyckpt._collective import Group, agree
from pyckpt._tier_io import LocalTier, ReplicaFile

__all__ = ["node_order", "ring_targets", "Transfer", "plan_transfers", "replicate", "Stats"]

DEFAULT_WINDOW = 256 << 20


def _node_key(node: str) -> tuple[int, int | str]:
    return (0, int(node)) if node.isdigit() else (1, node)


def node_order(nodes: Sequence[str]) -> list[str]:
    """Distinct node ids in ring order (numeric ids by value, then names)."""
    return sorted(set(nodes), key=_node_key)


def ring_targets(nodes: Sequence[str], replicas: int) -> dict[str, list[str]]:
    """Node -> the ``replicas`` nodes that keep copies of its files (never itself)."""
    ring = node_order(nodes)
    if replicas > len(ring) - 1:
        raise ValueError(f"replicas={replicas} needs at least {replicas + 1} nodes; "
                         f"the group spans {len(ring)}")
    return {n: [ring[(i + k) % len(ring)] for k in range(1, replicas + 1)]
            for i, n in enumerate(ring)}


@dataclass(frozen=True)
class Transfer:
    """One file from one rank to another: ``size`` bytes, whole-file XXH64 ``digest``."""

    src: int
    dst: int
    name: str
    size: int
    digest: int


@dataclass
class Stats:
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0


def partners(node_of_rank: Sequence[str], rank: int, replicas: int) -> list[int]:
    """The ranks ``rank`` sends its files to (one per target node)."""
    by_node: dict[str, list[int]] = {}
    for r, n in enumerate(node_of_rank):
        by_node.setdefault(n, []).append(r)
    mine = node_of_rank[rank]
    pos = by_node[mine].index(rank)
    targets = ring_targets(node_of_rank, replicas)[mine]
    return [by_node[t][pos % len(by_node[t])] for t in targets]


def _digest(path: str, size: int) -> int:
    if size == 0:
        return int(_C.xxh64(b""))
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as m:
        return int(_C.xxh64(m))


def plan_transfers(own_files: Sequence[tuple[str, str]], node_of_rank: Sequence[str], rank: int,
                   replicas: int) -> list[Transfer]:
    """This rank's outgoing transfers: each of ``own_files`` (name, path) to every partner."""
    dsts = partners(node_of_rank, rank, replicas)
    out: list[Transfer] = []
    for name, path in own_files:
        size = os.path.getsize(path)
        digest = _digest(path, size)
        out.extend(Transfer(rank, d, name, size, digest) for d in dsts)
    return out


def _named(e: OSError, path: str, step: int, node: str, src: int) -> OSError:
    """``e`` (its errno, so its type) naming the replica file, the step, the node and the
    sender: a full disk while receiving a replica says where."""
    return OSError(e.errno, f"{e.strerror or e} (receiving the replica of fast-tier step {step} "
                   f"from rank {src} on node {node!r})", path)


def _window(stream: Sequence[Transfer], lo: int, hi: int) -> list[tuple[Transfer, int, int]]:
    """Pieces of the concatenated ``stream`` inside [lo, hi): (transfer, file offset, length)."""
    out: list[tuple[Transfer, int, int]] = []
    pos = 0
    for t in stream:
        a, b = max(lo, pos), min(hi, pos + t.size)
        if a < b:
            out.append((t, a - pos, b - a))
        pos += t.size
        if pos >= hi:
            break
    return out


def _read_pieces(send: Any, pieces: Sequence[tuple[Transfer, int, int]],
                 paths: dict[str, str]) -> None:
    """Reads a round's ``pieces`` of this rank's files into the send buffer, back to back."""
    buf = send.numpy()
    pos = 0
    for t, off, n in pieces:
        with open(paths[t.name], "rb") as fh:
            got = os.preadv(fh.fileno(), [memoryview(buf[pos:pos + n])], off)
        if got != n:
            raise OSError(f"{paths[t.name]}: short read ({got} of {n} bytes at {off})")
        pos += n


def _write_pieces(recv: Any, recv_pieces: Sequence[tuple[int, Sequence[tuple[Transfer, int, int]]]],
                  files: dict[tuple[int, str], ReplicaFile], me: int, step: int,
                  node: str) -> None:
    """Writes what a round received (the receive buffer, in sender order) into the replica
    files of this rank."""
    rbuf = recv.numpy()
    pos = 0
    for src, pieces in recv_pieces:
        for t, off, n in pieces:
            if t.dst == me:
                f = files[(src, t.name)]
                try:
                    f.write_at(off, rbuf[pos:pos + n])
                except OSError as e:
                    raise _named(e, f.path, step, node, src) from e
                pos += n


def replicate(group: Group, tier: LocalTier, step: int, own_files: Sequence[tuple[str, str]],
              node_of_rank: Sequence[str], replicas: int, window: int = DEFAULT_WINDOW) -> Stats:
    """Sends this rank's ``own_files`` to its partners and receives the files sent to it.

    Collective over ``group``. Received files are committed into ``tier``'s directory of
    ``step`` only after every rank received and checked everything it was sent; on any failure
    every rank raises it and removes its temp files.
    """
    import torch
    import torch.distributed as dist

    stats = Stats()
    if replicas == 0 or not group.distributed:
        return stats
    me = group.rank
    _, plans = agree(lambda: plan_transfers(own_files, node_of_rank, me, replicas), group,
                     what="planning the replication")
    # Each sender's stream, grouped by destination (the order all_to_all_single wants).
    streams = [sorted(p, key=lambda t: t.dst) for p in plans]
    incoming = [t for s in streams for t in s if t.dst == me]
    rounds = max((sum(t.size for t in s) for s in streams), default=0)
    rounds = -(-rounds // window) if rounds else 0
    paths = dict(own_files)
    files: dict[tuple[int, str], ReplicaFile] = {}
    node = node_of_rank[me]
    try:
        def open_replicas() -> None:
            for t in incoming:
                try:
                    files[(t.src, t.name)] = tier.open_replica(step, t.name, t.size)
                except OSError as e:
                    raise _named(e, os.path.join(tier.step_dir(step), t.name), step, node,
                                 t.src) from e

        agree(open_replicas, group, what="creating replica files")
        for k in range(rounds):
            lo, hi = k * window, (k + 1) * window
            send_pieces = _window(streams[me], lo, hi)
            send_sizes = [0] * group.world
            for t, _, n in send_pieces:
                send_sizes[t.dst] += n
            send = torch.empty(sum(send_sizes), dtype=torch.uint8)
            agree(functools.partial(_read_pieces, send, send_pieces, paths), group,
                  what="reading files to replicate")
            recv_pieces = [(src, _window(streams[src], lo, hi)) for src in range(group.world)]
            recv_sizes = [sum(n for t, _, n in pieces if t.dst == me) for _, pieces in recv_pieces]
            recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
            dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group.pg)
            stats.rounds += 1
            stats.bytes_sent += sum(send_sizes)
            stats.bytes_received += sum(recv_sizes)
            agree(functools.partial(_write_pieces, recv, recv_pieces, files, me, step, node),
                  group, what="writing received replicas")

        def check_and_commit() -> None:
            for t in incoming:
                f = files[(t.src, t.name)]
                if f.received != t.size or f.digest() != t.digest:
                    from pyckpt.errors import ChecksumError

                    raise ChecksumError(f"{f.path}: the replica received from rank {t.src} does "
                                        "not match the sender's file (size or XXH64)")
            for t in incoming:
                f = files[(t.src, t.name)]
                try:
                    f.commit()
                except OSError as e:
                    raise _named(e, f.path, step, node, t.src) from e

        agree(check_and_commit, group, what="checking and committing replicas")
    finally:
        for f in files.values():
            f.abort()
    return stats
