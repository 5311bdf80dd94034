"""DCP save planner that spreads replicated state over every rank that holds it.

DCP's :class:`~torch.distributed.checkpoint.default_planner.DefaultSavePlanner` deduplicates
replicated items: each item held by several ranks is written whole by one of them, chosen
greedily in arrival order. Two ranks saving one replicated 100 MiB tensor then write 100 MiB and
0 B, and an FSDP ``NO_SHARD`` or DDP checkpoint is written by essentially one rank.

:class:`SavePlanner` keeps every copy in the local plans and lets the coordinator decide, by
bytes, which rank writes which part of each replicated item:

* an item present in exactly one rank's plan (a DTensor shard, a ``ShardedTensor`` shard) stays
  with that rank and counts toward its load;
* items present in several plans (plain tensors under DDP / FSDP ``NO_SHARD``, DTensors with
  ``Replicate()`` placements, the replicated mesh dimension of HSDP) are grouped by the set of
  ranks that hold them; each group's bytes are water-filled over its holders on top of the load
  they already carry, and the group's items, largest first, are cut into consecutive segments,
  one per holder, at multiples of :data:`SPLIT_ALIGNMENT` bytes;
* non-tensor values (``BYTE_IO`` items) are never split and are written once.

Before any of that, the planner checks that the copies of replicated tensors agree: each rank
digests every tensor it holds that other ranks may hold too (:func:`replica_digests`, in the local
plan step), and the coordinator compares the digests of each item's holders. Copies that differ
(desynchronised DDP replicas, say) would otherwise be saved as a silent mix of the ranks' bytes;
instead every rank raises :class:`pyckpt.errors.ReplicaMismatchError` before anything is
written. By default the digest reads a sample of at most 1 MiB per tensor (the same blocks on
every rank); ``SavePlanner(check_replicas="full")`` reads every byte, and
``SavePlanner(check_replicas=False)`` skips the check.

The outcome reaches the storage layer in ``SavePlan.storage_data`` as a :class:`ByteRanges`:
for every item a rank writes only partially, the half-open byte range of the item's row-major
contiguous bytes that this rank writes. The ranges of the copies of one item tile
``[0, nbytes)`` exactly. :class:`pyckpt.Writer` writes only those bytes and records the
segments in the checkpoint metadata; :class:`pyckpt.Reader` reassembles them for any load world
size. The planner therefore requires :class:`pyckpt.Writer`; DCP's own writers would ignore
the ranges and write every copy whole.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import ChainMap
from collections.abc import Sequence
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from pyckpt import _C, _gc, _knobs
from pyckpt.errors import ReplicaMismatchError

__all__ = [
    "SPLIT_ALIGNMENT",
    "ByteRanges",
    "SavePlanner",
    "balance_save_plans",
    "check_replica_digests",
    "replica_digests",
]

logger = logging.getLogger(__name__)

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


@dataclasses.dataclass(eq=False)
class _Entry:
    """One distinct item (one ``MetadataIndex``) over all plans, and where it is written."""

    item: WriteItem  # the lowest holder's copy
    nbytes: int  # bytes of the item's data; the weight used for BYTE_IO items
    splittable: bool
    holders: list[int]  # ranks whose plan holds the item, ascending
    parts: dict[int, tuple[int, int] | None] = dataclasses.field(default_factory=dict)
    """Writing ranks -> byte range, or None when that rank writes the item whole."""
    final: WriteItem | None = None  # the primary copy with its metadata index hint, once known


# A rank's items, each with the entry shared by all copies of its index.
_RankItems = list[tuple[WriteItem, _Entry]]


def _item_nbytes(item: WriteItem) -> int:
    """Return the number of bytes of the item's local data (the chunk, not the whole tensor)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return _BYTE_IO_WEIGHT
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _sort_key(entry: _Entry) -> tuple[Any, ...]:
    """Largest first; ties broken by name and offset so the result ignores arrival order."""
    offset = entry.item.index.offset
    return (-entry.nbytes, entry.item.index.fqn, tuple(offset) if offset is not None else ())


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


