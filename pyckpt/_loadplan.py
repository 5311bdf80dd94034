"""DCP load planner whose per-rank planning does not grow with the number of saving ranks.

DCP's ``DefaultLoadPlanner`` plans each tensor with ``create_read_items_for_chunk_list``, which
sorts the tensor's N stored chunks on every rank: a rank loading T sharded tensors of a
checkpoint saved by N ranks does O(T x N log N) work, though it reads only the few pieces its
own shards overlap (BENCHMARKS.md, "Coordination and metadata at scale").

:class:`pyckpt.Reader` indexes each tensor's stored chunks when it reads the metadata
(:class:`pyckpt._chunkindex.ChunkIndex`, in :class:`IndexedTensorStorageMetadata`), and
:class:`LoadPlanner` finds each local chunk's overlapping pieces through it, with the same read
items as DCP. Metadata from any other reader is planned by DCP's own code.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from pyckpt import _gc
from pyckpt._chunkindex import ChunkIndex
from pyckpt._stateful import FreshOptimizerState
from pyckpt.errors import CheckpointFormatError

__all__ = ["GridChunks", "HeldKeys", "IndexedTensorStorageMetadata", "LoadPlanner",
           "grid_metadata", "grid_tensor_metadata", "indexed_tensor_metadata",
           "read_items_for_chunks"]


@dataclasses.dataclass(eq=False)
class IndexedTensorStorageMetadata(TensorStorageMetadata):
    """DCP's ``TensorStorageMetadata`` with the index of its ``chunks`` (what
    :class:`pyckpt.Reader` returns for every tensor). Compares equal to a plain
    ``TensorStorageMetadata`` of the same properties, size and chunks.

    The index is used only while ``chunks`` is the list it was built for (the same object).
    """

    chunk_index: ChunkIndex | None = dataclasses.field(default=None, repr=False, compare=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorStorageMetadata):
            return NotImplemented
        return (self.properties, self.size, self.chunks) == (
            other.properties, other.size, other.chunks)

    __hash__ = None  # type: ignore[assignment]  # mutable, as its base

    def index(self) -> ChunkIndex | None:
        """The index of ``chunks``, or None when ``chunks`` was replaced since it was built."""
        index = self.chunk_index
        if index is None or index.chunks is not self.chunks:
            return None
        return index


class GridChunks(Sequence[ChunkStorageMetadata]):
    """The stored chunks of a tensor of a version-4 checkpoint, made on access from its grid
    (:class:`pyckpt._format_shards.Grid`; chunk ``i`` is cell ``i``): a rank planning its load
    touches only the chunks it overlaps, not one object per saving rank."""

    def __init__(self, grid: Any) -> None:
        self.grid = grid

    def __len__(self) -> int:
        return int(self.grid.ncells)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("chunk index out of range")
        offsets, sizes = self.grid.cell(i)
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GridChunks):
            return bool(self.grid == other.grid)
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class GridChunkIndex:
    """:class:`~pyckpt._chunkindex.ChunkIndex` of :class:`GridChunks`: the overlapping cells
    found per dimension by bisection, in row-major order."""

    __slots__ = ("chunks",)

    def __init__(self, chunks: GridChunks) -> None:
        self.chunks = chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> Any:
        return self.chunks.grid.overlapping(offsets, sizes)


def grid_tensor_metadata(properties: TensorProperties, grid: Any) -> IndexedTensorStorageMetadata:
    """A tensor's storage metadata of a version-4 checkpoint: chunks from its grid."""
    chunks = GridChunks(grid)
    return IndexedTensorStorageMetadata(properties, torch.Size(grid.shape), chunks,  # type: ignore[arg-type]
                                        GridChunkIndex(chunks))  # type: ignore[arg-type]


def grid_metadata(metadata: Metadata, grids: dict[str, Any]) -> Metadata:
    """``metadata`` with the chunks of each tensor of ``grids`` (fqn -> its
    :class:`pyckpt._format_shards.Grid`) made from the grid on access (:class:`GridChunks`,
    equal to the list it replaces): a save's metadata that travels to every rank in O(tensors)
    bytes instead of a chunk per rank and tensor."""
    sd_md: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        grid = grids.get(fqn)
        sd_md[fqn] = md if grid is None or isinstance(md, BytesStorageMetadata) else \
            TensorStorageMetadata(md.properties, md.size, GridChunks(grid))  # type: ignore[arg-type]
    return dataclasses.replace(metadata, state_dict_metadata=sd_md)


