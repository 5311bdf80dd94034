"""The POSIX backend: a checkpoint directory on a local or shared filesystem.

Data files are written by the native ``FileWriter`` (O_DIRECT where the filesystem allows it,
temp file + fsync + rename); ``pyckpt.json`` is written last the same way. Reads are native
parallel ``pread``s (``_C.read_requests``).

Two saves into one directory: the coordinator holds an exclusive ``flock`` on
``.pyckpt.lock`` from set-up to commit (a second save fails at set-up with
``BlockingIOError``), and the commit is conditional besides: set-up records which metadata the
save replaces, and a commit that finds another save's metadata in its place (a filesystem
without ``flock``, or a lock file removed under a running save) raises
:class:`~pyckpt.errors.ConcurrentSaveError` instead of reporting success.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import hashlib
import logging
import os
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

from pyckpt import _C, _format, _knobs, _paths, _ranklocal
from pyckpt._format import METADATA_FILE
from pyckpt._paths import LOCK_FILE, copy_atomic, fsync_dir, temp_name, write_atomic
from pyckpt.backends.base import (
    ANY,
    ReadRequest,
    SaveState,
    WholePlace,
    check_name,
    delete_checkpoint,
    direct_reads,
)
from pyckpt.errors import ConcurrentSaveError

__all__ = ["LOCK_FILE", "PosixBackend", "copy_atomic", "fsync_dir", "temp_name", "write_atomic"]

logger = logging.getLogger("pyckpt.backends")

# Lock file in a checkpoint directory: a save's coordinator holds an exclusive flock on it from
# set-up to finish, so two saves into one directory never interleave (the second one fails).
# Aligned blocks between encoding and O_DIRECT writes (one being filled, two in flight).
DIRECT_BLOCK_BYTES = 8 << 20
DIRECT_BLOCKS = 3


#: The locks this process holds (lock file path -> count), to tell its own leftovers.
_held: dict[str, int] = {}


def _unhold(key: str, fd: int) -> None:
    os.close(fd)
    left = _held.pop(key, 1) - 1
    if left > 0:
        _held[key] = left


class _DirLock:
    """An exclusive, non-blocking ``flock`` on ``<directory>/.pyckpt.lock``.

    Released by :meth:`release`, or when the object is garbage collected (a save whose thread
    ended without finishing), or when the process dies (the kernel drops the lock). A lock
    this process holds is first looked for among its garbage (a failed ``dcp.save`` leaves its
    writer in a reference cycle of DCP's error): only a lock still in use refuses.

    Raises:
        BlockingIOError: another save (of any process, or another thread of this one) holds it;
            ``filename`` is the lock file.
        OSError: the lock file cannot be created (e.g. ``PermissionError``).
    """

    def __init__(self, directory: str, created_dir: bool = False) -> None:
        self.path = os.path.join(directory, LOCK_FILE)
        self.created_dir = created_dir  # by this save: removed again if it stays unused
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not _held.get(os.path.realpath(self.path)):
                    raise
                gc.collect()  # a lock of this process's garbage is released here
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BlockingIOError(
                errno.EWOULDBLOCK,
                f"another save into {directory!r} is in progress (it holds {LOCK_FILE})",
                self.path,
            ) from None
        except OSError as e:  # a filesystem without flock: the conditional commit remains
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            logger.warning("pyckpt: cannot lock %s (%s); a concurrent save is detected only "
                           "when it commits", self.path, e)
            self._release = lambda: None
            self.held = False
            return
        key = os.path.realpath(self.path)
        _held[key] = _held.get(key, 0) + 1
        self._release = weakref.finalize(self, _unhold, key, fd)
        self.held = True

    def release(self) -> None:
        if self.held and self.created_dir:
            self._remove_if_unused()
        self._release()

    def _remove_if_unused(self) -> None:
        """A save that created the directory and ended without committing anything into it
        (refused, say, for a tensor it cannot store) leaves no directory holding only the lock
        file. Done while the lock is still held; a directory with any other entry stays."""
        directory = os.path.dirname(self.path)
        try:
            if os.listdir(directory) == [LOCK_FILE]:
                os.unlink(self.path)
                os.rmdir(directory)
        except OSError:  # another process put something there meanwhile: it stays
            pass


class _DataFile(_C.FileWriter):
    """A data file's native writer whose commit reports a vanished temp file as what it is.

    Where flock is unavailable, two overlapping saves into one directory are told apart only at
    commit: the one that commits first removes the files no committed checkpoint names, the
    other's temp file among them, and the other's rename of it then finds nothing (ENOENT).
    That save must fail, and it does; the error says why (:class:`ConcurrentSaveError`), not
    a bare ``FileNotFoundError`` from ``rename``.
    """

    def commit(self) -> None:
        try:
            super().commit()
        except FileNotFoundError as e:
            raise ConcurrentSaveError(
                errno.ENOENT,
                "this save's temporary data file vanished before its commit: another save "
                "into this directory committed meanwhile and removed it (saves into one "
                "directory must not overlap), or something else deleted it; this save is "
                "abandoned",
                e.filename or "",
            ) from e


# Where flock is unavailable: a file created exclusively (O_EXCL, atomic on local filesystems
# and NFS) around the check and the rename of a commit; one older than this is a crash's.
COMMIT_MUTEX = ".pyckpt.commit"
_STALE_MUTEX_S = 60.0


@contextlib.contextmanager
def _commit_mutex(directory: str, meta: str) -> Iterator[None]:
    """Holds ``<directory>/.pyckpt.commit`` for the duration (a commit's check and rename).

    Raises:
        ConcurrentSaveError: another save is committing into the directory right now.
    """
    path = os.path.join(directory, COMMIT_MUTEX)
    for attempt in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            break
        except FileExistsError:
            try:
                age = time.time() - os.stat(path).st_mtime
            except FileNotFoundError:
                continue
            if attempt == 0 and age > _STALE_MUTEX_S:  # left by a crash mid-commit
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            raise ConcurrentSaveError(
                errno.EBUSY, "another save is committing a checkpoint into this directory; "
                "this save is abandoned and the other checkpoint left intact", meta,
            ) from None
    else:
        raise ConcurrentSaveError(errno.EBUSY, "another save is committing a checkpoint into "
                                  "this directory", meta)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _digest(path: str) -> str | None:
    """Identity of the metadata file at ``path`` (a hash of its bytes; they hold the save id),
    or None when there is none."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


class PosixBackend(WholePlace):
    """A checkpoint directory (:class:`~pyckpt.backends.base.Backend`).

    Args:
        path: the directory (created by the first save).
        direct_io: ``"auto"``, ``"on"`` or ``"off"`` for data files (None: ``PYCKPT_DIRECT_IO``).
        fsync: fsync data and metadata (None: ``PYCKPT_FSYNC``).
    """

    default_chunk_bytes = 4 << 20
    in_place = True
    exchanges_chunks = False  # a node-local directory is wrapped by the peer backend
    shares_page_cache = True
    collective_loads = False
    bytes_fetched = 0
    bytes_from_peers = 0

    def __init__(self, path: str, *, direct_io: str | None = None, fsync: bool | None = None,
                 ) -> None:
        self.path = self.location = path
        self.direct_io = direct_io
        self.fsync = fsync
        self._direct_blocks: Any = None  # aligned blocks of the data-file writer, reused

    def __repr__(self) -> str:
        return f"PosixBackend({self.path!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_direct_blocks"] = None
        return state

    def _fsync(self) -> bool:
        return self.fsync if self.fsync is not None else _knobs.fsync()

    # -- save ------------------------------------------------------------------------------

    def begin_save(self, is_coordinator: bool, overwrite: bool) -> SaveState:
        """Creates the directory; on the coordinator takes the lock and records the metadata
        the save replaces.

        Raises:
            BlockingIOError: another save into the directory is in progress.
            FileExistsError: ``overwrite=False`` and the directory holds a complete checkpoint.
        """
        created = not os.path.isdir(self.path)
        _paths.make_dir(self.path)  # names a regular file in the way
        state = SaveState(is_coordinator)
        if not is_coordinator:
            return state
        state.lock = _DirLock(self.path, created_dir=created)
        meta = os.path.join(self.path, METADATA_FILE)
        try:
            state.base = _digest(meta)
        except OSError:
            state.base = ANY
        if not state.lock.held:  # no flock: the clean-up removes only what is there now
            state.present = frozenset(self.list_names())
        if not overwrite and state.base is not None:
            state.end()
            raise FileExistsError(
                errno.EEXIST,
                "Checkpoint already exists and overwrite=False; pass overwrite=True or "
                "choose another directory",
                meta,
            )
        return state

    def data_sink(self, name: str, options: Mapping[str, Any]) -> Any:
        """A native ``FileWriter`` of ``name`` (temp file, renamed by ``commit``)."""
        check_name(self.path, name)
        direct = cast(Any, self.direct_io or _knobs.direct_io())
        if self._direct_blocks is None:
            # Allocated once per backend: on this class of VM freshly faulted-in memory runs at
            # a fraction of memcpy speed, so every save after the first reuses hot pages.
            self._direct_blocks = _C.BufferPool(DIRECT_BLOCK_BYTES, DIRECT_BLOCKS)
        return _DataFile(
            os.path.join(self.path, name), direct, self._fsync(), DIRECT_BLOCK_BYTES,
            DIRECT_BLOCKS, staging=self._direct_blocks,
        )

    def put_metadata(self, encoded: bytes, state: SaveState) -> None:
        """Writes ``pyckpt.json`` (temp + fsync + rename + directory fsync) if the stored one
        is still the one :meth:`begin_save` saw (on the coordinator; a copy on another rank is
        written unconditionally).

        Raises:
            ConcurrentSaveError: another save committed into the directory meanwhile.
        """
        meta = os.path.join(self.path, METADATA_FILE)
        if not state.is_coordinator:
            self._write_metadata(meta, encoded)
            return
        # Under the directory lock nothing can change between the check and the rename; where
        # flock is unavailable, a short exclusive-create mutex covers just those two steps.
        with contextlib.ExitStack() as stack:
            if state.lock is None or not state.lock.held:
                stack.enter_context(_commit_mutex(self.path, meta))
            if state.base is not ANY and _digest(meta) != state.base:
                raise ConcurrentSaveError(
                    errno.EBUSY,
                    "another save committed a checkpoint into this directory while this save "
                    "ran; this save is abandoned and the other checkpoint left intact",
                    meta,
                )
            self._write_metadata(meta, encoded)

    def _write_metadata(self, meta: str, encoded: bytes) -> None:
        with _C.FileWriter(meta, "off", self._fsync()) as fw:
            fw.append(encoded)
            fw.commit()

    def metadata_is(self, encoded: bytes) -> bool | None:
        try:
            with open(os.path.join(self.path, METADATA_FILE), "rb") as f:
                return f.read() == encoded
        except OSError:
            return False

    # -- names -----------------------------------------------------------------------------

    def url_of(self, name: str) -> str:
        return os.path.join(self.path, name)

    def list_names(self) -> dict[str, int]:
        """Data files, temp files and rank-local metadata files in the directory (no symbolic
        links), with sizes."""
        return _paths.regular_files(self.path, lambda name: (
            _format.is_data_file(name) or ".tmp-" in name or _ranklocal.is_metadata_file(name)))

    def delete(self, names: Iterable[str]) -> None:
        for name in [check_name(self.path, n, temp=True) for n in names]:
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass

    # -- load ------------------------------------------------------------------------------

    def read_index(self, lazy: bool = False, *, all_files: bool = True
                   ) -> _format.CheckpointIndex:
        return _format.read_index(self.path, all_files=all_files, lazy=lazy)

    def read_requests(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        return _C.read_requests(requests, pool)

    def reads(self, pool: Any) -> Any:
        return direct_reads(self, pool)

    def read_stored(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        return _C.read_stored(requests, pool)

    def verify_segments(self, name: str, segments: list[Any], pool: Any) -> _C.ReadStats:
        return _C.verify_segments(name, segments, pool)

    def stage(self, directory: str, share: tuple[int, int] | None = None) -> list[str]:
        """A directory needs no staging: the consolidator reads it in place (``in_place``)."""
        raise NotImplementedError(f"{self.path}: a directory is consolidated in place")

    def check(self) -> None:
        os.makedirs(self.path, exist_ok=True)

    def put_file(self, path: str, *, last: bool = False) -> str:
        """Copies ``path`` into the directory (temp file, fsync, rename)."""
        name = os.path.basename(path)
        target = self.url_of(name)
        if os.path.abspath(path) == os.path.abspath(target):
            return target
        copy_atomic(path, target, self._fsync())
        return target

    def remove_files(self, urls: Iterable[str], *, strict: bool = False) -> None:
        for url in urls:
            with contextlib.suppress(FileNotFoundError if strict else OSError):
                os.unlink(url)

    # -- a location holding checkpoints --------------------------------------------------

    def get_file(self, name: str, path: str) -> int:
        """Copies ``name`` to local file ``path`` (temp file, fsync, rename); returns its size."""
        return copy_atomic(self.url_of(check_name(self.path, name)), path, self._fsync())

    def list_children(self) -> dict[str, bool]:
        """Sub-directories (no symbolic links), each with whether it holds ``pyckpt.json``."""
        out = {}
        try:
            with os.scandir(self.path) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        out[e.name] = os.path.isfile(os.path.join(e.path, METADATA_FILE))
        except FileNotFoundError:
            pass
        return out

    def delete_checkpoint(self) -> None:
        """The metadata first (made durable), then data and temp files, the lock files, and
        the directory when nothing else is left in it."""
        meta = os.path.join(self.path, METADATA_FILE)
        try:
            os.unlink(meta)
            if self._fsync():
                fsync_dir(self.path)
        except FileNotFoundError:
            if not os.path.isdir(self.path):
                return
        delete_checkpoint(self)
        for name in (LOCK_FILE, COMMIT_MUTEX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, name))
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(self.path)
