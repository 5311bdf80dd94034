"""Byte balancing of DCP save plans: which rank writes which bytes of each replicated item.

The coordinator step of :class:`pyckpt.SavePlanner` (see :mod:`pyckpt.planner` for the whole
story): items held by one rank stay with it; items held by several ranks are water-filled over
their holders and cut at multiples of :data:`SPLIT_ALIGNMENT`; the outcome is a
:class:`ByteRanges` per rank and DCP's global ``Metadata``. Loads are in bytes, or, where the
local plans carry ``stored_sizes`` (a compressing writer, see :mod:`pyckpt._stored_size`), in
estimated stored bytes: each item weighs its lowest holder's estimate. Imported through
:mod:`pyckpt.planner`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from pyckpt._grid import Grid, Pieces

SPLIT_ALIGNMENT = 1 << 20
"""Split points inside a tensor lie at multiples of this many bytes (1 MiB) from its start.

Any multiple of 16 keeps every dtype's element boundary; 1 MiB also keeps the pieces large
enough to be written efficiently.
"""

# Non-tensor values are pickled by DCP at write time, so their size is unknown when planning.
# torch.save of even a small Python object produces about a kilobyte (zip container), so that
# is the weight a BYTE_IO item adds to its writer's load.
_BYTE_IO_WEIGHT = 1024


@dataclasses.dataclass(frozen=True)
class ByteRanges:
    """Byte ranges a rank writes for the items it writes only partially.

    Carried in ``SavePlan.storage_data`` of the per-rank plans returned by
    :meth:`SavePlanner.create_global_plan`.

    Attributes:
        ranges: Maps an item's ``MetadataIndex`` to the half-open range ``(start, end)`` of the
            item's row-major contiguous tensor bytes that this rank writes. An item present in
            the rank's plan but absent from ``ranges`` is written whole. Over all ranks, the
            ranges of one item tile ``[0, nbytes)``; interior split points are multiples of
            :data:`SPLIT_ALIGNMENT` (or of the planner's ``split_alignment``).
    """

    ranges: dict[MetadataIndex, tuple[int, int]] = dataclasses.field(default_factory=dict)
    pieces: Pieces | None = dataclasses.field(default=None, compare=False, repr=False)
    """On rank 0's plan from :meth:`SavePlanner.create_global_plan` only: every tensor's grid
    and the ranks writing each cell, when all tensors are grids (what a version-4 save's
    ``pyckpt.Writer`` describes, found here instead of from every plan again). It stays in the
    coordinator's process: a pickled ``ByteRanges`` leaves it out."""

    def __getstate__(self) -> dict[str, Any]:
        return {"ranges": self.ranges, "pieces": None}


@dataclasses.dataclass(eq=False, slots=True)
class _Entry:
    """One distinct item (one ``MetadataIndex``) over all plans, and where it is written."""

    item: WriteItem  # the lowest holder's copy
    nbytes: int  # bytes of the item's data; the weight used for BYTE_IO items
    splittable: bool
    weight: int  # what writing it adds to a rank's load: the lowest holder's estimate of its
    # stored bytes (a compressing writer, see pyckpt._stored_size), else ``nbytes``
    holders: list[int]  # ranks whose plan holds the item, ascending
    parts: dict[int, tuple[int, int] | None] = dataclasses.field(default_factory=dict)
    """Writing ranks -> byte range, or None when that rank writes the item whole."""
    final: WriteItem | None = None  # the copy every writer's final plan holds, once known


# A rank's items, each with the entry shared by all copies of its index.
_RankItems = list[tuple[WriteItem, _Entry]]


def _item_nbytes(item: WriteItem) -> int:
    """Return the number of bytes of the item's local data (the chunk, not the whole tensor)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return _BYTE_IO_WEIGHT
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _sort_key(entry: _Entry) -> tuple[Any, ...]:
    """Heaviest first; ties broken by name and offset so the result ignores arrival order."""
    offset = entry.item.index.offset
    return (-entry.weight, entry.item.index.fqn, tuple(offset) if offset is not None else ())


def _part_weight(entry: _Entry, lo: int, hi: int) -> int:
    """The load of writing bytes ``[lo, hi)`` of an item: its weight, pro rata."""
    if (lo, hi) == (0, entry.nbytes):
        return entry.weight
    return entry.weight * (hi - lo) // entry.nbytes


def _check_same_item(first: WriteItem, other: WriteItem, rank: int) -> None:
    """Raise ``ValueError`` if two copies of one index describe different data."""
    if first.type == WriteItemType.BYTE_IO or other.type == WriteItemType.BYTE_IO:
        same = first.type == other.type
    else:
        a, b = first.tensor_data, other.tensor_data
        same = (
            a is not None
            and b is not None
            and a.size == b.size
            and a.chunk.sizes == b.chunk.sizes
            and a.properties.dtype == b.properties.dtype
        )
    if not same:
        raise ValueError(
            f"item {first.index.fqn!r} (offset {first.index.offset}) is held by several ranks "
            f"but rank {rank}'s copy differs in type, shape or dtype from a lower rank's"
        )


def plan_digest(items: Sequence[WriteItem], replica_digests: dict[Any, Any]) -> bytes:
    """One hash of what the coordinator takes from a local plan: each item's index, type,
    shape, chunk and dtype, in order, and the plan's replica digests (see
    :mod:`pyckpt._replicas`). Plans with equal digests are collected once (:func:`_collect`)."""
    rows: list[Any] = []
    for item in items:
        index, td = item.index, item.tensor_data
        if td is None:
            rows.append((index.fqn, index.offset, item.type))
        else:
            rows.append((index.fqn, index.offset, item.type, td.size, td.chunk.offsets,
                         td.chunk.sizes, td.properties.dtype))
    if replica_digests:
        rows.append(sorted(replica_digests.items(), key=repr))
    return hashlib.blake2b(repr(rows).encode(), digest_size=16).digest()


def _collect(all_plans: Sequence[SavePlan]) -> tuple[list[_Entry], list[_RankItems]]:
    """Group the copies of each index over all plans (one hash lookup per copy).

    Plans carrying equal ``digest`` attributes (:func:`plan_digest`, as :class:`SavePlanner`'s
    local plans do) hold the same items: the lowest such rank's plan is collected item by item,
    and every other shares its pairs and joins its entries' holders at the end (DDP or
    ``NO_SHARD`` state at thousands of ranks: one plan's items, not every rank's).
    """
    # Keyed by (fqn, offset), which is what MetadataIndex equality compares, without calling
    # the dataclass's Python-level __hash__/__eq__ for every copy.
    entries: dict[tuple[str, Any], _Entry] = {}
    # What _check_same_item compares, per index held by several ranks: one tuple comparison
    # per copy (half the cost of the call, which only runs to raise); None where a copy
    # cannot be compared that way. Made at an index's second copy: most are held by one rank.
    signatures: dict[tuple[str, Any], tuple[Any, ...] | None] = {}
    per_rank: list[_RankItems] = []
    alike: dict[bytes, tuple[_RankItems, list[int]]] = {}  # digest -> first plan's pairs, ranks
    for rank, plan in enumerate(all_plans):
        digest = getattr(plan, "digest", b"")
        if digest:
            same = alike.get(digest)
            # (a plan whose items were replaced after its digest was taken is collected whole)
            if same is not None and len(same[0]) == len(plan.items):
                same[1].append(rank)
                per_rank.append(same[0])
                continue
        mine: _RankItems = []
        sizes: dict[Any, int] = getattr(plan, "stored_sizes", None) or {}
        for item in plan.items:
            key = (item.index.fqn, item.index.offset)
            entry = entries.get(key)
            if entry is None:
                td = item.tensor_data
                splittable = item.type != WriteItemType.BYTE_IO and td is not None
                nbytes = _item_nbytes(item)
                weight = nbytes
                if sizes and nbytes:  # the estimate, same key form as pyckpt._replicas._key
                    estimate = sizes.get((key[0], tuple(key[1]) if key[1] is not None else None))
                    weight = max(1, estimate) if estimate is not None else nbytes
                entry = entries[key] = _Entry(item, nbytes, splittable, weight, [rank])
            elif entry.holders[-1] == rank:  # ranks are visited in ascending order
                raise ValueError(
                    f"rank {rank}'s plan holds item {item.index.fqn!r} "
                    f"(offset {item.index.offset}) twice"
                )
            else:
                if key not in signatures:
                    signatures[key] = _signature(entry.item)
                signature = _signature(item)
                if signature is None or signature != signatures[key]:
                    _check_same_item(entry.item, item, rank)
                entry.holders.append(rank)
            mine.append((item, entry))
        per_rank.append(mine)
        if digest and digest not in alike:
            alike[digest] = (mine, [])
    for mine, ranks in alike.values():
        if ranks:
            for _, entry in mine:
                holders = entry.holders
                ordered = holders[-1] < ranks[0]
                holders.extend(ranks)
                if not ordered:  # the entry is also held by another group's ranks
                    holders.sort()
    return list(entries.values()), per_rank


def _signature(item: WriteItem) -> tuple[Any, ...] | None:
    """What :func:`_check_same_item` compares of a copy, as one tuple (None: call it)."""
    if item.type == WriteItemType.BYTE_IO:
        return (WriteItemType.BYTE_IO,)
    td = item.tensor_data
    return None if td is None else (td.size, td.chunk.sizes, td.properties.dtype)


def _water_fill(loads: list[int], holders: Sequence[int], total: int) -> list[tuple[int, int]]:
    """Share ``total`` bytes among ``holders`` so that their loads become as equal as possible.

    Args:
        loads: Current bytes per rank (read only).
        holders: Ranks that may take a share.
        total: Bytes to share.

    Returns:
        ``(rank, quota)`` pairs in ascending rank order, only for positive quotas; the quotas sum
        to ``total``. Ranks whose load is above the resulting level get nothing.
    """
    by_load = sorted(holders, key=lambda r: (loads[r], r))
    prefix = 0
    count = 0
    for count, rank in enumerate(by_load, start=1):
        prefix += loads[rank]
        # With `count` ranks filled to a common level L: count * L = total + prefix.
        if count == len(by_load) or total + prefix <= loads[by_load[count]] * count:
            break
    filled = by_load[:count]
    level, rest = divmod(total + prefix, count)
    # floor(L) >= every filled load (loads are integers), so quotas are >= 0; the `rest` bytes
    # left by flooring go one each to the lowest ranks.
    quotas = {r: level - loads[r] for r in filled}
    for r in sorted(filled)[:rest]:
        quotas[r] += 1
    return [(r, quotas[r]) for r in sorted(filled) if quotas[r] > 0]


def _cut_points(
    stream: Sequence[_Entry],
    starts: Sequence[int],
    weights: Sequence[int],
    targets: Sequence[int],
    alignment: int,
) -> list[int]:
    """Pick, for each cumulative target weight, the nearest allowed cut position in the stream.

    The stream is the concatenation of the items' bytes; ``starts`` are the items' byte offsets
    in it and ``weights`` their cumulative weights before them. Cuts are allowed at item
    boundaries and, inside a splittable item, at multiples of ``alignment`` bytes from the
    item's start. Inside an item the weight is taken as spread evenly over its bytes, so a cut
    lies within ``alignment / 2`` bytes of its target (or half an unsplittable item).

    Returns:
        The cuts as byte offsets in the stream, non-decreasing.
    """
    cuts: list[int] = []
    i = 0
    previous = 0
    for target in targets:
        while i < len(stream) and weights[i] + stream[i].weight <= target:
            i += 1
        if i == len(stream):
            cut = starts[-1] + stream[-1].nbytes if stream else 0
        else:
            e, begin = stream[i], starts[i]
            if e.splittable:
                # Integer arithmetic: the byte where the target weight falls (exact when the
                # weight is the byte count, as without compression).
                exact = (target - weights[i]) * e.nbytes // e.weight
                low = exact // alignment * alignment
                high = min(e.nbytes, low + alignment)
                cut = begin + (low if exact - low <= high - exact else high)
            else:
                before, after = target - weights[i], weights[i] + e.weight - target
                cut = begin if before <= after else begin + e.nbytes
        previous = max(previous, cut)
        cuts.append(previous)
    return cuts


def _assign_group(
    group: list[_Entry], holders: tuple[int, ...], loads: list[int], alignment: int
) -> None:
    """Assign one holder group's items (fills their ``parts``) and update ``loads``."""
    stream = [e for e in group if e.nbytes > 0]
    empty = [e for e in group if e.nbytes == 0]
    stream.sort(key=_sort_key)
    total = sum(e.weight for e in stream)
    if stream:
        shares = _water_fill(loads, holders, total)
        starts = []  # byte offsets in the stream
        weights = []  # cumulative weights
        offset = weight = 0
        for e in stream:
            starts.append(offset)
            weights.append(weight)
            offset += e.nbytes
            weight += e.weight
        targets = []
        cumulative = 0
        for _, quota in shares[:-1]:
            cumulative += quota
            targets.append(cumulative)
        bounds = [0, *_cut_points(stream, starts, weights, targets, alignment), offset]
        i = 0
        for k, (rank, _) in enumerate(shares):
            seg_begin, seg_end = bounds[k], bounds[k + 1]
            if seg_begin == seg_end:
                continue
            # Skip items that end at or before this segment's start.
            while starts[i] + stream[i].nbytes <= seg_begin:
                i += 1
            j = i
            while j < len(stream) and starts[j] < seg_end:
                e, begin = stream[j], starts[j]
                lo = max(seg_begin, begin) - begin
                hi = min(seg_end, begin + e.nbytes) - begin
                e.parts[rank] = None if (lo, hi) == (0, e.nbytes) else (lo, hi)
                loads[rank] += _part_weight(e, lo, hi)
                j += 1
    for e in sorted(empty, key=_sort_key):
        e.parts[min(holders, key=lambda r: (loads[r], r))] = None