def _collect(all_plans: Sequence[SavePlan]) -> tuple[list[_Entry], list[_RankItems]]:
    """Group the copies of each index over all plans (one hash lookup per copy)."""
    # Keyed by (fqn, offset), which is what MetadataIndex equality compares, without calling
    # the dataclass's Python-level __hash__/__eq__ for every copy.
    entries: dict[tuple[str, Any], _Entry] = {}
    # What _check_same_item compares, per index: one tuple comparison per copy (half the cost
    # of the call, which only runs to raise); None where a copy cannot be compared that way.
    signatures: dict[tuple[str, Any], tuple[Any, ...] | None] = {}
    per_rank: list[_RankItems] = []
    for rank, plan in enumerate(all_plans):
        mine: _RankItems = []
        for item in plan.items:
            key = (item.index.fqn, item.index.offset)
            entry = entries.get(key)
            td = item.tensor_data
            if item.type == WriteItemType.BYTE_IO:
                signature: tuple[Any, ...] | None = (WriteItemType.BYTE_IO,)
            else:
                signature = None if td is None else (td.size, td.chunk.sizes, td.properties.dtype)
            if entry is None:
                splittable = item.type != WriteItemType.BYTE_IO and td is not None
                entry = entries[key] = _Entry(item, _item_nbytes(item), splittable, [rank])
                signatures[key] = signature
            elif entry.holders[-1] == rank:  # ranks are visited in ascending order
                raise ValueError(
                    f"rank {rank}'s plan holds item {item.index.fqn!r} "
                    f"(offset {item.index.offset}) twice"
                )
            else:
                if signature is None or signature != signatures[key]:
                    _check_same_item(entry.item, item, rank)
                entry.holders.append(rank)
            mine.append((item, entry))
        per_rank.append(mine)
    return list(entries.values()), per_rank


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
    stream: Sequence[_Entry], starts: Sequence[int], targets: Sequence[int], alignment: int
) -> list[int]:
    """Pick, for each cumulative target, the nearest allowed cut position in the stream.

    The stream is the concatenation of the items' bytes. Cuts are allowed at item boundaries
    and, inside a splittable item, at multiples of ``alignment`` from the item's start, so a cut
    lies within ``alignment / 2`` of its target (or half an unsplittable item's size).
    """
    cuts: list[int] = []
    i = 0
    previous = 0
    for target in targets:
        while i < len(stream) and starts[i] + stream[i].nbytes <= target:
            i += 1
        if i == len(stream):
            cut = starts[-1] + stream[-1].nbytes if stream else 0
        else:
            begin, size = starts[i], stream[i].nbytes
            if stream[i].splittable:
                low = begin + (target - begin) // alignment * alignment
                high = min(begin + size, low + alignment)
            else:
                low, high = begin, begin + size
            cut = low if target - low <= high - target else high
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
    total = sum(e.nbytes for e in stream)
    if stream:
        shares = _water_fill(loads, holders, total)
        starts = []
        offset = 0
        for e in stream:
            starts.append(offset)
            offset += e.nbytes
        targets = []
        cumulative = 0
        for _, quota in shares[:-1]:
            cumulative += quota
            targets.append(cumulative)
        bounds = [0, *_cut_points(stream, starts, targets, alignment), total]
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
                loads[rank] += hi - lo
                j += 1
    for e in sorted(empty, key=_sort_key):
        e.parts[min(holders, key=lambda r: (loads[r], r))] = None


def balance_save_plans(
    all_plans: Sequence[SavePlan], *, split_alignment: int = SPLIT_ALIGNMENT
) -> list[SavePlan]:
    """Decide which rank writes which bytes of every item, balancing bytes per rank.

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
            loads[rank] += entry.nbytes
        else:
            groups.setdefault(tuple(entry.holders), []).append(entry)
    for holders in sorted(groups, key=lambda h: (len(h), h)):
        _assign_group(groups[holders], holders, loads, alignment)
    return per_rank


def _build_metadata(per_rank: Sequence[_RankItems]) -> Metadata:
    """Build the checkpoint metadata from balanced entries, naming every index once.

    Mirrors DCP's ``create_default_global_save_plan`` (one chunk per item, index hint = the
    chunk's position), but visits each index once: in the plan of the rank that writes the
    item's first byte (DCP's function would append one chunk per copy of a split item). Sets
    each entry's ``final`` item, which every writing rank's plan then shares: copies differ at
    most in tensor properties that only the metadata uses (writers resolve an item's data
    from their own state dict by index).
    """
    md: dict[str, Any] = {}
    for rank, mine in enumerate(per_rank):
        for item, entry in mine:
            if rank not in entry.parts:
                continue  # not written here
            span = entry.parts[rank]
            if span is not None and span[0] != 0:
                continue  # not this item's first bytes
            index = item.index
            if item.type != WriteItemType.SHARD and index.fqn in md:
                raise ValueError(f"{index.fqn!r} is saved both as a whole value and as shards")
            if item.type == WriteItemType.BYTE_IO:
                md[index.fqn] = BytesStorageMetadata()
                entry.final = item
                continue
            data = item.tensor_data
            if data is None:
                raise ValueError(f"tensor item {index.fqn!r} has no tensor data")
            tensor_md = md.setdefault(
                index.fqn,
                TensorStorageMetadata(properties=data.properties, size=data.size, chunks=[]),
            )
            if not isinstance(tensor_md, TensorStorageMetadata):
                raise ValueError(f"{index.fqn!r} is saved both as a non-tensor and as shards")
            hinted = MetadataIndex(index.fqn, index.offset, len(tensor_md.chunks))
            entry.final = WriteItem(index=hinted, type=item.type, tensor_data=data)
            tensor_md.chunks.append(data.chunk)
    return Metadata(md)


def _validate(metadata: Metadata, world_size: int) -> list[str]:
    """Check chunk bounds and that each tensor's chunks cover its volume exactly once."""
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


