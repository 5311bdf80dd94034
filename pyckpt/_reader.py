"""PyTorch Distributed Checkpoint storage reader: :class:`Reader` (``pyckpt.Reader``).

Each ``ReadItem`` maps to the byte span of its stored piece; the backend reads, verifies and
decodes only the chunks that overlap it (natively, GIL released). The Reader holds one backend
(:func:`pyckpt.backends.open_backend`) and never looks at the kind of place it reads from.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import uuid
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from pyckpt import _C, _format, _gc, _knobs, _partial, _ranklocal
from pyckpt._collective import coordination_info, group_info
from pyckpt._coop import (
    CoopPlan,
    LoadNode,
    assign,
    chunks_of,
    cooperative_reads,
    first_round,
    holders_of,
    pays_off,
)
from pyckpt._format import DTYPE_SIZES, METADATA_FILE
from pyckpt._loadplan import HeldKeys, grid_tensor_metadata, indexed_tensor_metadata
from pyckpt._native import _check_pinned_pool_bytes, _Native
from pyckpt._staging import DeviceStaging, is_device_tensor
from pyckpt.backends import Backend, node_local_choice, open_backend
from pyckpt.backends.base import ReadRequest
from pyckpt.errors import PartialLoadError, PartialLoadWarning, PyckptError

__all__ = ["Reader"]

logger = logging.getLogger(__name__)

# Decoded bytes buffered at once by a resharding load (pieces read whole need no buffer).
_READ_BATCH_BYTES = 256 << 20


class Reader(StorageReader):
    """DCP ``StorageReader`` for pyckpt checkpoints, including resharded loads.

    Each ``ReadItem`` is served by reading, verifying and decoding only the chunks that overlap
    the byte span of the requested slice; whole pieces decode straight into the destination.

    Args:
        path: checkpoint directory or object-store URL (``s3://bucket/prefix``);
            ``dcp.load(checkpoint_id=...)`` overrides it.
        storage_options: for an object-store ``path``: client settings overriding the
            ``AWS_*`` environment and ``~/.aws`` files (see docs/OBJECT_STORES.md).
        threads: native worker threads (default ``PYCKPT_READ_THREADS`` or
            ``max(8, PYCKPT_NUM_THREADS)``: reads in flight matter more than cores).
        pinned_pool_bytes: bound on the page-locked memory that carries data to GPU
            destinations (default ``PYCKPT_PINNED_POOL_BYTES`` or 1 GiB; at least 1 MiB).
        shared_filesystem: False for a node-local checkpoint (``Writer(...,
            shared_filesystem=False)``): each rank reads its own ``path``; chunks of files
            another rank holds are fetched from it over ``process_group`` (stored bytes,
            verified by both sides, decoded here). Every rank of the group must load.
            ``"auto"``: the ranks list the data files each sees under ``path`` and agree (one
            all-gather over ``process_group`` when the load starts): when every rank sees
            every file, the load reads as with True; otherwise as with False. A single process
            reads as with True.
        process_group: the group of the load (default: the default group); node-local and
            cooperative loads exchange over :func:`pyckpt.coordination_group` of it (gloo,
            the same ranks), so an NCCL group works too.
        cooperative: True: stored bytes that several ranks load (DDP, FSDP ``NO_SHARD``, HSDP
            replicas, ``Replicate()`` DTensors, any overlap) are read from storage by one rank,
            verified there and sent to the others over ``process_group`` still compressed;
            readers are balanced by bytes (docs/REPLICATED.md). False: every rank reads all it
            loads itself. None (default, unless ``PYCKPT_COOPERATIVE`` is 1 or 0): decided per
            load, the same for every rank: cooperative for an object store, a node-local
            checkpoint, or a file system when ranks on different nodes (``GROUP_RANK`` under
            torchrun, else the host name) load the same stored bytes; not when every rank is on
            one node and reads a file system (its page cache already reads each byte from
            storage about once; exchanging costs more there). Applies to ``dcp.load`` with
            several ranks; a single process, or ``use_collectives=False``, reads alone.
        allow_partial: what a load does when it would leave stored entries unloaded under a
            key the state dict holds (a fresh optimizer's empty ``state``, see
            :mod:`pyckpt._partial`): None (default) warns (:class:`pyckpt.PartialLoadWarning`,
            naming the keys and the fix) and loads what was asked; False raises
            :class:`pyckpt.PartialLoadError` on every rank before loading anything
            (:func:`pyckpt.load` and ``CheckpointManager.restore`` use False); True loads what
            was asked, silently. Checked once per load, on the coordinator, over every rank's
            plan.

    Raises (from :meth:`read_metadata`, i.e. when a load starts; making a Reader reads nothing):
        FileNotFoundError: ``path`` has no ``pyckpt.json`` (not a complete checkpoint) or a data
            file it lists is missing; ``filename`` names the file.
        CheckpointFormatError: the metadata is malformed, of an unknown version, or a data file
            is shorter than recorded.

    Corruption inside data files (``ChecksumError``) is found while loading; DCP then raises a
    ``CheckpointException`` whose ``failures`` hold the typed error (``pyckpt.load`` re-raises
    it directly).

    GPU destinations are filled through pinned blocks by the C++ stager (side stream, ordered
    after and before the destination device's current stream by events).

    Collaborators (owned by composition, made on first use, released by :meth:`close` or
    ``with Reader(...) as r:``, dropped by pickling): the native worker thread pool and the GPU
    staging (``_native``).

    Attributes:
        bytes_read: stored bytes read from storage (files or objects) by this reader so far,
            including what it read for other ranks of a cooperative load.
        chunks_decoded: chunks read, verified and decoded so far.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        threads: int | None = None,
        pinned_pool_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
        shared_filesystem: bool | Literal["auto"] = True,
        process_group: Any = None,
        cooperative: bool | None = None,
        allow_partial: bool | None = None,
    ) -> None:
        super().__init__()
        _check_pinned_pool_bytes(pinned_pool_bytes)
        self.path = os.fspath(path)
        self.threads = threads
        self.pinned_pool_bytes = pinned_pool_bytes
        self.storage_options = dict(storage_options or {})
        self.shared_filesystem: bool | Literal["auto"] = node_local_choice(shared_filesystem)
        self.process_group = process_group
        self.cooperative: bool | None = (
            _knobs.cooperative() if cooperative is None else bool(cooperative))
        self._backend = self._open(self.path)  # a foreign URL (gs://...) fails here
        self.load_id = uuid.uuid4().hex[:12]
        self.bytes_read = 0
        self.chunks_decoded = 0
        self._native = _Native(threads, _knobs.read_threads, pinned_pool_bytes=pinned_pool_bytes)
        self._storage: dict[MetadataIndex, Any] = {}
        self._metadata_error: Exception | None = None
        self._rank_local: int | None = None  # loading this rank's part of a rank-local save
        self.allow_partial = allow_partial
        self._stored_keys: list[str] = []  # keys a load may read (for the partial-load check)
        self._save_id: str | None = None  # of the checkpoint whose metadata was read last

    def close(self) -> None:
        """Stops the native worker threads (pinned staging memory belongs to the process:
        ``pyckpt.release_pinned()``)."""
        self._native.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _staging(self) -> DeviceStaging:
        return self._native.staging()

    # -- StorageReader ---------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.load_id = uuid.uuid4().hex[:12]
        self._storage = {}
        self._metadata_error = None
        self._rank_local = None
        path = self.path if checkpoint_id is None else os.fspath(checkpoint_id)
        self._backend = self._open(path)  # a foreign URL (gs://...) fails here, naming it
        self.path = path

    def _open(self, path: str) -> Backend:
        return open_backend(path, self.storage_options, shared_filesystem=self.shared_filesystem,
                            process_group=self.process_group)

    @property
    def backend(self) -> Backend:
        """Where the checkpoint is read from (made from ``path`` by
        :func:`pyckpt.backends.open_backend`)."""
        return self._backend

    @property
    def bytes_from_peers(self) -> int:
        """Stored bytes of a node-local checkpoint received from other ranks by this reader so
        far (0 for a shared directory or an object store)."""
        return int(self._backend.bytes_from_peers)

    @property
    def bytes_fetched(self) -> int:
        """Bytes downloaded from an object store by this reader so far (0 for files)."""
        return int(self._backend.bytes_fetched)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Reads and validates ``pyckpt.json`` (the checkpoint is looked at here, not when the
        Reader is made, so a Reader may be created before its checkpoint exists).

        Raises:
            FileNotFoundError, CheckpointFormatError: see the class docstring.

        DCP catches a failure of this call and asks again with ``rank=`` (rank-local metadata).
        When ``pyckpt.json`` is absent and the directory holds rank-local metadata
        (``dcp.save(..., use_collectives=False)``, :mod:`pyckpt._ranklocal`), that call returns
        this rank's part and DCP loads it without collectives. Otherwise it returns an empty
        placeholder and :meth:`set_up_storage_reader` raises the typed error (the original
        one, or the rank-local file's), which DCP then reports as the rank's failure
        (``pyckpt.load`` re-raises it as is) instead of its untyped ``AssertionError``.
        """
        with _gc.paused():  # one piece per rank and tensor at scale (see pyckpt._gc)
            return self._read_metadata(*args, **kwargs)

    def _read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank_local = None
        self._rank_local = None
        if "rank" in kwargs and self._metadata_error is not None:
            try:  # a rank-local checkpoint (dcp.save(use_collectives=False)): this rank's part
                backend = self._backend
                rank_local = _ranklocal.fallback(backend.location if backend.in_place else None,
                                                 kwargs["rank"], self._metadata_error)
            except Exception as e:
                self._metadata_error = e  # raised, typed, by set_up_storage_reader
            if rank_local is None:
                return Metadata(state_dict_metadata={})
        try:
            if rank_local is not None:
                index = rank_local
                self._rank_local = kwargs["rank"]
            else:
                # Node-local: collective (every rank reads its copy, then they agree on who
                # holds what; see pyckpt.backends.peer).
                index = self._backend.read_index(lazy=True)
        except Exception as e:
            self._metadata_error = e
            raise
        self._metadata_error = None
        if index.sharded is not None:
            return self._sharded_metadata(index)
        sd_md: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for fqn, st in index.tensors.items():
            memory_format = getattr(torch, st.memory_format, torch.contiguous_format)
            # With the index of its stored chunks, for pyckpt.LoadPlanner (pyckpt._loadplan).
            sd_md[fqn] = indexed_tensor_metadata(
                properties=TensorProperties(
                    dtype=getattr(torch, st.dtype),
                    requires_grad=st.requires_grad,
                    memory_format=memory_format,
                ),
                size=torch.Size(st.shape),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes))
                    for p in st.pieces
                ],
            )
            for i, p in enumerate(st.pieces):
                storage[MetadataIndex(fqn, p.offsets, i)] = (st, p)
        for fqn, sb in index.bytes_items.items():
            sd_md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = sb
        return self._metadata(index, sd_md, storage, [
            fqn for fqn, st in index.tensors.items() if all(n > 0 for n in st.shape)
        ] + list(index.bytes_items))

    def _metadata(self, index: _format.CheckpointIndex, sd_md: dict[str, Any], storage: Any,
                  stored_keys: list[str]) -> Metadata:
        """DCP's metadata of ``index``; keeps what reads and the partial-load check need."""
        self._storage = storage
        self._save_id = index.save_id
        self._stored_keys = stored_keys
        return Metadata(
            state_dict_metadata=sd_md,
            planner_data=index.planner_data,
            storage_data=storage,
            storage_meta=StorageMeta(
                checkpoint_id=self.path, save_id=index.save_id, load_id=self.load_id
            ),
            version=index.dcp_version,
        )

    def _sharded_metadata(self, index: _format.CheckpointIndex) -> Metadata:
        """DCP's metadata of a version-4 checkpoint from its global document alone: chunks made
        from each tensor's grid on access; the shards holding what this rank loads are read
        by :meth:`prepare_local_plan` (:class:`_ShardStorage`)."""
        g = index.sharded.g
        sd_md: dict[str, Any] = {}
        for fqn, t in g.tensors.items():
            sd_md[fqn] = grid_tensor_metadata(TensorProperties(
                dtype=getattr(torch, t.dtype), requires_grad=t.requires_grad,
                memory_format=getattr(torch, t.memory_format, torch.contiguous_format)), t.grid)
        for fqn in g.bytes_items:
            sd_md[fqn] = BytesStorageMetadata()
        return self._metadata(index, sd_md, _ShardStorage(index.sharded), [
            fqn for fqn, t in g.tensors.items() if all(n > 0 for n in t.shape)
        ] + list(g.bytes_items))

    def _read_shards(self, plans: list[LoadPlan]) -> None:
        """Of a version-4 checkpoint: reads the shards holding what ``plans`` read."""
        if isinstance(self._storage, _ShardStorage):
            self._storage.load([item.storage_index for p in plans for item in p.items])

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._metadata_error is not None:
            error, self._metadata_error = self._metadata_error, None
            raise error
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Names the checkpoint this rank loads (its save id) and, with ``cooperative=None``,
        its node (:func:`pyckpt._knobs.node_id`) in the plan's ``storage_data`` for
        :meth:`prepare_global_plan` (no collective of its own)."""
        self._read_shards([plan])  # a damaged shard fails here, before any byte is loaded
        node = _knobs.node_id() if self.cooperative is None else None
        return dataclasses.replace(plan, storage_data=LoadNode(node, self._save_id, self.path))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """A cooperative load (several ranks, ``cooperative`` True, or None and
        :func:`pyckpt._coop.pays_off`): chooses the one reader of each stored chunk that
        several ranks want (:func:`pyckpt._coop.assign`) and hands each rank its part
        in ``LoadPlan.storage_data`` (None on every rank when the load is not cooperative)."""
        self._check_partial(plans)
        named = [p.storage_data if isinstance(p.storage_data, LoadNode) else None
                 for p in plans]
        nodes = [n.node if n is not None else None for n in named]
        plans = [dataclasses.replace(p, storage_data=None)
                 if isinstance(p.storage_data, LoadNode) else p for p in plans]
        if self.cooperative is False or len(plans) < 2 or self._rank_local is not None:
            return plans  # a rank-local checkpoint: each rank knows and reads only its own part
        if group_info(self.process_group).world != len(plans):
            return plans  # DCP's group is not this reader's: no exchange over it
        _one_checkpoint(named)
        wants: list[dict[Any, int]] | None = None

        def wanted() -> list[dict[Any, int]]:
            nonlocal wants
            if wants is None:
                wants = self._wants(plans)
            return wants

        if self.cooperative is None:
            on, why = pays_off(self._backend, nodes, wanted)
            logger.debug("%s: %s load of %d ranks (%s)", self.path,
                         "cooperative" if on else "independent", len(plans), why)
            if not on:
                return plans
        coop = assign(wanted(), holders_of(self._backend), _knobs.coop_window_bytes())
        if coop is None:
            return plans
        return [dataclasses.replace(p, storage_data=c) for p, c in zip(plans, coop)]

    def _check_partial(self, plans: list[LoadPlan]) -> None:
        """Warns or raises (``allow_partial``) when the ranks' plans leave stored entries
        behind under keys their state dicts hold (:func:`pyckpt._partial.left_behind`)."""
        if self.allow_partial or self._rank_local is not None:
            return  # a rank-local part names only this rank's items
        requested = {item.dest_index.fqn for p in plans for item in p.items}
        # pyckpt.LoadPlanner names each rank's top-level keys (DCP's planner does not)
        top = {k for p in plans if isinstance(p.planner_data, HeldKeys) for k in p.planner_data}
        groups = _partial.left_behind(self._stored_keys, requested, top)
        if not groups:
            return
        if self.allow_partial is False:
            raise PartialLoadError(_partial.message(self.path, groups, raising=True),
                                   self.path, groups)
        warnings.warn(PartialLoadWarning(_partial.message(self.path, groups, raising=False)),
                      stacklevel=2)

    def _wants(self, plans: list[LoadPlan]) -> list[dict[Any, int]]:
        """Per rank, the stored chunks it reads -> their stored bytes (:func:`chunks_of`).

        Of a version-4 checkpoint in a shared place, the coordinator reads only the shards of
        the cells several ranks read (a sharded load at the world size it was saved with reads
        none): a cell one rank reads is never exchanged, and stands as one key of its own
        weighing the raw bytes read (a little more than it stores, when compressed)."""
        storage = self._storage
        if not isinstance(storage, _ShardStorage) or holders_of(self._backend) is not None:
            self._read_shards(plans)  # node-local: who holds a file matters for every chunk
            return [chunks_of([self._span(item) for item in p.items]) for p in plans]
        g = storage.sharded.g
        cells: list[list[int | None]] = []  # per rank and item: its cell (None: not sharded)
        readers: dict[tuple[str, int], set[int]] = {}
        for rank, p in enumerate(plans):
            mine: list[int | None] = []
            for item in p.items:
                index = item.storage_index
                cell = None if index.fqn in g.inline else storage._cell(index)
                mine.append(cell)
                if cell is not None:
                    readers.setdefault((index.fqn, cell), set()).add(rank)
            cells.append(mine)
        shared = {key for key, ranks in readers.items() if len(ranks) > 1}
        storage.load([item.storage_index for p, mine in zip(plans, cells)
                      for item, cell in zip(p.items, mine) if (item.storage_index.fqn, cell)
                      in shared])
        out = []
        for p, mine in zip(plans, cells):
            spans: list[tuple[Any, int, int]] = []
            alone: dict[Any, int] = {}
            for item, cell in zip(p.items, mine):
                fqn = item.storage_index.fqn
                if cell is None or (fqn, cell) in shared:
                    spans.append(self._span(item))
                    continue
                key = ("\0" + fqn, cell)  # no data file's name begins with a NUL
                size = math.prod(item.lengths) * DTYPE_SIZES[g.tensors[fqn].dtype]
                alone[key] = alone.get(key, 0) + size
            out.append(chunks_of(spans) | alone)
        return out

    def _span(self, req: ReadItem) -> tuple[Any, int, int]:
        """``(segments, lo, hi)``: the stored raw bytes ``req`` reads."""
        stored = self._storage.get(req.storage_index)
        if stored is None:
            raise KeyError(f"{self.path}: no stored data for {req.storage_index}")
        if req.type == LoadItemType.BYTE_IO:
            return stored.segments, 0, stored.nbytes
        st, piece = stored
        lo, hi = _slice_span(piece.sizes, req.storage_offsets, req.lengths, DTYPE_SIZES[st.dtype])
        return piece.segments, lo, hi

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with _gc.paused():  # a request and a destination per read item (see pyckpt._gc)
            return self._read_plan(plan, planner)

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._read_shards([plan])  # read in prepare_local_plan, unless DCP skipped it
        pool = self._native.pool()
        if self._rank_local is not None:
            _ranklocal.check_coverage(plan, planner, self.path, self._rank_local)
            # this rank's own files, read directly (no rounds: DCP runs no collectives here)
            return self._read_data(
                plan, planner, lambda requests: self._backend.read_requests(requests, pool))
        coop = plan.storage_data
        if isinstance(coop, CoopPlan):
            # Collective: each call of `read` runs exchange rounds with the other ranks; items
            # are read in the order of the rounds that carry their chunks.
            spans = [self._span(item) for item in plan.items]
            names = [item.storage_index.fqn for item in plan.items]  # as spans (error messages)
            order = sorted(range(len(spans)), key=lambda i: first_round(spans[i], coop))
            plan = dataclasses.replace(plan, items=[plan.items[i] for i in order])
            group = coordination_info(self.process_group)  # gloo, even for an NCCL group
            with cooperative_reads(self._backend, coop, group, pool, spans,
                                   names) as session:
                result = self._read_data(plan, planner, session)
            self.bytes_read += session.exchange.bytes_read
            return result
        # One read session of the backend: for a node-local checkpoint each call of `read` is
        # one exchange round with the other ranks, and an error here is told to them.
        with self._backend.reads(pool) as read:
            return self._read_data(plan, planner, read)

    def _read_data(
        self, plan: LoadPlan, planner: LoadPlanner,
        read: Callable[[list[ReadRequest]], _C.ReadStats],
    ) -> Future[None]:
        batch: list[tuple[ReadRequest, Any]] = []  # (request, finish callback)
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch, batch_bytes
            if not batch:
                return
            stats = read([b[0] for b in batch])
            self.bytes_read += stats.bytes_read
            self.chunks_decoded += stats.chunks
            for _, finish in batch:
                finish()
            batch, batch_bytes = [], 0

        for req in plan.items:
            stored = self._storage.get(req.storage_index)
            if stored is None:
                raise KeyError(f"{self.path}: no stored data for {req.storage_index}")
            if req.type == LoadItemType.BYTE_IO:
                request, finish, temp = self._bytes_request(req, stored, planner)
            else:
                request, finish, temp = self._tensor_request(req, stored, planner)
            if request is None:
                finish()
                continue
            if batch_bytes + temp > _READ_BATCH_BYTES:
                flush()
            batch.append((request, finish))
            batch_bytes += temp
        flush()

        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _bytes_request(
        self, req: ReadItem, stored: _format.StoredBytes, planner: LoadPlanner
    ) -> tuple[Any, Any, int]:
        buf = torch.empty(stored.nbytes, dtype=torch.uint8)

        def finish() -> None:
            planner.load_bytes(req, io.BytesIO(buf.numpy().tobytes()))

        if stored.nbytes == 0:
            return None, finish, 0
        request = ReadRequest(req.storage_index.fqn, stored.segments, 0, stored.nbytes,
                              buf.data_ptr())
        return request, finish, stored.nbytes

    def _tensor_request(
        self,
        req: ReadItem,
        stored: tuple[_format.StoredTensor, _format.StoredPiece],
        planner: LoadPlanner,
    ) -> tuple[Any, Any, int]:
        st, piece = stored
        fqn = req.storage_index.fqn
        dtype = getattr(torch, st.dtype)
        itemsize = DTYPE_SIZES[st.dtype]
        target = planner.resolve_tensor(req).detach()
        lengths = tuple(req.lengths)
        if tuple(target.shape) != lengths:
            raise ValueError(
                f"tensor {fqn!r}: destination shape {tuple(target.shape)} does not match the "
                f"requested slice {lengths}"
            )

        def commit() -> None:
            planner.commit_tensor(req, target)

        if any(n == 0 for n in lengths):
            return None, commit, 0

        strides = _strides(piece.sizes)
        lo, hi = _slice_span(piece.sizes, req.storage_offsets, lengths, itemsize)

        whole = lengths == tuple(piece.sizes)
        if (
            whole
            and target.device.type == "cpu"
            and target.dtype == dtype
            and target.is_contiguous()
            and not target.is_conj()
            and not target.is_neg()
        ):
            request = ReadRequest(fqn, piece.segments, 0, piece.nbytes, target.data_ptr())
            return request, commit, 0

        temp = torch.empty(hi - lo, dtype=torch.uint8)

        def finish() -> None:
            src = temp.view(dtype).as_strided(lengths, strides)
            if is_device_tensor(target) and self._staging().available:
                if src.dtype != target.dtype:
                    src = src.to(target.dtype)
                self._staging().upload_from_host(fqn, target, src)
            else:
                target.copy_(src)
            commit()

        request = ReadRequest(fqn, piece.segments, lo, hi, temp.data_ptr())
        return request, finish, hi - lo

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            backend = open_backend(checkpoint_id)
        except (ValueError, TypeError):  # another scheme: not a checkpoint this reader loads
            return False
        # a store is looked at when the load starts; a directory must hold the metadata now
        return not backend.in_place or os.path.isfile(backend.url_of(METADATA_FILE))


class _ShardStorage:
    """``Metadata.storage_data`` of a version-4 checkpoint: ``MetadataIndex`` -> what
    :class:`Reader` reads for it (``(StoredTensor, StoredPiece)`` or ``StoredBytes``),
    assembled from the shards read so far (:class:`pyckpt._format_shards.ShardedIndex`)."""

    def __init__(self, sharded: Any) -> None:
        self.sharded = sharded
        self._tensors: dict[str, _format.StoredTensor] = {}

    def _cell(self, index: MetadataIndex) -> int | None:
        t = self.sharded.g.tensors.get(index.fqn)
        if t is None or index.offset is None:
            return None
        if index.index is not None and 0 <= index.index < t.grid.ncells and \
                t.grid.cell(index.index)[0] == tuple(index.offset):
            return int(index.index)
        return t.grid.number(index.offset)

    def load(self, indexes: list[MetadataIndex]) -> None:
        keys = []
        for index in indexes:
            if index.fqn in self.sharded.g.bytes_items:
                keys.append((index.fqn, 0))
            elif (cell := self._cell(index)) is not None:
                keys.append((index.fqn, cell))
        self.sharded.load_cells(keys)

    def get(self, index: MetadataIndex, default: Any = None) -> Any:
        fqn = index.fqn
        if fqn in self.sharded.g.bytes_items:
            return self.sharded.bytes_item(fqn)
        cell = self._cell(index)
        if cell is None:
            return default
        st = self._tensors.get(fqn)
        if st is None:
            st = self._tensors[fqn] = self.sharded.tensor(fqn)
        return st, self.sharded.piece(fqn, cell)


def _one_checkpoint(named: list[LoadNode | None]) -> None:
    """Refuses a cooperative load whose ranks load different checkpoints (a rank restarted from
    another step): its chunks would be planned against one rank's metadata."""
    ids = {n.save_id for n in named if n is not None}
    if len(ids) > 1:
        loads = "; ".join(f"rank {r}: {n.path} (save {n.save_id})"
                          for r, n in enumerate(named) if n is not None)
        raise PyckptError(f"pyckpt: the ranks of one load read different checkpoints ({loads}); "
                          "every rank must load the same one")


def _strides(sizes: Any) -> list[int]:
    """Row-major strides (in elements) of a stored piece of shape ``sizes``."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return strides


def _slice_span(sizes: Any, offsets: Any, lengths: Any, itemsize: int) -> tuple[int, int]:
    """The raw byte span ``[lo, hi)`` of the slice ``offsets`` + ``lengths`` of a stored piece."""
    strides = _strides(sizes)
    lengths = tuple(lengths)
    if any(n == 0 for n in lengths):
        return 0, 0
    first = sum(o * s for o, s in zip(tuple(offsets), strides))
    last = sum((o + n - 1) * s for o, n, s in zip(tuple(offsets), lengths, strides))
    return first * itemsize, (last + 1) * itemsize
