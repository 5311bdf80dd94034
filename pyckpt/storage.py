"""PyTorch Distributed Checkpoint storage layer: :class:`Writer` (and :class:`Reader`, from
:mod:`pyckpt._reader`).

``dcp.save(sd, storage_writer=pyckpt.Writer(path))`` and ``dcp.load(sd,
storage_reader=pyckpt.Reader(path))`` store tensors in independently decodable chunks
(optionally zstd-compressed with dtype-aware byte grouping), written by the native core with the
GIL released, O_DIRECT where the filesystem allows it, and temp file + fsync + rename. The
metadata (``pyckpt.json``) is plain JSON written last and atomically: a directory without it is
not a checkpoint, and a save that fails midway leaves any previous checkpoint in the same
directory loadable. Where the bytes go is the backend's business
(:func:`pyckpt.backends.open_backend`); the Writer holds backend objects only.

Thread-safety: a Writer may serve overlapping saves (e.g. successive ``dcp.async_save`` calls
still writing); their writes run one after another. A Reader serves one ``dcp.load`` at a time.
Native thread pools start lazily and stop in :meth:`close`.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from pyckpt import _C, _format, _format_shards, _gc, _knobs, _options, _ranklocal
from pyckpt._loadplan import grid_metadata
from pyckpt._native import _check_pinned_pool_bytes, _Native
from pyckpt._rankplan import _RankPlan
from pyckpt._reader import Reader
from pyckpt._staging import DeviceStaging, block_bytes_for, is_device_tensor
from pyckpt._stored_size import Encoding, WriterMeta
from pyckpt._tensors import device_bytes, dtype_name, host_bytes, local_view
from pyckpt.backends import Backend, SaveState, check_part_bytes, commit_save, open_backend

if TYPE_CHECKING:
    from pyckpt._C import CodecParams

__all__ = ["Writer", "Reader"]

logger = logging.getLogger(__name__)


@dataclass
class _Save:
    """One save's state on one rank. DCP drives a save's steps in one thread per rank, and one
    Writer may serve several saves at once (overlapping ``async_save`` calls), so this lives
    per thread, never on the Writer itself."""

    path: str
    save_id: str
    started: bool = False
    finished: bool = False  # committed: save_id stays readable until the next save starts
    is_coordinator: bool = False
    rank: int | None = None  # a rank-local save (use_collectives=False): this rank
    # The backend's state of this save (lock, the metadata it replaces), from begin_save.
    state: SaveState | None = None
    layout: Any = None  # the coordinator's, of a version-4 save (from its _RankPlan)

    def end(self) -> None:
        if self.state is not None:
            self.state.end()


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def _save_id_of(files: dict[str, int]) -> str | None:
    """The save id in the names of a save's data files (all share the coordinator's)."""
    for name in files:
        return name.rsplit(".", 2)[-2]
    return None


@dataclass(frozen=True)
class _Written:
    """One rank's part of an item: segments with data-file names, and that file's size."""

    segments: list[tuple[str, int, CodecParams, list[tuple[Any, ...]]]]
    file: str
    file_size: int


# The index of the one write result of a rank in a version-4 save.
_SHARD_RESULT = "pyckpt metadata shard"


class Writer(StorageWriter):
    """DCP ``StorageWriter`` writing pyckpt checkpoints.

    Args:
        path: checkpoint directory (created if missing) or object-store URL
            (``s3://bucket/prefix``). ``dcp.save(checkpoint_id=...)`` overrides it.
        compression: ``None`` or ``"none"`` (store raw), or ``"zstd"`` (any case).
        level: zstd level (default ``PYCKPT_ZSTD_LEVEL`` or 1).
        byte_grouping: with zstd, split elements into byte planes (and rotate bf16/fp32 so the
            exponent fills one plane); near-random planes are stored raw.
        raw_threshold: with zstd, a plane (or ungrouped chunk) is stored compressed only when
            that takes fewer than ``raw_threshold`` times its raw bytes, else raw (a raw plane
            loads as a plain copy). In (0, 1]; default 0.97. Lower values trade size for load
            speed; 1.0 keeps every saving.
        chunk_bytes: raw bytes per independently decodable chunk (default 4 MiB, or 512 KiB
            for an object-store ``path``, where a resharded load downloads whole chunks).
        threads: native worker threads (default ``PYCKPT_NUM_THREADS`` or min(8, cpus)).
        direct_io: ``"auto"``, ``"on"`` or ``"off"`` (default ``PYCKPT_DIRECT_IO`` or auto).
        fsync: fsync data and metadata (default ``PYCKPT_FSYNC`` or True).
        overwrite: like DCP's ``FileSystemWriter``: with False, a save into a directory that
            already holds a complete checkpoint raises ``FileExistsError`` before writing.
        pinned_pool_bytes: bound on the page-locked memory that streams GPU tensors to the
            encoder in a synchronous save (default ``PYCKPT_PINNED_POOL_BYTES`` or 1 GiB, read
            when the writer first stages a tensor; at least 1 MiB).
        storage_options: for an object-store ``path`` (``s3://bucket/prefix``): client settings
            overriding the ``AWS_*`` environment and ``~/.aws`` files (see docs/OBJECT_STORES.md).
        part_bytes: for an object-store ``path``: multipart part size (default 16 MiB).
        shared_filesystem: False for a node-local checkpoint: ``path`` exists on every node
            but holds only that node's data files; every rank writes a copy of ``pyckpt.json``
            into its own ``path`` once all data is durable (see :mod:`pyckpt.backends.peer` and
            docs/ARCHITECTURE.md). Load it with ``Reader(path, shared_filesystem=False)``.
        metadata_shards: metadata format of a collective save into a shared directory or an
            object store. None (default): sharded (format version 4: each rank appends the
            chunk records of what it wrote to its data file, ``pyckpt.json`` only names the
            shards and describes each tensor's split once) when several ranks save and every
            tensor's pieces form a grid, else one document (version 3). True: sharded whenever
            the pieces allow (also for one process); False: always one document. Node-local
            and rank-local saves always write one document.

    Raises:
        ValueError: an unknown compression or direct-I/O mode, ``pinned_pool_bytes`` below
            1 MiB, or ``level`` or ``raw_threshold`` out of range.

    Save semantics (what a save never does):

    * It never leaves a loadable mixture: ``pyckpt.json`` is written last, atomically, and names
      only data files of its own save (named ``<rank>-<k>.<save_id>.pyckpt``, the save id chosen
      by the coordinator), so a directory loads as the previous or the new checkpoint.
    * Two saves into one directory never both succeed: the coordinator holds an exclusive lock
      on ``.pyckpt.lock`` from set-up to finish; a second save into the same directory (another
      process, or another save of this process) fails at set-up with ``BlockingIOError``. The
      commit is also conditional on the ``pyckpt.json`` set-up saw (where flock is not
      available): a save whose place was committed by another meanwhile raises
      ``ConcurrentSaveError`` (an object store works the same way, with a conditional PUT).
    * Files of other saves are removed only by a committed save holding that lock (so the
      saves they belong to are not in progress); a save that fails in ``finish`` removes its
      own data files; failed writes leave no temp files. Once ``pyckpt.json`` is committed the
      save has succeeded: a failure to remove earlier files is a logged warning.
    * ``dcp.save(..., use_collectives=False)`` on several ranks raises ``NotImplementedError``:
      without collectives no rank learns the others' items, save id or completion, so no rank
      could commit one checkpoint naming them all, and each rank would take the others' files
      for stale ones. Save with collectives (the default); loads reshard to any world size.

    Thread-safety: one Writer may run several saves at once (overlapping ``dcp.async_save``
    calls, into different directories): each save's path, id and lock are kept per save.

    Collaborators (owned by composition, each made on first use and released by
    :meth:`close`, or ``with Writer(...) as w:``; the writer stays usable after ``close()``):
    the native worker thread pool and the GPU staging (``_native``: a
    :class:`~pyckpt._staging.DeviceStaging` with its pinned pools and per-device stagers), the
    pool of encode output blocks (``_encode_pool``) and the pool of aligned blocks between the
    encoder and the O_DIRECT writes (kept by the directory backend). The writer is picklable (DCP's
    process-based async save pickles it): pickling keeps the arguments and drops the
    collaborators.

    GPU tensors: a synchronous save streams them through pinned blocks (copies of the next
    blocks overlap the encoding and writing of the current ones; pinned memory bounded by
    ``pinned_pool_bytes``). The writer is also a DCP ``AsyncStager`` (its :meth:`stage`
    delegates to the GPU staging): ``dcp.async_save(sd, storage_writer=Writer(p))`` copies the
    state dict into a reused pinned region, returns once the copies are done, and encodes and
    writes in the background. The region goes back to the pool as soon as the save's
    ``write_data`` completed (or when nothing views it any more).

    Executors: the thread-based executor (DCP's default) is the supported one: the staged
    tensors are read in place from pinned memory. With the process-based executor DCP pickles
    the staged state dict, moving every tensor into shared memory (one more host copy, and the
    pinned region is not what the child writes from); the writer pickles without its staging
    state, so it works, but gains nothing over DCP's own stager.
    """

    # AsyncStager protocol: stage() is blocking (returns after the copies), so DCP need not call
    # synchronize_staging().
    _synchronize_after_execute: bool = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        compression: str | None = None,
        *,
        level: int | None = None,
        byte_grouping: bool = True,
        raw_threshold: float = _format.RAW_THRESHOLD,
        chunk_bytes: int | None = None,
        threads: int | None = None,
        direct_io: str | None = None,
        fsync: bool | None = None,
        overwrite: bool = True,
        pinned_pool_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
        part_bytes: int | None = None,
        shared_filesystem: bool = True,
        metadata_shards: bool | None = None,
    ) -> None:
        super().__init__()
        _check_pinned_pool_bytes(pinned_pool_bytes)
        compression = _options.compression(compression)  # any case; lists every value
        direct_io = _options.direct_io(direct_io)
        if chunk_bytes is not None and (
            chunk_bytes < 4096 or chunk_bytes % 4096 or chunk_bytes > _format.MAX_CHUNK_BYTES
        ):
            raise ValueError(
                f"chunk_bytes must be a multiple of 4096 in [4096, {_format.MAX_CHUNK_BYTES}], "
                f"got {chunk_bytes}"
            )
        self.path = os.fspath(path)
        self.compression = compression
        self.level = level
        self.byte_grouping = byte_grouping
        self.raw_threshold = raw_threshold
        self.chunk_bytes = chunk_bytes
        self.threads = threads
        self.direct_io = direct_io
        self.fsync = fsync
        self.overwrite = overwrite
        self.pinned_pool_bytes = pinned_pool_bytes
        self.shared_filesystem = bool(shared_filesystem)
        if metadata_shards not in (None, True, False):
            raise ValueError(f"metadata_shards must be None, True or False, got "
                             f"{metadata_shards!r}")
        self.metadata_shards = metadata_shards
        self.storage_options = dict(storage_options or {})
        self.part_bytes = check_part_bytes(part_bytes)
        self._backends: Any = None  # location -> Backend (clients, reused direct blocks)
        self._backend(self.path)  # a foreign URL (gs://...) or a bad combination fails here
        self._params("float32")  # a bad level or raw_threshold fails here, not mid-save
        self._native = _Native(threads, pinned_pool_bytes=pinned_pool_bytes)
        self._encode_pool: Any = None  # encoder output blocks, sized for (chunk, params)
        self._encode_pool_key: tuple[int, Any] | None = None
        self._encode_lock = threading.Lock()  # guards the shared encode and direct pools
        self._local: Any = None  # threading.local holding each thread's _Save

    # Collaborators dropped by close() and pickling (made again on first use).
    _transient = ("_encode_pool", "_encode_pool_key", "_local", "_backends")

    def close(self) -> None:
        """Stops the native worker threads and frees the encode buffers (pinned staging memory
        belongs to the process: ``pyckpt.release_pinned()``)."""
        self._native.close()
        for name in self._transient:
            setattr(self, name, None)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(dict.fromkeys(self._transient))
        state["_encode_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._encode_lock = threading.Lock()

    # -- DCP AsyncStager (delegates to the GPU staging) --------------------------------------

    @property
    def should_synchronize_after_execute(self) -> bool:
        """Whether DCP should call :meth:`synchronize_staging` after starting the save."""
        return self._synchronize_after_execute

    def stage(self, state_dict: Any) -> Any:
        """Returns a training-safe copy of ``state_dict`` in pinned host memory (once every copy
        is complete).

        Raises:
            CudaError: the CUDA runtime failed (the message names the tensor); nothing is saved.
        """
        return self._staging().stage_state_dict(state_dict)

    def synchronize_staging(self) -> None:
        """No-op: :meth:`stage` returns only after its copies completed."""

    def _staging(self) -> DeviceStaging:
        """The GPU staging; its blocks are a multiple of the chunk size, so split tensors align
        with chunks."""
        return self._native.staging(block_bytes_for(self.chunk_bytes or _knobs.chunk_bytes()))

    def _release_staged_after(
        self, fut: Future[list[WriteResult]], plan: SavePlan, planner: SavePlanner
    ) -> Future[list[WriteResult]]:
        """Frees the pinned regions this plan's tensors live in once ``fut`` (write_data's
        result) completed: the bytes are then in the file, the region may be refilled."""
        staging = self._native.made_staging()
        if staging is None or not staging.has_regions():
            return fut
        addresses = []
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor) and data.numel() > 0:
                    addresses.append(local_view(data).data_ptr())

        def release(_: Any) -> None:
            staging.release_regions(addresses)

        fut.add_done_callback(release)
        return fut

    def _backend(self, path: str) -> Backend:
        """The backend of ``path`` (made once per location and kept until :meth:`close`: its
        clients and the aligned blocks of the data-file writer are reused by every save)."""
        if self._backends is None:
            self._backends = {}
        if path not in self._backends:
            self._backends[path] = open_backend(
                path, self.storage_options, shared_filesystem=self.shared_filesystem,
                part_bytes=self.part_bytes, direct_io=self.direct_io, fsync=self.fsync,
            )
        return cast(Backend, self._backends[path])

    # -- per-save state ----------------------------------------------------------------------

    def _thread_state(self) -> Any:
        if self._local is None:
            self._local = threading.local()
        return self._local

    def _pending(self) -> _Save:
        """This thread's save that has not started yet (made on first need)."""
        tls = self._thread_state()
        save: _Save | None = getattr(tls, "save", None)
        if save is None or save.started:
            if save is not None:
                save.end()  # an earlier save of this thread that never finished (it failed)
            save = _Save(self.path, _format.new_save_id())
            tls.save = save
        return save

    def _active(self, what: str) -> _Save:
        save: _Save | None = getattr(self._thread_state(), "save", None)
        if save is None or not save.started:
            raise RuntimeError(f"pyckpt.Writer.{what} called without set_up_storage_writer")
        return save

    @property
    def save_id(self) -> str:
        """Id of this thread's save in progress, else of its last committed save (the id stored
        in that checkpoint's metadata, on every rank), else of its next save."""
        return self._current().save_id

    def _current(self) -> _Save:
        save: _Save | None = getattr(self._thread_state(), "save", None)
        return save if save is not None else self._pending()

    # -- StorageWriter ---------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            path = os.fspath(checkpoint_id)
            self._backend(path)  # a foreign URL (gs://...) fails here, before anything is saved
            self.path = path
        tls = self._thread_state()
        old: _Save | None = getattr(tls, "save", None)
        if old is not None:
            old.end()
        tls.save = _Save(self.path, _format.new_save_id())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Starts a save on this rank.

        Raises:
            ValueError: ``use_collectives=False`` with several ranks into an object store.
            FileExistsError: ``overwrite=False`` and the directory holds a complete checkpoint.
            BlockingIOError: another save into the directory is in progress.
        """
        save = self._pending()
        save.started = True
        save.is_coordinator = is_coordinator
        backend = self._backend(save.path)
        if kwargs.get("use_collectives", True) is False and _world_size() > 1:
            save.rank = _ranklocal.set_up(backend.location if backend.in_place else None,
                                          save.path, kwargs.get("rank"), self.overwrite)
        # A directory's lock, or the object-store condition (docs/OBJECT_STORES.md).
        save.state = backend.begin_save(is_coordinator, self.overwrite)

    def storage_meta(self) -> StorageMeta | None:
        """DCP's storage meta, also naming this writer's :class:`~pyckpt._stored_size.Encoding`:
        :class:`pyckpt.SavePlanner` balances replicated items by estimated stored bytes when the
        writer compresses."""
        save = self._current()
        if save.finished:
            save = self._pending()
        return WriterMeta(checkpoint_id=save.path, save_id=save.save_id, encoding=self._encoding())

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        with _gc.paused():  # a plan per rank and a cell per rank and tensor (see pyckpt._gc)
            return self._prepare_global_plan(plans)

    def _prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save = self._active("prepare_global_plan")
        layout = None
        if self._sharded_metadata(save, len(plans)):
            layout = _format_shards.Layout.of_plans(plans)
        out = []
        inline = layout.inline_by_rank() if layout is not None else {}
        for rank, plan in enumerate(plans):
            # A pyckpt.SavePlanner hands over byte ranges of split replicated items.
            ranges = getattr(plan.storage_data, "ranges", None) or {}
            rank = rank if save.rank is None else save.rank  # rank-local: this rank's one plan
            out.append(dataclasses.replace(plan, storage_data=_RankPlan(
                rank, dict(ranges), save.save_id, shards=layout is not None,
                layout=layout if rank == 0 else None, inline=inline.get(rank, frozenset()))))
        return out

    def _sharded_metadata(self, save: _Save, ranks: int) -> bool:
        """Whether this save writes format version 4 (see ``metadata_shards``)."""
        if self.metadata_shards is False or save.rank is not None:
            return False
        if self._backend(save.path).exchanges_chunks:  # node-local: one document per node
            return False
        return self.metadata_shards is True or ranks > 1

    @staticmethod
    def compact_metadata(metadata: Metadata, plans: list[SavePlan]) -> Metadata:
        """``metadata`` (of ``plans``, the final plans of :meth:`prepare_global_plan`) as a
        sharded save describes it (:func:`pyckpt._loadplan.grid_metadata`: O(tensors) bytes
        pickled); unchanged for any other save."""
        layout = getattr(plans[0].storage_data, "layout", None) if plans else None
        return metadata if layout is None else grid_metadata(
            metadata, {fqn: entry[1] for fqn, entry in layout.tensors.items()})

    def destination_key(self) -> tuple[Any, ...]:
        """What about this writer's destination a cached save plan depends on (the kind of
        place, the encoding and the metadata format, not the path: successive checkpoints of
        one job share plans). ``metadata_shards`` is part of it: the final plans carry the
        choice of format (version 4's layout), so a plan cached by a save with another setting
        would otherwise override this writer's."""
        backend = self._backend(self._current().path)
        return (type(backend).__name__, backend.in_place, self.shared_filesystem,
                self._encoding(), self.metadata_shards)

    def renew_plan(self, plan: SavePlan, save_id: str) -> SavePlan:
        """A final plan of an earlier save (from :meth:`prepare_global_plan`) for the save
        ``save_id``: the same items and byte ranges, this save's data-file names."""
        rank_plan = plan.storage_data
        if not isinstance(rank_plan, _RankPlan):
            raise RuntimeError("pyckpt.Writer.renew_plan: not a plan of prepare_global_plan")
        return dataclasses.replace(plan, storage_data=dataclasses.replace(
            rank_plan, save_id=save_id, written=[False]))

    def _encoding(self) -> Encoding:
        level = self.level if self.level is not None else _knobs.zstd_level()
        return Encoding(self.compression, level, self.byte_grouping, self.raw_threshold)

    def _params(self, dtype_name: str) -> CodecParams:
        return self._encoding().params(dtype_name)

    def _encode_blocks(self, chunk_bytes: int) -> Any:
        params = self._params("float32")
        key = (chunk_bytes, params)
        if self._encode_pool is None or self._encode_pool_key != key:
            pool = self._native.pool()
            block = _C.max_encoded_size(chunk_bytes, params)
            self._encode_pool = _C.BufferPool(block, 2 * pool.size + 2)
            self._encode_pool_key = key
        return self._encode_pool

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._active("write_data")
        try:
            # Saves overlapping through one writer share its encode and direct pools: their
            # writes run one after the other.
            with self._encode_lock:
                fut = self._write_data(plan, planner, save)
        except BaseException:
            # Failed: no finish. Other ranks may still open files in a directory this save
            # made: then end_failed_save (pyckpt's drivers), or this thread's next save, ends it.
            if save.is_coordinator and _world_size() == 1:
                save.end()
            raise
        return self._release_staged_after(fut, plan, planner)

    def end_failed_save(self) -> None:
        """Ends this thread's uncommitted save (its lock; its directory if it made it and it is
        empty): for a driver that knows no rank is still writing into it."""
        save: _Save | None = getattr(self._thread_state(), "save", None)
        if save is not None and save.started and not save.finished:
            save.end()

    def _write_data(
        self, plan: SavePlan, planner: SavePlanner, save: _Save
    ) -> Future[list[WriteResult]]:
        rank_plan = plan.storage_data
        if not isinstance(rank_plan, _RankPlan):
            raise RuntimeError("pyckpt.Writer.write_data called without prepare_global_plan")
        rank_plan.claim(save.path)
        save.save_id = rank_plan.save_id or save.save_id  # the coordinator's, on every rank
        save.layout = rank_plan.layout
        backend = self._backend(save.path)
        if not save.is_coordinator and save.rank is None:
            # a node-local rank writes its copy of the metadata after the commit
            backend.expect_metadata(rank_plan.save_id)
        fut: Future[list[WriteResult]] = Future()
        if not plan.items:
            fut.set_result([])
            return fut

        chunk_bytes = self.chunk_bytes or _knobs.chunk_bytes(backend.default_chunk_bytes)
        keepalive: list[Any] = []
        requests: list[_C.WriteItem] = []
        starts: list[int] = []
        owners: list[int] = []  # plan item of each request
        on_device: list[tuple[int, str, torch.Tensor, int, CodecParams]] = []
        # Per item: a request (and its bookkeeping), all kept until the write returns. The
        # collector is paused for this loop and for the results below, not for the write
        # itself: under dcp.async_save that runs beside training (see pyckpt._gc).
        with _gc.paused():
            for idx, item in enumerate(plan.items):
                fqn = item.index.fqn
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw = (data.getbuffer() if isinstance(data, io.BytesIO)
                           else memoryview(cast(Any, data)))
                    arr = np.frombuffer(raw, dtype=np.uint8)
                    keepalive.append(arr)
                    base, nbytes, dtype_str = arr.ctypes.data, arr.nbytes, "uint8"
                elif is_device_tensor(data) and self._staging().available:
                    data = cast(torch.Tensor, data)
                    flat = device_bytes(data, fqn)
                    start, end = rank_plan.ranges.get(item.index, (0, flat.numel()))
                    if not 0 <= start <= end <= flat.numel():
                        raise ValueError(
                            f"tensor {fqn!r}: byte range [{start}, {end}) outside {flat.numel()}"
                        )
                    params = self._params(dtype_name(data.dtype))
                    on_device.append((idx, fqn, flat[start:end], start, params))
                    continue
                else:
                    t = host_bytes(cast(torch.Tensor, data), fqn)
                    keepalive.append(t)
                    base, nbytes = t.data_ptr(), t.numel() * t.element_size()
                    dtype_str = dtype_name(t.dtype)
                start, end = rank_plan.ranges.get(item.index, (0, nbytes))
                if not 0 <= start <= end <= nbytes:
                    raise ValueError(
                        f"tensor {fqn!r}: byte range [{start}, {end}) outside {nbytes}"
                    )
                requests.append(
                    _C.WriteItem(fqn, base + start, end - start, self._params(dtype_str))
                )
                starts.append(start)
                owners.append(idx)

        name = _format.data_file_name(rank_plan.rank, 0, rank_plan.save_id or save.save_id)
        with backend.data_sink(name, {}) as fw:
            records = fw.write_items(
                requests, chunk_bytes, self._native.pool(), self._encode_blocks(chunk_bytes)
            )
            # Segments stay plain tuples of _C.Segment's layout: the write results travel
            # pickled to the coordinator, where a tuple subclass pickles many times slower.
            segments: dict[int, list[Any]] = {i: [] for i in range(len(plan.items))}
            stored_bytes = dict.fromkeys(segments, 0)
            for idx, start, req, written in zip(owners, starts, requests, records):
                segments[idx].append((name, start, req.params, written.chunks))
                stored_bytes[idx] += written.stored_bytes
            if on_device:
                self._write_device_items(fw, name, on_device, chunk_bytes, segments, stored_bytes)
            shard = None
            if rank_plan.shards:
                with _gc.paused():
                    shard = _format_shards.append_shard(fw, plan.items, rank_plan.rank,
                                                        save.save_id, segments, rank_plan.inline)
            fw.commit()
            file_size = fw.size
        del keepalive

        if shard is not None:
            fut.set_result([WriteResult(
                index=MetadataIndex(_SHARD_RESULT), size_in_bytes=sum(stored_bytes.values()),
                storage_data=_format_shards.ShardWritten(rank_plan.rank, file_size, *shard))])
            return fut
        with _gc.paused():
            results = [
                WriteResult(
                    index=item.index,
                    size_in_bytes=stored_bytes[idx],
                    storage_data=_Written(segments[idx], name, file_size),
                )
                for idx, item in enumerate(plan.items)
            ]
        fut.set_result(results)
        return fut

    def _write_device_items(
        self,
        fw: Any,
        name: str,
        items: list[tuple[int, str, torch.Tensor, int, CodecParams]],
        chunk_bytes: int,
        segments: dict[int, list[Any]],
        stored_bytes: dict[int, int],
    ) -> None:
        """Streams device byte ranges through pinned blocks into ``fw``: each batch of blocks
        is encoded and written while the next batch is still being copied. An item larger than
        a block becomes several segments (block-sized, so chunk-aligned)."""
        staging = self._staging()
        pool, blocks = self._native.pool(), self._encode_blocks(chunk_bytes)
        for batch in staging.stream_to_host([(fqn, t) for _, fqn, t, _, _ in items]):
            reqs = [_C.WriteItem(items[p.item][1], p.address, p.nbytes, items[p.item][4])
                    for p in batch]
            records = fw.write_items(reqs, chunk_bytes, pool, blocks)
            for p, req, written in zip(batch, reqs, records):
                idx, _, _, start, _ = items[p.item]
                segments[idx].append((name, start + p.offset, req.params, written.chunks))
                stored_bytes[idx] += written.stored_bytes

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commits the save (:func:`pyckpt.backends.commit_save`): writes ``pyckpt.json``
        atomically, then removes files of earlier saves. If the metadata cannot be written,
        this save's data files are removed (the previous checkpoint stays intact) and the error
        propagates; once it is written, a failed clean-up is a logged warning, not an error.

        Raises:
            ConcurrentSaveError: another save committed into the same place while this one ran.
        """
        save = self._active("finish")
        try:
            with _gc.paused():  # one piece per rank and tensor at scale (see pyckpt._gc)
                files, encoded = self._document(metadata, results, save)
            backend = self._backend(save.path)
            assert save.state is not None
            if save.rank is not None:  # this rank's part of a rank-local save
                assert backend.in_place  # checked by _ranklocal.set_up
                fsync = self.fsync if self.fsync is not None else _knobs.fsync()
                part = _ranklocal.Part(backend.location, save.rank, fsync, _world_size())
                commit_save(part, files, encoded, save.state, stale=part.is_stale)
                save.finished = True
                part.retire_collective()
                return
            commit_save(backend, files, encoded, save.state)
            save.finished = True
            # node-local: every other rank writes its copy (pyckpt.backends.peer)
            published = backend.publish(_save_id_of(files) or save.save_id, encoded, files)
            if published is not None:
                metadata.storage_data = published
        finally:
            save.end()  # a committed save stays this thread's current one (its save_id)
            tls = self._thread_state()
            if getattr(tls, "save", None) is save and not save.finished:
                tls.save = None

    def _document(
        self, metadata: Metadata, results: list[list[WriteResult]], save: _Save
    ) -> tuple[dict[str, int], bytes]:
        """The data files of this save (name -> size) and its encoded metadata file."""
        segments: dict[MetadataIndex, list[Any]] = {}
        files: dict[str, int] = {}
        if save.layout is not None:  # version 4: each rank reported its shard
            return _format_shards.global_document(
                metadata, save.layout, results, save_id=save.save_id,
                created_by=f"pyckpt {_C.__version__}",
                planner_data=_format.storable_planner_data(metadata.planner_data))
        for rank_results in results:
            for wr in rank_results:
                written: _Written = wr.storage_data
                segments.setdefault(wr.index, []).extend(written.segments)
                files[written.file] = written.file_size

        encoded = _format.build_metadata(
            metadata,
            segments,
            files,
            save_id=_save_id_of(files) or save.save_id,
            created_by=f"pyckpt {_C.__version__}",
        )
        return files, encoded

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