# --- replica check -----------------------------------------------------------------------

_ItemKey = tuple[str, tuple[int, ...] | None]
"""An item's identity: its fqn and chunk offset (what ``MetadataIndex`` equality compares)."""

Digest = tuple[str, int]
"""A content digest: its kind and value. Kinds: ``"sampled"`` (the default check: a sample of
blocks, host or device), ``"xxh64"`` (every byte, host copies and small device tensors) and
``"rowcol"`` (every byte: the device checksum of large device tensors)."""

CheckMode = Literal["sample", "full"]
"""What a replica check reads: a sample of each tensor (the default) or every byte."""

_HASH_BLOCK_BYTES = 4 << 20
"""A full digest hashes host bytes in blocks of this many bytes, on several threads."""

_SAMPLE_BLOCK_BYTES = 16 << 10
"""A sampled digest reads blocks of this many bytes (16 KiB)."""

_SAMPLE_BLOCKS = 64
"""A sampled digest reads at most this many blocks of a tensor (1 MiB): the first, the last and
one in each of 62 equal strata between; a tensor of at most 1 MiB is read whole."""

_DEVICE_BATCH_BYTES = 64 << 20
"""Device bytes are copied to the host for hashing in batches of at most about this size."""

_DEVICE_SMALL_BYTES = 1 << 20
"""Device tensors up to this size are copied to the host in one batch per device and hashed
there (one transfer instead of several kernel launches each); larger ones are reduced on the
device."""

_DEVICE_ROW_WORDS = 512
"""The device checksum sums rows of this many int32 words (2 KiB): a row sum stays below 2**40."""

_DEVICE_CHUNK_ROWS = 16384
"""Rows (32 MiB of data) widened to int64 at once: the bound on the checksum's temporary."""


@dataclasses.dataclass(frozen=True)
class _CheckedPlan(SavePlan):
    """A local plan that carries the content digests of its replicable items to the coordinator.

    The digests ride in a field of their own (not ``storage_data``, which belongs to the storage
    writer's ``prepare_local_plan``); ``dataclasses.replace`` keeps them.
    """

    replica_digests: dict[_ItemKey, Digest] = dataclasses.field(default_factory=dict)


def _key(index: MetadataIndex) -> _ItemKey:
    return index.fqn, tuple(index.offset) if index.offset is not None else None


def _item_name(key: _ItemKey) -> str:
    fqn, offset = key
    return fqn if not offset or not any(offset) else f"{fqn} at offset {list(offset)}"