def balance_save_plans(
    all_plans: Sequence[SavePlan], *, split_alignment: int = SPLIT_ALIGNMENT
) -> list[SavePlan]:
    """Decide which rank writes which bytes of every item, balancing bytes per rank.

    Plans that carry ``stored_sizes`` (``{(fqn, offset): estimated stored bytes}``, as
    :class:`SavePlanner` makes them for a compressing writer) are balanced by those estimates
    (the lowest holder's, per item); items without one weigh their raw bytes.

    Items held by one rank stay there. Items held by several ranks are grouped by their set of
    holders; groups with fewer holders are placed first (they are the most constrained), each
    group's bytes are shared among its holders by water-filling over the loads assigned so far,
    and its items, largest first, are cut into one consecutive segment per holder. Cost:
    ``O(n log n)`` in the number of items, plus ``O(h log h)`` per group of ``h`` holders.

    Args:
        all_plans: Local plans, one per rank, indexed by rank.
        split_alignment: Interior split points lie at multiples of this many bytes from an
            item's start; must be a positive multiple of 16.

    Returns:
        One plan per rank: the items the rank writes (whole or in part), in the rank's original
        order, with ``storage_data`` set to a :class:`ByteRanges` for the partial ones. Index
        hints are left untouched. Any ``storage_data`` of the input plans is replaced.

    Raises:
        ValueError: If ``split_alignment`` is invalid, a plan holds one index twice, or the
            copies of one index differ in type, shape or dtype.
    """
    plans = []
    for rank, (plan, mine) in enumerate(zip(all_plans, _balance(all_plans, split_alignment))):
        items = []
        ranges = {}
        for item, entry in mine:
            if rank in entry.parts:
                items.append(item)
                span = entry.parts[rank]
                if span is not None:
                    ranges[item.index] = span
        plans.append(dataclasses.replace(plan, items=items, storage_data=ByteRanges(ranges)))
    return plans


