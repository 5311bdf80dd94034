"""PyTorch Distributed Checkpoint storage layer: :class:`Writer` and :class:`Reader`.

``dcp.save(sd, storage_writer=pyckpt.Writer(path))`` and ``dcp.load(sd,
storage_reader=pyckpt.Reader(path))`` store tensors in independently decodable chunks
(optionally zstd-compressed with dtype-aware byte grouping), written by the native core with the
GIL released, O_DIRECT where the filesystem allows it, and temp file + fsync + rename. The
metadata (``pyckpt.json``) is plain JSON written last and atomically: a directory without it is
not a checkpoint, and a save that fails midway leaves any previous checkpoint in the same
directory loadable.

Thread-safety: a Writer may serve overlapping saves (e.g. successive ``dcp.async_save`` calls
still writing); their writes run one after another. A Reader serves one ``dcp.load`` at a time.
Native thread pools start lazily and stop in :meth:`close`.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import io
import logging
import os
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from pyckpt import _C, _format, _knobs, _objstore, _peer
from pyckpt._collective import group_info
from pyckpt._format import DTYPE_SIZES, METADATA_FILE
from pyckpt._staging import DeviceStaging, block_bytes_for, is_device_tensor
from pyckpt._tensors import local_view, resolved
from pyckpt.errors import UnsupportedDtypeError

if TYPE_CHECKING:
    from pyckpt._C import CodecParams

__all__ = ["Writer", "Reader"]

logger = logging.getLogger(__name__)

# Decoded bytes buffered at once by a resharding load (pieces read whole need no buffer).
_READ_BATCH_BYTES = 256 << 20
# Aligned blocks between encoding and O_DIRECT writes (one being filled, two in flight).
_DIRECT_BLOCK_BYTES = 8 << 20
_DIRECT_BLOCKS = 3


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _storable(tensor: torch.Tensor, fqn: str) -> torch.Tensor:
    """``tensor``'s local values (:func:`pyckpt._tensors.resolved`); refuses what cannot be
    stored.

    Raises:
        UnsupportedDtypeError: a dtype outside the format's table, or a non-strided layout.
    """
    if _dtype_name(tensor.dtype) not in DTYPE_SIZES:
        raise UnsupportedDtypeError(f"tensor {fqn!r}: dtype {tensor.dtype} cannot be stored")
    if tensor.layout != torch.strided:
        raise UnsupportedDtypeError(f"tensor {fqn!r}: layout {tensor.layout} cannot be stored")
    return resolved(tensor)


def _host_bytes(tensor: torch.Tensor, fqn: str) -> torch.Tensor:
    """Returns a CPU, contiguous, plain tensor with ``tensor``'s values."""
    t = _storable(tensor, fqn)
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def _device_bytes(tensor: torch.Tensor, fqn: str) -> torch.Tensor:
    """A device tensor's bytes as a flat uint8 tensor on the device (made contiguous there)."""
    t = _storable(tensor, fqn).contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank: its rank number, the save's id (shared by every
    rank's data files) and byte ranges of split items."""

    rank: int
    ranges: dict[MetadataIndex, tuple[int, int]]
    save_id: str = ""


# Lock file in a checkpoint directory: a save's coordinator holds an exclusive flock on it from
# set-up to finish, so two saves into one directory never interleave (the second one fails).
LOCK_FILE = ".pyckpt.lock"


class _DirLock:
    """An exclusive, non-blocking ``flock`` on ``<directory>/.pyckpt.lock``.

    Released by :meth:`release`, or when the object is garbage collected (a save whose thread
    ended without finishing), or when the process dies (the kernel drops the lock).

    Raises:
        BlockingIOError: another save (of any process, or another thread of this one) holds it;
            ``filename`` is the lock file.
        OSError: the lock file cannot be created (e.g. ``PermissionError``).
    """

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_FILE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BlockingIOError(
                errno.EWOULDBLOCK,
                f"another save into {directory!r} is in progress (it holds {LOCK_FILE})",
                self.path,
            ) from None
        except OSError as e:  # a filesystem without flock: saves are not serialised
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            logger.warning("pyckpt: cannot lock %s (%s); concurrent saves are not detected",
                           self.path, e)
            self._release = lambda: None
            return
        self._release = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        self._release()