def indexed_tensor_metadata(
    properties: TensorProperties, size: torch.Size, chunks: list[ChunkStorageMetadata]
) -> IndexedTensorStorageMetadata:
    """A tensor's storage metadata with its chunk index built (O(N) for chunks sorted along the
    sweep dimension, O(N log N) otherwise)."""
    return IndexedTensorStorageMetadata(properties, size, chunks, ChunkIndex(size, chunks))


def read_items_for_chunks(
    fqn: str, md: TensorStorageMetadata, local_chunks: Sequence[ChunkStorageMetadata]
) -> list[ReadItem]:
    """The read items that fill ``local_chunks`` of tensor ``fqn`` from its stored chunks: the
    same items as DCP's ``create_read_items_for_chunk_list`` (same indices, offsets and lengths;
    ordered by local chunk, then by stored chunk along the index's sweep dimension), found
    through the chunk index when ``md`` has one, by DCP's function otherwise."""
    index = md.index() if isinstance(md, IndexedTensorStorageMetadata) else None
    if index is None:
        return create_read_items_for_chunk_list(fqn, md, list(local_chunks))
    items: list[ReadItem] = []
    if not local_chunks or not md.chunks:
        return items
    chunks = md.chunks
    tensor = LoadItemType.TENSOR
    for local_idx, local in enumerate(local_chunks):
        l_off = local.offsets
        l_size = local.sizes
        dest_index = MetadataIndex(fqn, l_off, local_idx)
        for storage_idx in index.overlapping(l_off, l_size):
            stored = chunks[storage_idx]
            s_off = stored.offsets
            s_size = stored.sizes
            storage_offsets = []
            dest_offsets = []
            lengths = []
            for so, lo, ss, ls in zip(s_off, l_off, s_size, l_size):
                lengths.append(min(so + ss, lo + ls) - max(lo, so))
                if so > lo:
                    storage_offsets.append(0)
                    dest_offsets.append(so - lo)
                else:
                    storage_offsets.append(lo - so)
                    dest_offsets.append(0)
            items.append(ReadItem(
                type=tensor,
                dest_index=dest_index,
                dest_offsets=torch.Size(dest_offsets),
                storage_index=MetadataIndex(fqn, s_off, storage_idx),
                storage_offsets=torch.Size(storage_offsets),
                lengths=torch.Size(lengths),
            ))
    return items


def _local_chunks(obj: Any) -> list[ChunkStorageMetadata]:
    """The chunks of the full tensor that ``obj`` holds on this rank, as DCP lists them: a
    DTensor (or any object of DCP's checkpointable protocol) through ``__create_chunk_list__``,
    a ``ShardedTensor`` its local shards, a tensor the whole of itself."""
    if hasattr(obj, "__create_chunk_list__"):
        return list(obj.__create_chunk_list__())
    if isinstance(obj, ShardedTensor):
        return [
            ChunkStorageMetadata(offsets=torch.Size(s.metadata.shard_offsets),
                                 sizes=torch.Size(s.metadata.shard_sizes))
            for s in obj.local_shards()
        ]
    if isinstance(obj, torch.Tensor):
        return [ChunkStorageMetadata(offsets=torch.Size([0] * obj.dim()), sizes=obj.size())]
    raise ValueError(
        "Unsupported Type, expecting one of [Tensor, DTensor, ShardedTensor] "
        f",but got {type(obj)}"
    )


def _bytes_item(fqn: str) -> ReadItem:
    return ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex(fqn),
        dest_offsets=torch.Size((0,)),
        storage_index=MetadataIndex(fqn),
        storage_offsets=torch.Size((0,)),
        lengths=torch.Size((0,)),
    )


class HeldKeys(frozenset[str]):
    """``LoadPlan.planner_data`` of :class:`LoadPlanner`'s local plans: the top-level keys of the
    rank's state dict, for :class:`pyckpt.Reader`'s partial-load check (a key whose value asks
    for nothing, an empty dict or a ``Stateful`` not used yet, still holds the stored entries
    under it)."""