def _may_be_replicated(obj: Any, item: WriteItem) -> bool:
    """Whether other ranks may hold a copy of this item's data.

    A DTensor's local data is replicated over its mesh dimensions that are not ``Shard``
    (``Replicate()``, and ``Partial()``, whose copies differ by design and must not be saved);
    a plain tensor is replicated under DDP / FSDP ``NO_SHARD`` (DCP names it the same on every
    rank); a ``ShardedTensor`` shard (a chunk smaller than its tensor) belongs to one rank.
    """
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return False
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        mesh = obj.device_mesh
        return any(not p.is_shard() and mesh.size(d) > 1 for d, p in enumerate(obj.placements))
    data = item.tensor_data
    return data.chunk.sizes == data.size and not any(data.chunk.offsets)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a flat contiguous uint8 tensor on its own device."""
    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


def _xxh64(data: np.ndarray, seed: int = 0) -> int:
    """XXH64 of a contiguous array (numpy's stubs do not declare the buffer protocol)."""
    return _C.xxh64(cast(Any, data), seed)


def _rowcol_checksum(flat: torch.Tensor) -> torch.Tensor:
    """The device checksum of one byte tensor, as an int64 tensor on its device.

    The bytes are read as int32 words in rows of :data:`_DEVICE_ROW_WORDS`; the checksum is
    every row's sum, every column's sum (words at the same position in their rows) and the
    tail bytes after the last whole row, all exact in int64. A change confined to one or two
    words always changes a row or a column sum. The data is widened to int64 in chunks of
    :data:`_DEVICE_CHUNK_ROWS` rows (a 64 MiB temporary): about 7 bytes of device memory
    traffic per byte checked; the checksum is 1/256 of the data's size.
    """
    row_bytes = 4 * _DEVICE_ROW_WORDS
    rows = flat.numel() // row_bytes
    parts = []
    if rows:
        body = flat[: rows * row_bytes]
        if body.storage_offset() % 4:  # a view into a buffer of 1- or 2-byte elements
            body = body.clone()
        words = body.view(torch.int32).view(rows, _DEVICE_ROW_WORDS)
        columns = torch.zeros(_DEVICE_ROW_WORDS, dtype=torch.int64, device=flat.device)
        for first in range(0, rows, _DEVICE_CHUNK_ROWS):
            wide = words[first : first + _DEVICE_CHUNK_ROWS].to(torch.int64)
            parts.append(wide.sum(dim=1))
            columns += wide.sum(dim=0)
        parts.append(columns)
    parts.append(flat[rows * row_bytes :].to(torch.int64))
    return torch.cat(parts)


def _device_digests(flats: Sequence[torch.Tensor]) -> tuple[list[np.ndarray], list[int]]:
    """Prepares digests of byte tensors on devices without copying their bulk to the host.

    Tensors up to :data:`_DEVICE_SMALL_BYTES` are concatenated on their device and copied to
    the host in one transfer, to be hashed like host tensors (so their digest is the same as a
    host copy's); larger ones get the device checksum of :func:`_rowcol_checksum`, hashed on
    the host. One synchronisation per device.

    Returns:
        Per tensor, in order: the host bytes to hash (an empty array for a large tensor) and
        the XXH64 of the device checksum (0 for a small tensor).
    """
    arrays = [np.empty(0, dtype=np.uint8)] * len(flats)
    checksums = [0] * len(flats)
    for device in {f.device for f in flats}:
        slots = [i for i, f in enumerate(flats) if f.device == device]
        small = [i for i in slots if flats[i].numel() <= _DEVICE_SMALL_BYTES]
        large = [i for i in slots if flats[i].numel() > _DEVICE_SMALL_BYTES]
        sums = [_rowcol_checksum(flats[i]) for i in large]
        pieces = [flats[i] for i in small] + [s.view(torch.uint8) for s in sums]
        if not pieces:
            continue
        host = torch.cat(pieces).cpu().numpy()
        pos = 0
        for i in small:
            arrays[i] = host[pos : pos + flats[i].numel()]
            pos += flats[i].numel()
        for i, checksum in zip(large, sums):
            n = checksum.numel() * 8
            checksums[i] = _xxh64(host[pos : pos + n], flats[i].numel())
            pos += n
    return arrays, checksums


def _to_host(pieces: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Copies byte tensors of one device to the host, concatenated in batches of about
    :data:`_DEVICE_BATCH_BYTES` (one transfer each, bounding the device's temporary)."""
    out: list[np.ndarray] = []
    batch: list[torch.Tensor] = []
    size = 0
    for k, piece in enumerate(pieces):
        batch.append(piece)
        size += piece.numel()
        if size >= _DEVICE_BATCH_BYTES or k == len(pieces) - 1:
            host = torch.cat(batch).cpu().numpy()
            pos = 0
            for p in batch:
                out.append(host[pos : pos + p.numel()])
                pos += p.numel()
            batch, size = [], 0
    return out


def _gather_sample(flat: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
    """The given blocks of a byte tensor (increasing, the last one its last block), gathered on
    its device into one tensor: one ``index_select`` over the whole blocks, plus the tail."""
    size = _SAMPLE_BLOCK_BYTES
    last = blocks[-1]
    body = flat[: last * size].view(last, size)
    index = torch.tensor(blocks[:-1], dtype=torch.long, device=flat.device)
    return torch.cat([body.index_select(0, index).reshape(-1), flat[last * size :]])


def _device_samples(flats: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """The bytes that a sampled digest reads from byte tensors on devices, on the host.

    Per device, two small transfers: the first and last blocks of the tensors larger than a
    sample (they seed the choice of blocks, as in ``_C.sampled_blocks``), then the chosen
    blocks, gathered on the device, and the smaller tensors whole. Hashing the result with
    ``_C.block_digests`` (seed: the tensor's size) gives the digest ``_C.sampled_digests``
    computes from a host copy.
    """
    size, count = _SAMPLE_BLOCK_BYTES, _SAMPLE_BLOCKS
    out = [np.empty(0, dtype=np.uint8)] * len(flats)
    for device in {f.device for f in flats}:
        slots = [i for i, f in enumerate(flats) if f.device == device]
        large = [i for i in slots if flats[i].numel() > size * count]
        ends = []
        for i in large:
            ends += [flats[i][:size], flats[i][(flats[i].numel() - 1) // size * size :]]
        end_digests = [_xxh64(e) for e in _to_host(ends)]
        seeds = {i: end_digests[2 * k : 2 * k + 2] for k, i in enumerate(large)}
        pieces = []
        for i in slots:
            flat = flats[i]
            if i in seeds:
                blocks = _C.sampled_blocks(flat.numel(), size, count, *seeds[i])
                flat = _gather_sample(flat, blocks)
            pieces.append(flat)
        for i, host in zip(slots, _to_host(pieces)):
            out[i] = host
    return out


def replica_digests(
    tensors: Sequence[torch.Tensor], *, mode: CheckMode = "full", threads: int | None = None
) -> list[Digest]:
    """Content digests of tensors, for comparing copies of replicated state across ranks.

    ``mode="full"`` reads every byte: host tensors get an XXH64-based digest (the native XXH64
    of 4 MiB blocks, hashed on ``threads`` threads with the GIL released, then of the block
    digests), and so do device tensors of up to 1 MiB, copied to the host in one batch. Larger
    device tensors get a checksum computed on the device (row and column sums, see
    ``_rowcol_checksum``), so their bytes are not copied to the host.

    ``mode="sample"`` reads at most 1 MiB per tensor: tensors up to 1 MiB whole, larger ones
    64 blocks of 16 KiB (the first, the last, and one in each of 62 equal strata between, at
    positions drawn from the content of the first and last blocks, so equal copies read the
    same blocks). Device tensors are sampled on the device and only the sample is copied to the
    host, so host and device copies get comparable digests. A difference outside the sampled
    blocks is not seen: see docs/REPLICATED.md.

    Digests depend only on the values' bytes (row-major), not on strides or, for one kind, on
    the device.

    Args:
        tensors: Plain tensors (a DTensor's local tensor, not the DTensor).
        mode: ``"full"`` or ``"sample"``.
        threads: Hashing threads (default ``PYCKPT_NUM_THREADS``).

    Returns:
        One ``(kind, value)`` digest per tensor, in order; equal bytes give equal digests of the
        same kind.

    Raises:
        ValueError: Unknown ``mode``.
    """
    if mode not in ("full", "sample"):
        raise ValueError(f"replica check mode must be 'full' or 'sample', got {mode!r}")
    nthreads = threads if threads is not None else _knobs.num_threads()
    flats = [_flat_bytes(t) for t in tensors]
    on_device = [i for i, f in enumerate(flats) if f.device.type != "cpu"]
    on_host = [i for i, f in enumerate(flats) if f.device.type == "cpu"]
    out: list[Digest] = [("", 0)] * len(flats)
    if mode == "sample":
        values = _C.sampled_digests(
            [flats[i].numpy() for i in on_host], _SAMPLE_BLOCK_BYTES, _SAMPLE_BLOCKS, nthreads
        )
        for i, value in zip(on_host, values):
            out[i] = ("sampled", value)
        if on_device:
            samples = _device_samples([flats[i] for i in on_device])
            seeds = [flats[i].numel() for i in on_device]
            values = _C.block_digests(samples, _SAMPLE_BLOCK_BYTES, seeds, nthreads)
            for i, value in zip(on_device, values):
                out[i] = ("sampled", value)
        return out
    arrays = [f.numpy() if f.device.type == "cpu" else None for f in flats]
    if on_device:
        small, checksums = _device_digests([flats[i] for i in on_device])
        for i, array, checksum in zip(on_device, small, checksums):
            if flats[i].numel() <= _DEVICE_SMALL_BYTES:
                arrays[i] = array
            else:
                out[i] = ("rowcol", checksum)
    hashed = [i for i, a in enumerate(arrays) if a is not None]
    values = _C.block_digests(
        [arrays[i] for i in hashed], _HASH_BLOCK_BYTES, [flats[i].numel() for i in hashed], nthreads
    )
    for i, value in zip(hashed, values):
        out[i] = ("xxh64", value)
    return out


def check_replica_digests(all_plans: Sequence[SavePlan]) -> None:
    """Raise if the holders of one replicated item reported different digests.

    Args:
        all_plans: Local plans, one per rank; plans made by :class:`SavePlanner` with
            ``check_replicas=True`` carry the digests of their replicable items, others none.

    Raises:
        ReplicaMismatchError: Naming every differing item and its holders grouped by content
            (``ranks [0, 2] vs [1, 3]``). Digests of different kinds (one copy in host memory,
            another on a device) are compared only within their kind.
    """
    seen: dict[_ItemKey, dict[Digest, list[int]]] = {}
    for rank, plan in enumerate(all_plans):
        for key, digest in getattr(plan, "replica_digests", {}).items():
            seen.setdefault(key, {}).setdefault(digest, []).append(rank)
    mismatches: dict[str, list[list[int]]] = {}
    for key, by_digest in seen.items():
        if len(by_digest) < 2:
            continue
        kinds = [kind for kind, _ in by_digest]
        if all(kinds.count(kind) < 2 for kind in kinds):
            continue  # one digest per kind: nothing comparable differs
        mismatches[_item_name(key)] = sorted(by_digest.values())
    if not mismatches:
        return
    shown = []
    for name in sorted(mismatches)[:8]:
        groups = " vs ".join(str(g) for g in mismatches[name])
        shown.append(f"{name!r}: ranks {groups}")
    more = f"; and {len(mismatches) - 8} more" if len(mismatches) > 8 else ""
    raise ReplicaMismatchError(
        f"replicated state differs across ranks, nothing was written: {'; '.join(shown)}{more}. "
        "The replicas are out of sync; SavePlanner(check_replicas=False) saves anyway, each "
        "byte range then taken from whichever rank writes it",
        mismatches,
    )


class SavePlanner(DefaultSavePlanner):
    """DCP save planner that balances the bytes each rank writes, splitting replicated items.

    Usage::

        dcp.save(state_dict, storage_writer=pyckpt.Writer(path), planner=pyckpt.SavePlanner())

    Local planning is DCP's (every rank lists every item it holds, flattened like DCP does);
    global planning replaces DCP's whole-item deduplication with :func:`balance_save_plans`.
    The metadata names each item once, with the same index hint in every rank's copy. Plan
    caching (``enable_plan_caching``) is not supported: global planning is cheap.

    Requires :class:`pyckpt.Writer`, which writes only each rank's byte ranges. With DCP's
    default planner, :class:`pyckpt.Writer` still works, but each replicated item is then
    written whole by one rank.

    Thread safety: one instance per save; not safe to share between concurrent saves.

    Args:
        flatten_state_dict: Flatten nested dicts and lists, as DCP's default planner does.
        flatten_sharded_tensors: Flatten nested ``ShardedTensor``\\ s (FSDP 2D), as DCP does.
        split_alignment: Interior split points lie at multiples of this many bytes (a positive
            multiple of 16; default :data:`SPLIT_ALIGNMENT`, 1 MiB).
        check_replicas: Before planning, check that the copies of replicated state agree and
            raise :class:`pyckpt.errors.ReplicaMismatchError` (on every rank, before anything
            is written) if not. ``True`` or ``"sample"`` (the default): each rank reads the
            same sample of at most 1 MiB per tensor (tensors up to 1 MiB whole), which finds
            copies that differ nearly everywhere (desynchronised DDP) but can miss a difference
            confined to bytes outside the sample (see docs/REPLICATED.md). ``"full"``: each rank
            reads every replicated byte it holds (on its device for large GPU tensors).
            ``False``: no check. Skipped in a single process.

    Raises:
        ValueError: ``split_alignment`` is not a positive multiple of 16, or ``check_replicas``
            is not one of ``True``, ``False``, ``"sample"``, ``"full"``.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        *,
        split_alignment: int = SPLIT_ALIGNMENT,
        check_replicas: bool | CheckMode = True,
    ) -> None:
        if split_alignment <= 0 or split_alignment % 16:
            raise ValueError(
                f"split_alignment must be a positive multiple of 16, got {split_alignment}"
            )
        mode: Literal[False] | CheckMode
        if check_replicas is True or check_replicas == "sample":
            mode = "sample"
        elif check_replicas is False or check_replicas == "full":
            mode = check_replicas
        else:
            raise ValueError(
                f"check_replicas must be True, False, 'sample' or 'full', got {check_replicas!r}"
            )
        super().__init__(
            flatten_state_dict=flatten_state_dict,
            flatten_sharded_tensors=flatten_sharded_tensors,
        )
        self.split_alignment = split_alignment
        self.check_replicas = mode  # "sample", "full" or False

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, plus the digests of the items other ranks may also hold.

        Returns:
            The local plan; with ``check_replicas`` in a process group of several ranks, a plan
            that also carries the content digest of every item that may be replicated (see
            :func:`replica_digests`).
        """
        plan = super().create_local_plan()
        if not self.check_replicas or not (
            dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        ):
            return plan
        keys: list[_ItemKey] = []
        tensors: list[torch.Tensor] = []
        for item in plan.items:
            if not _may_be_replicated(self.state_dict.get(item.index.fqn), item):
                continue
            data = self.lookup_object(item.index)
            # Layouts the writer refuses are left to its typed error.
            if (
                isinstance(data, torch.Tensor)
                and data.layout == torch.strided
                and not (data.is_quantized or data.is_meta)
            ):
                keys.append(_key(item.index))
                tensors.append(data)
        start = time.perf_counter()
        digests = dict(zip(keys, replica_digests(tensors, mode=self.check_replicas)))
        logger.debug(
            "replica check (%s): %d tensors digested in %.3f s",
            self.check_replicas,
            len(tensors),
            time.perf_counter() - start,
        )
        plan = _CheckedPlan(
            items=plan.items,
            storage_data=plan.storage_data,
            planner_data=plan.planner_data,
            usable=plan.usable,
            replica_digests=digests,
        )
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Balance the local plans and build the checkpoint metadata.

        Args:
            all_plans: Local plans, one per rank.

        Returns:
            The per-rank plans (items to write, ``storage_data`` a :class:`ByteRanges`) and the
            global ``Metadata``.

        Raises:
            ReplicaMismatchError: With ``check_replicas``, if copies of a replicated item differ
                (see :func:`check_replica_digests`).
            ValueError: If the plans are inconsistent (see :func:`balance_save_plans`) or the
                shards of a tensor do not cover it exactly.
        """
        with _gc.paused():  # O(N x T) objects that all stay alive (see pyckpt._gc)
            return self._create_global_plan(all_plans)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self.check_replicas:
            check_replica_digests(all_plans)
        per_rank = _balance(all_plans, self.split_alignment)
        metadata = _build_metadata(per_rank)
        global_plan = []
        for rank, (plan, mine) in enumerate(zip(all_plans, per_rank)):
            items = []
            ranges = {}
            for _, entry in mine:
                if rank not in entry.parts:
                    continue
                final = entry.final
                if final is None:  # every written index has a writer of its first bytes
                    raise AssertionError(f"no primary writer for {entry.item.index}")
                items.append(final)
                span = entry.parts[rank]
                if span is not None:
                    ranges[final.index] = span
            global_plan.append(  # a plain SavePlan: the digests need not travel back
                SavePlan(
                    items=items,
                    storage_data=ByteRanges(ranges),
                    planner_data=plan.planner_data,
                    usable=plan.usable,
                )
            )

        if self.flatten_state_dict:
            merged = dict(ChainMap(*(p.planner_data for p in all_plans if p.planner_data)))
            metadata = dataclasses.replace(metadata, planner_data=merged)

        errors = _validate(metadata, len(all_plans))
        if errors:
            summary = "; ".join(errors)
            if len(summary) > 500:
                summary = summary[:500] + "... (truncated)"
            raise ValueError(f"invalid global save plan: {summary}")

        self.global_plan = global_plan
        self.metadata = metadata
        return global_plan, metadata
