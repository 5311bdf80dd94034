"""The replica check of :class:`pyckpt.SavePlanner`: content digests of the tensors that
several ranks may hold, and their comparison on the coordinator.

Each rank digests every tensor other ranks may hold too (:func:`replica_digests`, host or
device, sampled or full); the coordinator compares the digests of each item's holders
(:func:`check_replica_digests`) and raises :class:`pyckpt.errors.ReplicaMismatchError` before
anything is written. Imported through :mod:`pyckpt.planner`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from pyckpt import _C, _knobs
from pyckpt.errors import ReplicaMismatchError

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
    if _differ(all_plans, once=True):
        _raise_mismatches(_differ(all_plans, once=False))


def _differ(all_plans: Sequence[SavePlan], once: bool) -> dict[str, list[list[int]]]:
    """Each item whose holders reported different digests -> its holders grouped by digest;
    ``once``: plans with equal ``digest`` attributes (which cover the replica digests, see
    :func:`pyckpt._balance.plan_digest`) are looked at once (the ranks are then incomplete)."""
    seen: dict[_ItemKey, dict[Digest, list[int]]] = {}
    looked: set[bytes] = set()
    for rank, plan in enumerate(all_plans):
        digest = getattr(plan, "digest", b"") if once else b""
        if digest:
            if digest in looked:
                continue
            looked.add(digest)
        for key, value in getattr(plan, "replica_digests", {}).items():
            seen.setdefault(key, {}).setdefault(value, []).append(rank)
    mismatches: dict[str, list[list[int]]] = {}
    for key, by_digest in seen.items():
        if len(by_digest) < 2:
            continue
        kinds = [kind for kind, _ in by_digest]
        if all(kinds.count(kind) < 2 for kind in kinds):
            continue  # one digest per kind: nothing comparable differs
        mismatches[_item_name(key)] = sorted(by_digest.values())
    return mismatches


def _raise_mismatches(mismatches: dict[str, list[list[int]]]) -> None:
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