def _balance(all_plans: Sequence[SavePlan], alignment: int) -> list[_RankItems]:
    """Fill every entry's ``parts``; returns each rank's items paired with their entries."""
    if alignment <= 0 or alignment % 16:
        raise ValueError(f"split_alignment must be a positive multiple of 16, got {alignment}")
    entries, per_rank = _collect(all_plans)
    loads = [0] * len(all_plans)
    groups: dict[tuple[int, ...], list[_Entry]] = {}
    for entry in entries:
        if len(entry.holders) == 1:
            rank = entry.holders[0]
            entry.parts[rank] = None
            loads[rank] += entry.weight
        else:
            groups.setdefault(tuple(entry.holders), []).append(entry)
    for holders in sorted(groups, key=lambda h: (len(h), h)):
        _assign_group(groups[holders], holders, loads, alignment)
    return per_rank


def _build_metadata(
    per_rank: Sequence[_RankItems],
) -> tuple[list[tuple[list[WriteItem], dict[MetadataIndex, tuple[int, int]]]], Metadata,
           Pieces | None]:
    """Build each rank's final items and byte ranges, the checkpoint metadata naming every
    index once, and the plan's pieces (None when some tensor's chunks are not a grid), in one
    pass over the balanced entries (at thousands of ranks each pass over every item costs
    seconds).

    Mirrors DCP's ``create_default_global_save_plan`` (one chunk per item), but visits each
    index once: in the plan of the rank that writes the item's first byte (DCP's function would
    append one chunk per copy of a split item), which is its lowest writing rank
    (:func:`_assign_group` cuts in rank order). That rank's copy is the entry's ``final`` item,
    which every writing rank's plan then shares: copies differ at most in tensor properties
    that only the metadata uses (writers resolve an item's data from their own state dict by
    index). Unlike DCP's function it sets no index hints (``MetadataIndex.index``, the chunk's
    position in the metadata): no writer uses them at save time (a load's hints come from the
    metadata it reads), and making a new item per item costs a second at 4096 ranks.
    """
    md: dict[str, Any] = {}
    # per tensor, in chunk order: its metadata's chunk list, the chunks' offsets, their sizes,
    # the ranks writing each (gathered here, while each item is at hand)
    pieces: dict[str, tuple[list[Any], list[Any], list[Any], list[list[int]]]] = {}
    bytes_items: dict[str, list[int]] = {}
    writes = 0
    finals = []
    # Ranks sharing one plan's pairs (see _collect) visit only the pairs they write.
    sharing = Counter(map(id, per_rank))
    written: dict[int, dict[int, list[int]]] = {}  # id(pairs) -> rank -> positions it writes
    for rank, mine in enumerate(per_rank):
        items: list[WriteItem] = []
        ranges: dict[MetadataIndex, tuple[int, int]] = {}
        finals.append((items, ranges))
        pairs = mine
        if sharing[id(mine)] > 1:
            positions = written.get(id(mine))
            if positions is None:
                positions = written[id(mine)] = {}
                for position, (_, entry) in enumerate(mine):
                    for r in entry.parts:
                        positions.setdefault(r, []).append(position)
            pairs = [mine[p] for p in positions.get(rank, ())]
        for item, entry in pairs:
            parts = entry.parts
            if rank not in parts:
                continue  # not written here
            writes += 1
            span = parts[rank]
            if span is not None and span[0] != 0:  # not this item's first bytes
                final = entry.final
                if final is None:
                    raise AssertionError(f"no primary writer for {item.index} before rank {rank}")
                items.append(final)
                ranges[final.index] = span
                continue
            index = item.index
            fqn = index.fqn
            if item.type != WriteItemType.SHARD and fqn in md:
                raise ValueError(f"{fqn!r} is saved both as a whole value and as shards")
            if item.type == WriteItemType.BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                bytes_items[fqn] = _writers(entry)
                entry.final = item
                items.append(item)
                continue
            data = item.tensor_data
            if data is None:
                raise ValueError(f"tensor item {fqn!r} has no tensor data")
            mine_of = pieces.get(fqn)
            if mine_of is None:
                if fqn in md:
                    raise ValueError(f"{fqn!r} is saved both as a non-tensor and as shards")
                tensor_md = md[fqn] = TensorStorageMetadata(
                    properties=data.properties, size=data.size, chunks=[])
                mine_of = pieces[fqn] = (tensor_md.chunks, [], [], [])
            entry.final = item
            items.append(item)
            if span is not None:
                ranges[index] = span
            chunk = data.chunk
            chunks, offsets, sizes, writers = mine_of
            chunks.append(chunk)
            offsets.append(chunk.offsets)
            sizes.append(chunk.sizes)
            writers.append(list(parts) if len(parts) == 1 else _writers(entry))
    tensors: dict[str, tuple[Any, Grid, list[list[int]]]] = {}
    for fqn, (_, offsets, sizes, writers) in pieces.items():
        tensor_md = md[fqn]
        found = Grid.of_boxes(tensor_md.size, offsets, sizes)
        if found is None:
            return finals, Metadata(md), None
        grid, numbers = found
        if numbers != list(range(len(numbers))):  # chunks not in cell order: place them
            per_cell: list[list[int]] = [[] for _ in numbers]
            for n, w in zip(numbers, writers):
                per_cell[n] = w
            writers = per_cell
        tensors[fqn] = (tensor_md.properties, grid, writers)
    return finals, Metadata(md), Pieces(tensors, bytes_items, writes)