class LoadPlanner(DefaultLoadPlanner):
    """DCP load planner for pyckpt checkpoints (``pyckpt.LoadPlanner``; :func:`pyckpt.load`
    uses it; pass ``planner=pyckpt.LoadPlanner()`` to ``dcp.load`` to get it there).

    Same semantics and read items as DCP's ``DefaultLoadPlanner`` (nested state dicts, missing
    keys, ``allow_partial_load``, DTensor / ShardedTensor / tensor destinations, non-tensor
    values), with two differences:

    * With metadata read by :class:`pyckpt.Reader`, each tensor's read items are found through
      the index of its stored chunks built when the metadata was read: a rank's planning costs
      O(log N + k) per local chunk (k: the stored pieces it overlaps) instead of DCP's
      O(N log N) per tensor, N being the number of stored pieces (saving ranks for sharded
      state). Metadata from another reader is planned by DCP's code.
    * Non-tensor values (DCP ``BYTE_IO`` items) are unpickled with ``torch.load(...,
      weights_only=True)`` unless ``trusted=True``: only the types torch's weights-only
      unpickler allows (tensors, containers, numbers, strings, types registered with
      ``torch.serialization.add_safe_globals``) are rebuilt; any other pickle raises
      :class:`pyckpt.CheckpointFormatError` naming the item. DCP's planner (torch 2.13) calls
      ``torch.load(value, weights_only=False)``, which runs whatever code a crafted pickle
      holds.

    Args:
        flatten_state_dict, flatten_sharded_tensors, allow_partial_load: as for
            ``DefaultLoadPlanner``.
        trusted: unpickle non-tensor values with ``weights_only=False`` (DCP's behaviour): only
            for checkpoints from a trusted source whose values hold other Python types.

    Raises (from ``create_local_plan``, as DCP's planner):
        RuntimeError: a key of the state dict is missing from the checkpoint (unless
            ``allow_partial_load``).
        ValueError: a tensor's size differs from the stored one, or a stored tensor is loaded
            into something that is not a tensor.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        *,
        trusted: bool = False,
    ) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors,
                         allow_partial_load=allow_partial_load)
        self.trusted = trusted

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None or not self.flatten_state_dict:
            return
        # A fresh optimizer (pyckpt.load, CheckpointManager.restore) asks only for the moments
        # the checkpoint holds (pyckpt._stateful.FreshOptimizerState).
        for key, value in self.original_state_dict.items():
            if isinstance(value, FreshOptimizerState):
                for flat in value.unheld(str(key), metadata.state_dict_metadata).values():
                    for name in flat:
                        self.state_dict.pop(name, None)

    def create_local_plan(self) -> LoadPlan:
        with _gc.paused():  # read items per tensor and stored chunk, all kept (see pyckpt._gc)
            plan = self._create_local_plan()
        held = HeldKeys(str(k) for k in getattr(self, "original_state_dict", None) or ())
        return dataclasses.replace(plan, planner_data=held)

    def _create_local_plan(self) -> LoadPlan:
        metadata = self.metadata
        if metadata is None:
            raise AssertionError("create_local_plan called before set_up_planner")
        if not _indexed(metadata):
            # Not pyckpt's Reader: DCP's planning, including its handling of checkpoints whose
            # keys were flattened by torch <= 2.3 (pyckpt writes with torch >= 2.6).
            return super().create_local_plan()
        strict = not self.allow_partial_load
        stored = metadata.state_dict_metadata
        requests: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = stored.get(fqn)
            if md is None:
                if strict:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                continue
            if isinstance(md, BytesStorageMetadata):
                if not isinstance(obj, DTensor) or obj.device_mesh.get_coordinate() is not None:
                    requests.append(_bytes_item(fqn))
                continue
            size = getattr(obj, "size", None)
            if size is not None and md.size != obj.size():
                raise ValueError(
                    f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}",
                )
            # A DTensor on a submesh this rank is not part of holds nothing here.
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            try:
                local_chunks = _local_chunks(obj)
            except ValueError as ex:
                raise ValueError(
                    f"Invalid checkpoint metadata for {fqn}, "
                    + f"expected BytesStorageMetadata but found {type(md)}",
                ) from ex
            requests += read_items_for_chunks(fqn, md, local_chunks)
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if self.trusted:
            super().load_bytes(read_item, value)
            return
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's message is a page of advice; keep its one line that names the type.
            lines = [ln.strip() for ln in str(e).splitlines() if "WeightsUnpickler" in ln]
            reason = lines[0] if lines else str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointFormatError(
                f"item {fqn!r}: refused to unpickle a non-tensor value with types outside "
                f"torch's weights-only allowlist ({reason}); load a trusted checkpoint with "
                "trusted=True (CLI: --trusted)"
            ) from None
        # Hand the (safe) object to DCP's own placement logic (flattened keys, nesting)
        # re-serialised: it is made only of allowlisted types, so unpickling it runs no code.
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        super().load_bytes(read_item, buf)


def _indexed(metadata: Metadata) -> bool:
    """Whether ``metadata`` came from :class:`pyckpt.Reader` (its tensors carry chunk
    indexes); a checkpoint without tensors plans the same either way."""
    return any(isinstance(md, IndexedTensorStorageMetadata)
               for md in metadata.state_dict_metadata.values())