@dataclass
class _Save:
    """One save's state on one rank. DCP drives a save's steps in one thread per rank, and one
    Writer may serve several saves at once (overlapping ``async_save`` calls), so this lives
    per thread, never on the Writer itself."""

    path: str
    save_id: str
    started: bool = False
    is_coordinator: bool = False
    lock: _DirLock | None = None
    # Object stores: the ETag of the metadata this save replaces (None: none), for the commit.
    base_etag: str | None | object = None

    def end(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def _holds(path: str, content: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read() == content
    except OSError:
        return False


def _save_id_of(files: dict[str, int]) -> str | None:
    """The save id in the names of a save's data files (all share the coordinator's)."""
    for name in files:
        return name.rsplit(".", 2)[-2]
    return None


def _check_pinned_pool_bytes(value: int | None) -> None:
    if value is not None and (type(value) is not int or value < _knobs.MIN_PINNED_POOL_BYTES):
        raise ValueError(
            f"pinned_pool_bytes must be an int >= {_knobs.MIN_PINNED_POOL_BYTES}, got {value!r}"
        )


@dataclass(frozen=True)
class _Written:
    """One rank's part of an item: segments with data-file names, and that file's size."""

    segments: list[tuple[str, int, CodecParams, list[tuple[Any, ...]]]]
    file: str
    file_size: int


class _Native:
    """The native collaborators of a Writer or Reader, each made on first use: the worker
    thread pool and the GPU staging (:class:`~pyckpt._staging.DeviceStaging`, a handle on the
    pinned memory and per-device stagers that the process owns once, :mod:`pyckpt._pinned`, so a
    new Writer per checkpoint reuses them). :meth:`close` drops both handles (the owner stays
    usable: they are made again when needed; the pinned memory is not freed); pickling keeps
    only the configuration."""

    def __init__(
        self,
        threads: int | None,
        default: Any = _knobs.num_threads,
        *,
        pinned_pool_bytes: int | None = None,
    ) -> None:
        self._threads = threads
        self._default = default
        self._pinned_pool_bytes = pinned_pool_bytes
        self._pool: Any = None
        self._staging: DeviceStaging | None = None

    def pool(self) -> Any:
        if self._pool is None:
            self._pool = _C.ThreadPool(self._threads or self._default())
        return self._pool

    def staging(self, block_bytes: int | None = None) -> DeviceStaging:
        """The GPU staging (made on first use with ``block_bytes`` blocks, default 16 MiB)."""
        if self._staging is None:
            self._staging = DeviceStaging(
                block_bytes=block_bytes, pool_bytes=self._pinned_pool_bytes
            )
        return self._staging

    def made_staging(self) -> DeviceStaging | None:
        """The GPU staging if it was made (and not closed since), else None."""
        return self._staging

    def close(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.close()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = state["_staging"] = None
        return state


class Writer(StorageWriter):
    """DCP ``StorageWriter`` writing pyckpt checkpoints.

    Args:
        path: checkpoint directory (created if missing) or object-store URL
            (``s3://bucket/prefix``). ``dcp.save(checkpoint_id=...)`` overrides it.
        compression: ``None`` (store raw) or ``"zstd"``.
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
            into its own ``path`` once all data is durable (see :mod:`pyckpt._peer` and
            docs/ARCHITECTURE.md). Load it with ``Reader(path, shared_filesystem=False)``.

    Raises:
        ValueError: an unknown compression or direct-I/O mode, ``pinned_pool_bytes`` below
            1 MiB, or ``level`` or ``raw_threshold`` out of range.

    Save semantics (what a save never does):

    * It never leaves a loadable mixture: ``pyckpt.json`` is written last, atomically, and names
      only data files of its own save (named ``<rank>-<k>.<save_id>.pyckpt``, the save id chosen
      by the coordinator), so a directory loads as the previous or the new checkpoint.
    * Two saves into one directory never interleave: the coordinator holds an exclusive lock on
      ``.pyckpt.lock`` from set-up to finish; a second save into the same directory (another
      process, or another save of this process) fails at set-up with ``BlockingIOError``.
    * Files of other saves are removed only by a committed save holding that lock (so the
      saves they belong to are not in progress); a save that fails in ``finish`` removes its
      own data files; failed writes leave no temp files.
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
    encoder and the O_DIRECT writes (``_direct_blocks``). The writer is picklable (DCP's
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
    ) -> None:
        super().__init__()
        _check_pinned_pool_bytes(pinned_pool_bytes)
        if compression not in (None, "none", "zstd"):
            raise ValueError(f"unknown compression {compression!r}; expected None or 'zstd'")
        if direct_io not in (None, "auto", "on", "off"):
            raise ValueError(f"direct_io must be 'auto', 'on' or 'off', got {direct_io!r}")
        if chunk_bytes is not None and (
            chunk_bytes < 4096 or chunk_bytes % 4096 or chunk_bytes > _format.MAX_CHUNK_BYTES
        ):
            raise ValueError(
                f"chunk_bytes must be a multiple of 4096 in [4096, {_format.MAX_CHUNK_BYTES}], "
                f"got {chunk_bytes}"
            )
        self.path = os.fspath(path)
        self.compression = None if compression == "none" else compression
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
        if _objstore.is_url(self.path) and not self.shared_filesystem:
            raise ValueError(f"{self.path}: shared_filesystem=False is for node-local directories, "
                             "not object-store URLs")
        self.storage_options = dict(storage_options or {})
        self.part_bytes = _objstore.check_part_bytes(part_bytes)
        self._objstores: Any = None  # object-store URL -> _objstore.Location (clients)
        self._params("float32")  # a bad level or raw_threshold fails here, not mid-save
        self._native = _Native(threads, pinned_pool_bytes=pinned_pool_bytes)
        self._encode_pool: Any = None  # encoder output blocks, sized for (chunk, params)
        self._encode_pool_key: tuple[int, Any] | None = None
        self._direct_blocks: Any = None  # aligned blocks of the data-file writer, reused
        self._encode_lock = threading.Lock()  # guards the shared encode and direct pools
        self._local: Any = None  # threading.local holding each thread's _Save

    # Collaborators dropped by close() and pickling (made again on first use).
    _transient = ("_encode_pool", "_encode_pool_key", "_direct_blocks", "_local", "_objstores")

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

    def _location(self, url: str) -> _objstore.Location:
        if self._objstores is None:
            self._objstores = {}
        if url not in self._objstores:
            self._objstores[url] = _objstore.location(url, self.storage_options)
        return cast(_objstore.Location, self._objstores[url])

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
        """Id of this thread's current (or next) save."""
        return self._current().save_id

    def _current(self) -> _Save:
        save: _Save | None = getattr(self._thread_state(), "save", None)
        return save if save is not None else self._pending()

    # -- StorageWriter ---------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            path = os.fspath(checkpoint_id)
            _objstore.is_url(path)  # a foreign URL (gs://...) fails here, before anything is saved
            self.path = path
        tls = self._thread_state()
        old: _Save | None = getattr(tls, "save", None)
        if old is not None:
            old.end()
        tls.save = _Save(self.path, _format.new_save_id())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Starts a save on this rank.

        Raises:
            NotImplementedError: ``use_collectives=False`` with more than one rank (see the
                class docstring).
            FileExistsError: ``overwrite=False`` and the directory holds a complete checkpoint.
            BlockingIOError: another save into the directory is in progress.
        """
        if kwargs.get("use_collectives", True) is False and _world_size() > 1:
            raise NotImplementedError(
                "pyckpt.Writer does not support dcp.save(use_collectives=False) with several "
                "ranks: without collectives no rank can commit a checkpoint naming every rank's "
                "data. Save with use_collectives=True (the default)."
            )
        save = self._pending()
        save.started = True
        save.is_coordinator = is_coordinator
        if _objstore.is_url(save.path):  # no lock: a conditional commit (docs/OBJECT_STORES.md)
            save.base_etag = _objstore.set_up_save(self._location(save.path), is_coordinator,
                                                   self.overwrite)
            return
        os.makedirs(save.path, exist_ok=True)
        if is_coordinator:
            save.lock = _DirLock(save.path)
            meta = os.path.join(save.path, METADATA_FILE)
            if not self.overwrite and os.path.exists(meta):
                save.end()
                raise FileExistsError(
                    errno.EEXIST,
                    "Checkpoint already exists and overwrite=False; pass overwrite=True or "
                    "choose another directory",
                    meta,
                )

    def storage_meta(self) -> StorageMeta | None:
        save = self._current()
        return StorageMeta(checkpoint_id=save.path, save_id=save.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save_id = self._active("prepare_global_plan").save_id
        out = []
        for rank, plan in enumerate(plans):
            # A pyckpt.SavePlanner hands over byte ranges of split replicated items.
            ranges = getattr(plan.storage_data, "ranges", None) or {}
            out.append(
                dataclasses.replace(plan, storage_data=_RankPlan(rank, dict(ranges), save_id))
            )
        return out

    def _params(self, dtype_name: str) -> CodecParams:
        level = self.level if self.level is not None else _knobs.zstd_level()
        return _format.codec_params_for(
            dtype_name, self.compression, level, self.byte_grouping, self.raw_threshold
        )

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
            if save.is_coordinator:
                save.end()  # the save failed: finish will not come; free the directory
            raise
        return self._release_staged_after(fut, plan, planner)

    def _write_data(
        self, plan: SavePlan, planner: SavePlanner, save: _Save
    ) -> Future[list[WriteResult]]:
        rank_plan = plan.storage_data
        if not isinstance(rank_plan, _RankPlan):
            raise RuntimeError("pyckpt.Writer.write_data called without prepare_global_plan")
        if not self.shared_filesystem and not save.is_coordinator:
            fsync = self.fsync if self.fsync is not None else _knobs.fsync()
            _peer.expect_metadata(rank_plan.save_id, save.path, fsync)
        fut: Future[list[WriteResult]] = Future()
        if not plan.items:
            fut.set_result([])
            return fut

        chunk_bytes = self.chunk_bytes or (
            _knobs.chunk_bytes(_objstore.DEFAULT_CHUNK_BYTES) if _objstore.is_url(save.path)
            else _knobs.chunk_bytes()
        )
        keepalive: list[Any] = []
        requests: list[tuple[str, int, int, CodecParams]] = []
        starts: list[int] = []
        owners: list[int] = []  # plan item of each request
        on_device: list[tuple[int, str, torch.Tensor, int, CodecParams]] = []
        for idx, item in enumerate(plan.items):
            fqn = item.index.fqn
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(cast(Any, data))
                arr = np.frombuffer(raw, dtype=np.uint8)
                keepalive.append(arr)
                base, nbytes, dtype_name = arr.ctypes.data, arr.nbytes, "uint8"
            elif is_device_tensor(data) and self._staging().available:
                data = cast(torch.Tensor, data)
                flat = _device_bytes(data, fqn)
                start, end = rank_plan.ranges.get(item.index, (0, flat.numel()))
                if not 0 <= start <= end <= flat.numel():
                    raise ValueError(
                        f"tensor {fqn!r}: byte range [{start}, {end}) outside {flat.numel()}"
                    )
                params = self._params(_dtype_name(data.dtype))
                on_device.append((idx, fqn, flat[start:end], start, params))
                continue
            else:
                t = _host_bytes(cast(torch.Tensor, data), fqn)
                keepalive.append(t)
                base, nbytes, dtype_name = t.data_ptr(), t.numel() * t.element_size(), _dtype_name(
                    t.dtype
                )
            start, end = rank_plan.ranges.get(item.index, (0, nbytes))
            if not 0 <= start <= end <= nbytes:
                raise ValueError(f"tensor {fqn!r}: byte range [{start}, {end}) outside {nbytes}")
            requests.append((fqn, base + start, end - start, self._params(dtype_name)))
            starts.append(start)
            owners.append(idx)

        name = _format.data_file_name(rank_plan.rank, 0, rank_plan.save_id or save.save_id)
        with self._data_writer(save, name) as fw:
            records = fw.write_items(
                requests, chunk_bytes, self._native.pool(), self._encode_blocks(chunk_bytes)
            )
            segments: dict[int, list[Any]] = {i: [] for i in range(len(plan.items))}
            stored_bytes = dict.fromkeys(segments, 0)
            for idx, start, req, (_, stored, chunks) in zip(owners, starts, requests, records):
                segments[idx].append((name, start, req[3], chunks))
                stored_bytes[idx] += stored
            if on_device:
                self._write_device_items(fw, name, on_device, chunk_bytes, segments, stored_bytes)
            fw.commit()
            file_size = fw.size
        del keepalive

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

    def _data_writer(self, save: _Save, name: str) -> Any:
        """The sink of this rank's data file: a FileWriter, or a multipart upload."""
        if _objstore.is_url(save.path):
            return _objstore.DataUpload(self._location(save.path), name, self.part_bytes,
                                        _objstore.DEFAULT_MAX_CONCURRENCY)
        direct = cast(Any, self.direct_io or _knobs.direct_io())
        fsync = self.fsync if self.fsync is not None else _knobs.fsync()
        if self._direct_blocks is None:
            # Allocated once per writer: on this class of VM freshly faulted-in memory runs at a
            # fraction of memcpy speed, so every save after the first reuses hot pages.
            self._direct_blocks = _C.BufferPool(_DIRECT_BLOCK_BYTES, _DIRECT_BLOCKS)
        return _C.FileWriter(
            os.path.join(save.path, name), direct, fsync, _DIRECT_BLOCK_BYTES, _DIRECT_BLOCKS,
            staging=self._direct_blocks,
        )

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
            reqs = [(items[p.item][1], p.address, p.nbytes, items[p.item][4]) for p in batch]
            records = fw.write_items(reqs, chunk_bytes, pool, blocks)
            for p, req, (_, stored, chunks) in zip(batch, reqs, records):
                idx, _, _, start, _ = items[p.item]
                segments[idx].append((name, start + p.offset, req[3], chunks))
                stored_bytes[idx] += stored

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commits the save: writes ``pyckpt.json`` atomically, then removes files of earlier
        saves. If the metadata cannot be written, this save's data files are removed (the
        previous checkpoint in the directory stays intact) and the error propagates."""
        save = self._active("finish")
        try:
            files, encoded = self._document(metadata, results, save)
            if _objstore.is_url(save.path):
                _objstore.commit_save(self._location(save.path), files, encoded, save.base_etag)
                return
            fsync = self.fsync if self.fsync is not None else _knobs.fsync()
            meta = os.path.join(save.path, METADATA_FILE)
            try:
                with _C.FileWriter(meta, "off", fsync) as fw:
                    fw.append(encoded)
                    fw.commit()
            except BaseException:
                if not _holds(meta, encoded):  # renamed into place before failing: committed
                    self._remove_files(save.path, files)
                raise
            self._remove_stale_files(save.path, set(files))
            if not self.shared_filesystem:  # every other rank writes its copy (see _peer)
                metadata.storage_data = _peer.PublishedMetadata(
                    _save_id_of(files) or save.save_id, encoded, sorted(files)
                )
        finally:
            save.end()
            tls = self._thread_state()
            if getattr(tls, "save", None) is save:
                tls.save = None

    def _document(
        self, metadata: Metadata, results: list[list[WriteResult]], save: _Save
    ) -> tuple[dict[str, int], bytes]:
        """The data files of this save (name -> size) and its encoded metadata file."""
        segments: dict[MetadataIndex, list[Any]] = {}
        files: dict[str, int] = {}
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

    @staticmethod
    def _remove_files(path: str, names: Any) -> None:
        for name in names:
            try:
                os.unlink(os.path.join(path, name))
            except FileNotFoundError:
                pass

    @staticmethod
    def _remove_stale_files(path: str, keep: set[str]) -> None:
        """Deletes data files of other saves into the same directory, and crashed temp files.

        Called with the directory lock held after this save committed, so every such file
        belongs to a save that is not in progress (it committed and was replaced, failed, or
        crashed)."""
        stale = [
            name for name in os.listdir(path)
            if (_format.is_data_file(name) and name not in keep) or (
                ".tmp-" in name
                and (name.startswith(METADATA_FILE) or name.split(".tmp-")[0].endswith(".pyckpt"))
            )
        ]
        Writer._remove_files(path, stale)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


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
        process_group: the group of the load for ``shared_filesystem=False`` (default: the
            default group); it must carry CPU tensors (gloo).

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
        bytes_read: stored bytes read from data files by this reader so far.
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
    ) -> None:
        super().__init__()
        _check_pinned_pool_bytes(pinned_pool_bytes)
        self.path = os.fspath(path)
        self.threads = threads
        self.pinned_pool_bytes = pinned_pool_bytes
        self.storage_options = dict(storage_options or {})
        self._fetcher: _objstore.Fetcher | None = None
        if isinstance(shared_filesystem, str) and shared_filesystem != "auto":
            raise ValueError(f"shared_filesystem must be True, False or 'auto', "
                             f"got {shared_filesystem!r}")
        self.shared_filesystem: bool | Literal["auto"] = (
            "auto" if shared_filesystem == "auto" else bool(shared_filesystem)
        )
        if _objstore.is_url(self.path) and not self.shared_filesystem:
            raise ValueError(f"{self.path}: shared_filesystem=False is for node-local directories, "
                             "not object-store URLs")
        self.process_group = process_group
        self._peer_files: _peer.PeerFiles | None = None
        self.load_id = uuid.uuid4().hex[:12]
        self.bytes_read = 0
        self.chunks_decoded = 0
        self._native = _Native(threads, _knobs.read_threads, pinned_pool_bytes=pinned_pool_bytes)
        self._storage: dict[MetadataIndex, Any] = {}
        self._metadata_error: Exception | None = None

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
        self._peer_files = None
        if checkpoint_id is not None:
            path = os.fspath(checkpoint_id)
            _objstore.is_url(path)  # a foreign URL (gs://...) fails here, naming it
            self.path = path
        self._fetcher = None

    @property
    def bytes_fetched(self) -> int:
        """Bytes downloaded from an object store by this reader so far (0 for files)."""
        return self._fetcher.bytes_fetched if self._fetcher is not None else 0

    def _object_fetcher(self) -> _objstore.Fetcher:
        if self._fetcher is None:
            self._fetcher = _objstore.Fetcher(
                _objstore.location(self.path, self.storage_options)
            )
        return self._fetcher

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Reads and validates ``pyckpt.json`` (the checkpoint is looked at here, not when the
        Reader is made, so a Reader may be created before its checkpoint exists).

        Raises:
            FileNotFoundError, CheckpointFormatError: see the class docstring.

        DCP catches a failure of this call, asks again with ``rank=`` (rank-local metadata) and
        then raises an untyped ``AssertionError``. pyckpt has no rank-local metadata, so that
        second call returns an empty placeholder and :meth:`set_up_storage_reader` raises the
        original typed error, which DCP then reports as the rank's failure (``pyckpt.load``
        re-raises it as is).
        """
        if "rank" in kwargs and self._metadata_error is not None:
            return Metadata(state_dict_metadata={})
        try:
            if _objstore.is_url(self.path):
                index = _objstore.read_index(self._object_fetcher().loc)
            elif self.shared_filesystem is True:
                index = _format.read_index(self.path)
            elif self.shared_filesystem == "auto" and not group_info(self.process_group).distributed:
                index = _format.read_index(self.path)  # one process: it must see every file
            else:  # collective: every rank reads its copy, then they agree on who holds what
                index, peers = _peer.discover(self.path, group_info(self.process_group))
                # "auto" on a directory every rank sees whole: no transfers between ranks.
                auto_shared = self.shared_filesystem == "auto" and peers.everywhere
                self._peer_files = None if auto_shared else peers
        except Exception as e:
            self._metadata_error = e
            raise
        self._metadata_error = None
        sd_md: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for fqn, st in index.tensors.items():
            memory_format = getattr(torch, st.memory_format, torch.contiguous_format)
            sd_md[fqn] = TensorStorageMetadata(
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
        self._storage = storage
        return Metadata(
            state_dict_metadata=sd_md,
            planner_data=index.planner_data,
            storage_data=storage,
            storage_meta=StorageMeta(
                checkpoint_id=self.path, save_id=index.save_id, load_id=self.load_id
            ),
            version=index.dcp_version,
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._metadata_error is not None:
            error, self._metadata_error = self._metadata_error, None
            raise error
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._peer_files is None:
            return self._read_data(plan, planner, None)
        exchange = _peer.Exchange(self._peer_files, self._native.pool())
        try:
            fut = self._read_data(plan, planner, exchange)
        except Exception as e:
            exchange.finish(e)  # tells the other ranks, then raises e
            raise
        exchange.finish()
        return fut

    def _read_data(
        self, plan: LoadPlan, planner: LoadPlanner, exchange: _peer.Exchange | None
    ) -> Future[None]:
        pool = self._native.pool()
        batch: list[tuple[Any, ...]] = []  # (request, finish callback args)
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch, batch_bytes
            if not batch:
                return
            requests = [b[0] for b in batch]
            if _objstore.is_url(self.path):
                nread, ndecoded = self._object_fetcher().read_requests(requests, pool)
            elif exchange is None:
                nread, ndecoded = _C.read_requests(requests, pool)
            else:  # one round of transfers with the other ranks (collective)
                nread, ndecoded = _peer.read_requests(exchange, requests, pool)
            self.bytes_read += nread
            self.chunks_decoded += ndecoded
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
        request = (req.storage_index.fqn, stored.segments, 0, stored.nbytes, buf.data_ptr())
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

        # Row-major strides of the stored piece and the byte span of the requested slice.
        strides = [1] * len(piece.sizes)
        for d in range(len(piece.sizes) - 2, -1, -1):
            strides[d] = strides[d + 1] * piece.sizes[d + 1]
        offs = tuple(req.storage_offsets)
        first = sum(o * s for o, s in zip(offs, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offs, lengths, strides))
        lo, hi = first * itemsize, (last + 1) * itemsize

        whole = lengths == tuple(piece.sizes)
        if (
            whole
            and target.device.type == "cpu"
            and target.dtype == dtype
            and target.is_contiguous()
            and not target.is_conj()
            and not target.is_neg()
        ):
            request = (fqn, piece.segments, 0, piece.nbytes, target.data_ptr())
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

        request = (fqn, piece.segments, lo, hi, temp.data_ptr())
        return request, finish, hi - lo

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            if _objstore.is_url(checkpoint_id):
                return True
        except ValueError:  # another scheme: not a checkpoint this reader can load
            return False
        try:
            return os.path.isfile(os.path.join(os.fspath(checkpoint_id), METADATA_FILE))
        except TypeError:
            return False