def _writers(entry: _Entry) -> list[int]:
    """The ranks writing an entry, in the order of the bytes they write."""
    parts = entry.parts
    if len(parts) == 1:
        return list(parts)
    return sorted(parts, key=lambda r: (parts[r] or (0, 0))[0])


def _validate(metadata: Metadata, world_size: int, pieces: Pieces | None = None) -> list[str]:
    """Check chunk bounds and that each tensor's chunks cover its volume exactly once (true of
    every tensor of ``pieces``: its chunks are a grid's cells)."""
    if pieces is not None:
        return []
    errors = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata) or not isinstance(md, TensorStorageMetadata):
            continue
        if len(md.size) == 0:
            continue
        if len(md.chunks) == 1 and md.chunks[0].sizes == md.size and not any(md.chunks[0].offsets):
            continue  # the common case: one whole chunk
        volume = 0
        for chunk in md.chunks:
            if any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, md.size)
            ):
                errors.append(f"{fqn}: chunk {chunk} out of bounds of {tuple(md.size)}")
            volume += math.prod(chunk.sizes)
        if world_size > 1 and volume != math.prod(md.size):
            errors.append(
                f"{fqn}: chunks cover {volume} elements of {math.prod(md.size)} "
                "(missing or overlapping shards)"
            )
    return errors
