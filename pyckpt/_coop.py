"""Cooperative loads: stored bytes that several ranks want are read from storage by one of them.

With DDP, FSDP ``NO_SHARD``, HSDP replicas or ``Replicate()`` DTensors every rank loads the same
replicated state. Read naively, each stored byte is read N times (N x the GETs on an object
store). A cooperative load reads each stored chunk once:

1. Planning (DCP's global plan step, on the coordinator, :func:`assign`): the chunks each rank's
   read items overlap are listed; a chunk only one rank wants is read by that rank (no
   exchange); every chunk several ranks want gets one reader, balanced by stored bytes over the
   ranks (largest first, :func:`pyckpt._partition.largest_first`, counting what each rank
   already reads alone), chosen among the ranks that want it and, for a node-local checkpoint,
   among the ranks whose directory holds its file. Each rank's ``LoadPlan.storage_data`` then
   carries a :class:`CoopPlan`: who reads the chunks it wants from others.
2. Reading (:func:`cooperative_reads`): each rank reads what it reads itself straight into its
   destinations (the backend's ordinary reads); the rest travels in rounds of the node-local
   :class:`~pyckpt._exchange.Exchange`: the reader reads the chunk's stored (compressed)
   bytes and verifies them, the bytes move over the process group, the receiver verifies again
   and decodes into its destination. A rank asks for at most ``window`` stored bytes per round
   (and at most ``window / (N - 1)`` from one reader, at least one chunk), so what is in flight
   per rank is a window, not the model.

When the caller does not say (``cooperative=None``, ``PYCKPT_COOPERATIVE`` unset),
:func:`pays_off` decides per load, on the coordinator, from the node each rank named in its
local plan (:class:`LoadNode`): on for an object store and a node-local checkpoint, on for a
file system when ranks on different nodes want the same stored bytes, off when they all share
one node (its page cache already serves each stored byte from storage about once, and the
exchange only costs there; docs/REPLICATED.md has the measurements).

Errors are agreed on as in every exchange: a rank whose storage read fails (a missing or
damaged file) raises its error, and every other rank raises the same error at the same round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyckpt import _C
from pyckpt._collective import Group
from pyckpt._exchange import Exchange, Need, PeerFiles, peer_source
from pyckpt._partition import largest_first
from pyckpt.backends.base import Backend, ReadRequest, overlapping_chunks, stored_len

__all__ = ["CoopPlan", "LoadNode", "assign", "chunks_of", "cooperative_reads", "first_round",
           "holders_of", "pays_off", "plan_uses", "wanted_across_nodes"]

# A stored chunk: (data file basename, file offset of its stored bytes).
Key = tuple[str, int]


def _basename(path: str) -> str:
    return path.rsplit("/", 1)[-1]


@dataclass
class CoopPlan:
    """One rank's part of a cooperative load (``LoadPlan.storage_data``).

    Attributes:
        exchanged: chunk -> (the group rank that reads it, the round that carries it), for the
            chunks this rank wants that travel over the group (its own reads of chunks others
            want included: they reach it through the same round, read once). Every other chunk
            it wants it reads itself, directly.
        rounds: exchange rounds of the load (the same on every rank).
    """

    exchanged: dict[Key, tuple[int, int]]
    rounds: int


@dataclass(frozen=True)
class LoadNode:
    """A rank's node and the checkpoint it loads, carried in its local ``LoadPlan.storage_data``
    to the coordinator (so the default needs no collective of its own; replaced there by the
    rank's :class:`CoopPlan` or None).

    Attributes:
        node: :func:`pyckpt._knobs.node_id` of the rank (its ``GROUP_RANK`` or host name), when
            the load decides by itself whether to be cooperative (else None).
        save_id: the save id of the checkpoint the rank loads; a cooperative load needs one
            checkpoint on every rank.
        path: where the rank loads it from (named by the error when the save ids differ).
    """

    node: str | None
    save_id: str | None = None
    path: str = ""


def wanted_across_nodes(wants: Sequence[Mapping[Key, int]],
                        nodes: Sequence[str | None]) -> bool:
    """Whether ranks on different nodes want the same chunk (``nodes[r]`` is rank r's node;
    None, unknown, counts as a node of its own)."""
    first: dict[Key, object] = {}
    for r, (w, node) in enumerate(zip(wants, nodes)):
        me: object = node if node is not None else ("rank", r)
        for key in w:
            seen = first.setdefault(key, me)
            if seen != me:
                return True
    return False


def pays_off(backend: Backend, nodes: Sequence[str | None],
             wants: Callable[[], Sequence[Mapping[Key, int]]]) -> tuple[bool, str]:
    """The default of a load that did not choose (``cooperative=None``): whether to read
    cooperatively, and why (for the log).

    Args:
        backend: where the checkpoint is read from.
        nodes: per group rank, its node (:class:`LoadNode`; None where the plan carried none).
        wants: per group rank, the chunks it needs (:func:`chunks_of`); called only when the
            answer depends on them.

    On for an object store (no cache shared by the ranks: every rank's GET is paid and
    fetched) and for a node-local checkpoint (chunks of files a node lacks travel between ranks
    anyway; cooperatively, each is read once, by a holder). For a file system: off when every
    rank is on one node (the page cache already brings each stored byte from storage about
    once; the exchange only adds work), on when ranks on different nodes want the same stored
    bytes (each node would read them from the shared storage).
    """
    if holders_of(backend) is not None:
        return True, "node-local checkpoint"
    if not backend.shares_page_cache:
        return True, "object store"
    if None not in nodes and len(set(nodes)) == 1:
        return False, f"every rank on node {nodes[0]!r}, file system"
    if wanted_across_nodes(wants(), nodes):
        return True, "the same stored bytes wanted on several nodes"
    return False, "no stored bytes wanted on more than one node"


def chunks_of(spans: Sequence[tuple[Sequence[Any], int, int]]) -> dict[Key, int]:
    """Chunk -> stored bytes, over the chunks overlapping each ``(segments, lo, hi)`` span."""
    out: dict[Key, int] = {}
    for segments, lo, hi in spans:
        for _a, _b, si, rec in overlapping_chunks(segments, lo, hi):
            out[(_basename(segments[si][0]), int(rec[0]))] = stored_len(rec)
    return out


def holders_of(backend: Backend) -> Callable[[str], Sequence[int]] | None:
    """For a node-local checkpoint: data file basename -> the ranks holding it; None where every
    rank reads every file (a shared directory, an object store): :meth:`Backend.holders`."""
    return backend.holders()


def assign(
    wants: Sequence[Mapping[Key, int]],
    holders: Callable[[str], Sequence[int]] | None = None,
    window: int = 64 << 20,
) -> list[CoopPlan] | None:
    """Chooses the reader of every chunk and the exchange round that carries it (see the
    module docstring).

    Args:
        wants: per group rank, chunk -> stored bytes of the chunks it needs.
        holders: which ranks may read a file (:func:`holders_of`); None: any.
        window: stored bytes per round (at least one chunk; at most ``window / (N - 1)`` from
            one reader, so that what a reader sends per round is about a window too).

    Returns:
        Per rank, its :class:`CoopPlan`; None when no chunk needs to travel (every rank reads
        all it wants itself).
    """
    world = len(wants)
    wanted_by: dict[Key, list[int]] = {}
    size: dict[Key, int] = {}
    for r, w in enumerate(wants):
        for key, n in w.items():
            wanted_by.setdefault(key, []).append(r)
            size[key] = n
    loads = [0] * world
    shared: list[tuple[Key, Sequence[int]]] = []
    for key, ranks in wanted_by.items():
        held = None if holders is None else holders(key[0])
        if len(ranks) == 1 and (held is None or ranks[0] in held):
            loads[ranks[0]] += size[key]  # read by the one rank that wants it, not exchanged
        elif held is None:
            shared.append((key, ranks))
        else:
            shared.append((key, [r for r in ranks if r in held] or list(held)))
    if not shared:
        return None
    shared.sort(key=lambda item: (-size[item[0]], item[0]))
    bins = largest_first([size[k] for k, _ in shared], world, loads=loads,
                         allowed=[ok for _, ok in shared])
    reader = {key: r for (key, _), r in zip(shared, bins)}
    # Rounds: consecutive chunks in stored order (so a tensor's chunks travel together).
    per_reader = max(1, window // max(1, world - 1))
    rounds: dict[Key, int] = {}
    t, total, by_reader = 0, 0, [0] * world
    for key in sorted(reader):
        n, r = size[key], reader[key]
        if (total and total + n > window) or (by_reader[r] and by_reader[r] + n > per_reader):
            t, total, by_reader = t + 1, 0, [0] * world
        rounds[key] = t
        total += n
        by_reader[r] += n
    return [CoopPlan({k: (reader[k], rounds[k]) for k in w if k in reader}, t + 1)
            for w in wants]


class _CoopExchange(Exchange):
    """Exchange rounds in which each chunk is served by its assigned reader, read through the
    backend (files, objects, memory)."""

    def __init__(self, backend: Backend, group: Group, pool: Any,
                 exchanged: dict[Key, tuple[int, int]]) -> None:
        super().__init__(PeerFiles(backend.location, group, {}, set()), pool)
        self.backend = backend
        self.exchanged = exchanged

    def owner_of(self, need: Need) -> int:
        return self.exchanged[(need[0], int(need[1][0]))][0]

    def path_of(self, name: str) -> str:
        return self.backend.url_of(name)

    def read_stored(self, requests: list[ReadRequest]) -> _C.ReadStats:
        return self.backend.read_stored(requests, self.pool)


# One use of an exchanged chunk by a request: (request name, raw_a, lo, hi, dst address).
Use = tuple[str, int, int, int, int]


class _Session:
    """The read function of one cooperative ``read_data`` (see :func:`cooperative_reads`).

    Every rank runs the same rounds in the same order (round ``t`` carries the chunks
    :func:`assign` put in it), so all the ranks wanting a chunk ask for it in one round and its
    reader reads it once. A batch of requests runs the rounds up to the last one it needs;
    chunks received for later batches are kept (stored bytes) until their last use, which the
    order of the items (:func:`order_items`) keeps to about a round.

    Attributes:
        bytes_read: stored bytes this rank read from storage directly (for itself).
    """

    def __init__(self, backend: Backend, exchange: _CoopExchange, plan: CoopPlan, pool: Any,
                 needs: dict[Key, Need], uses: dict[Key, int]) -> None:
        self.direct = backend  # read_requests: this rank's own reads, never a collective
        self.exchange = exchange
        self.plan = plan
        self.pool = pool
        self.needs = needs
        self.uses = uses
        self.by_round: list[list[Key]] = [[] for _ in range(plan.rounds)]
        for key, (_, t) in sorted(plan.exchanged.items()):
            self.by_round[t].append(key)
        self.next_round = 0
        self.carried: dict[Key, Any] = {}  # chunk -> its stored bytes (uint8 tensor)
        self.bytes_read = 0

    def __call__(self, requests: list[ReadRequest]) -> _C.ReadStats:
        exchanged = self.plan.exchanged
        own: list[Any] = []
        wanted: dict[Key, list[Use]] = {}
        for name, segments, lo, hi, dst in requests:
            chunks = overlapping_chunks(segments, lo, hi)
            if not any((_basename(segments[si][0]), int(rec[0])) in exchanged
                       for _a, _b, si, rec in chunks):
                own.append(ReadRequest(name, segments, lo, hi, dst))
                continue
            for a, b, si, rec in chunks:
                path, _, params, _ = segments[si]
                key = (_basename(path), int(rec[0]))
                c_lo, c_hi = max(lo, a), min(hi, b)
                if key in exchanged:
                    wanted.setdefault(key, []).append((name, a, c_lo, c_hi, dst + (c_lo - lo)))
                else:
                    own.append(ReadRequest(name, [_C.Segment(path, a, params, [rec])], c_lo, c_hi,
                                           dst + (c_lo - lo)))
        nread = ndecoded = 0
        if own:
            nread, ndecoded = self.direct.read_requests(own, self.pool)
            self.bytes_read += nread
        ready = {k: self.carried[k] for k in wanted if k in self.carried}
        ndecoded += self._decode(ready, wanted)
        last = max((exchanged[k][1] for k in wanted if k not in ready), default=-1)
        while self.next_round <= last:
            ndecoded += self._decode(self._round(), wanted)
        return _C.ReadStats(nread, ndecoded)

    def _round(self) -> dict[Key, Any]:
        """Runs the next round; returns chunk -> stored bytes of the chunks it brought."""
        keys = self.by_round[self.next_round]
        self.next_round += 1
        memory, offsets = self.exchange.fetch([self.needs[k] for k in keys])
        got = {}
        for key, off in zip(keys, offsets):
            buf = memory[peer_source(self.plan.exchanged[key][0])]
            got[key] = buf[off:off + stored_len(self.needs[key][1])]
        return got

    def _decode(self, got: dict[Key, Any], wanted: dict[Key, list[Use]]) -> int:
        """Decodes the uses in ``wanted`` of the chunks in ``got``; keeps for later the chunks
        with uses left."""
        out: list[ReadRequest] = []
        sources: dict[str, _C.MemorySource] = {}
        for key, data in got.items():
            uses = wanted.pop(key, [])
            if uses:
                source = f"<chunk {key[1]} of {key[0]}>"
                sources[source] = _C.MemorySource(len(data), [_C.MemoryRange(0, data)])
                need = self.needs[key]
                rec = _C.Chunk(0, *need[1][1:])  # the record, at the start of the received bytes
                out.extend(ReadRequest(name, [_C.Segment(source, a, need[2], [rec])], lo, hi, dst)
                           for name, a, lo, hi, dst in uses)
            left = self.uses.get(key, 0) - len(uses)
            self.uses[key] = left
            if left > 0:
                self.carried[key] = data.copy() if key not in self.carried else data
            else:
                self.carried.pop(key, None)
        if not out:
            return 0
        return int(_C.read_requests(out, self.pool, sources).chunks)

    def close(self) -> None:
        """Runs the rounds this rank has not needed (the others may)."""
        while self.next_round < self.plan.rounds:
            self._round()
        self.carried.clear()


def plan_uses(spans: Sequence[tuple[Sequence[Any], int, int]], plan: CoopPlan,
              names: Sequence[str] | None = None) -> tuple[dict[Key, Need], dict[Key, int]]:
    """For this rank's read spans: the exchange need of each exchanged chunk it wants, and how
    many spans use each (a kept chunk is dropped after its last use). ``names[i]`` (the
    tensor span ``i`` reads) travels with the need, so that the reader's error names it."""
    needs: dict[Key, Need] = {}
    uses: dict[Key, int] = {}
    for i, (segments, lo, hi) in enumerate(spans):
        label = () if names is None else (names[i],)
        for _a, _b, si, rec in overlapping_chunks(segments, lo, hi):
            key = (_basename(segments[si][0]), int(rec[0]))
            if key in plan.exchanged:
                needs.setdefault(key, (key[0], tuple(rec), segments[si][2], *label))
                uses[key] = uses.get(key, 0) + 1
    return needs, uses


def first_round(span: tuple[Sequence[Any], int, int], plan: CoopPlan) -> int:
    """The first round a span needs (-1: none): items are read in this order."""
    segments, lo, hi = span
    rounds = [plan.exchanged[k][1] for k in
              ((_basename(segments[si][0]), int(rec[0]))
               for _a, _b, si, rec in overlapping_chunks(segments, lo, hi))
              if k in plan.exchanged]
    return min(rounds, default=-1)


@contextlib.contextmanager
def cooperative_reads(backend: Backend, plan: CoopPlan, group: Group, pool: Any,
                      spans: Sequence[tuple[Sequence[Any], int, int]],
                      names: Sequence[str] | None = None) -> Iterator[_Session]:
    """One cooperative ``read_data``: yields the read function (one call per batch of requests,
    ``spans`` being every request's span, ``names`` the tensor each reads, for error messages;
    each call runs zero or more rounds, collectively).
    Leaving the block runs the remaining rounds and serves the other ranks until all are done;
    an error raised inside is told to every rank (and raised here). ``session.bytes_read +
    session.exchange.bytes_read`` is what this rank read from storage."""
    exchange = _CoopExchange(backend, group, pool, plan.exchanged)
    needs, uses = plan_uses(spans, plan, names)
    session = _Session(backend, exchange, plan, pool, needs, uses)
    try:
        yield session
        session.close()
    except Exception as e:
        exchange.finish(e)  # tells the other ranks, then raises e
        raise
    exchange.finish()
