"""The in-memory backend (``memory://name``): checkpoints held in this process.

The worked example of docs/ARCHITECTURE.md, "How to add a backend", and the store the
conformance suite (tests/backends/) runs without a disk or a server. A store is a dict of
names to immutable bytes; data files are encoded by the native ``BlockWriter`` (the ChunkSink
that hands blocks to Python), reads decode straight from the stored bytes
(``_C.read_requests`` with ``sources``). A store lives until :func:`drop` or the end of the
process; it is shared by every backend object of that name in the process. A name may have
several segments: ``memory://run/step-4`` is a child of ``memory://run`` (:meth:`list_children`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from pyckpt import _C, _format
from pyckpt._format import METADATA_FILE
from pyckpt._paths import write_atomic
from pyckpt.backends.base import (
    NativeBlockSink,
    ReadRequest,
    SaveState,
    WholePlace,
    check_name,
    delete_checkpoint,
    direct_reads,
    stage_shares,
)
from pyckpt.errors import CheckpointFormatError, ConcurrentSaveError

__all__ = ["MemoryBackend", "drop"]

SCHEME = "memory://"
_stores: dict[str, dict[str, bytes]] = {}
_busy: set[str] = set()  # stores with a save between set-up and commit
_lock = threading.Lock()


def drop(url: str) -> None:
    """Forgets the store ``url`` (``memory://name``) and everything in it."""
    with _lock:
        _stores.pop(url, None)


class _Sink(NativeBlockSink):
    """A data file being encoded: blocks collected, stored under its name by :meth:`commit`."""

    def __init__(self, files: dict[str, bytes], name: str, url: str) -> None:
        self._files, self._name = files, name
        self._parts: list[bytes] = []
        self._native = _C.BlockWriter(url, 4 << 20, lambda b: self._parts.append(bytes(b)))

    def commit(self) -> None:
        self._native.commit()
        with _lock:
            self._files[self._name] = b"".join(self._parts)

    def __enter__(self) -> _Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._native.committed:  # nothing is stored
            self._native.abort()


class MemoryBackend(WholePlace):
    """One in-process store (:class:`~pyckpt.backends.base.Backend`). Saves are serialised
    like a directory's: one save per store from set-up to commit, a second one fails at set-up
    with ``BlockingIOError``; the commit is conditional on the metadata set-up saw."""

    default_chunk_bytes = 4 << 20
    in_place = False
    exchanges_chunks = False
    shares_page_cache = False  # every rank's read is paid, as from an object store
    collective_loads = False
    bytes_fetched = 0
    bytes_from_peers = 0

    def __init__(self, url: str) -> None:
        parts = url[len(SCHEME):].strip("/").split("/")  # memory://name[/child...]
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid memory URL {url!r}: expected memory://name[/child]")
        self.location = SCHEME + "/".join(parts)
        with _lock:
            self.files = _stores.setdefault(self.location, {})

    def __repr__(self) -> str:
        return f"MemoryBackend({self.location!r})"

    def __reduce__(self) -> tuple[Any, ...]:  # a copy names the same store, never a snapshot
        return MemoryBackend, (self.location,)

    def _digest(self) -> str | None:
        meta = self.files.get(METADATA_FILE)
        return None if meta is None else hashlib.sha256(meta).hexdigest()

    def begin_save(self, is_coordinator: bool, overwrite: bool) -> SaveState:
        state = SaveState(is_coordinator)
        if not is_coordinator:
            return state
        with _lock:
            if self.location in _busy:
                raise BlockingIOError(errno.EWOULDBLOCK, f"another save into {self.location!r} "
                                      "is in progress", self.location)
            state.base = self._digest()
            if not overwrite and state.base is not None:
                raise FileExistsError(errno.EEXIST, "Checkpoint already exists and "
                                      "overwrite=False", self.url_of(METADATA_FILE))
            _busy.add(self.location)
        state.lock = self
        return state

    def release(self) -> None:  # the lock of a save (SaveState.end)
        with _lock:
            _busy.discard(self.location)

    def data_sink(self, name: str, options: Mapping[str, Any]) -> _Sink:
        return _Sink(self.files, check_name(self.location, name), self.url_of(name))

    def put_metadata(self, encoded: bytes, state: SaveState) -> None:
        with _lock:
            if state.is_coordinator and self._digest() != state.base:
                raise ConcurrentSaveError(errno.EBUSY, "another save committed meanwhile",
                                          self.url_of(METADATA_FILE))
            self.files[METADATA_FILE] = bytes(encoded)

    def metadata_is(self, encoded: bytes) -> bool | None:
        return self.files.get(METADATA_FILE) == encoded

    def url_of(self, name: str) -> str:
        return f"{self.location}/{name}"

    def list_names(self) -> dict[str, int]:
        with _lock:
            return {n: len(b) for n, b in self.files.items() if n != METADATA_FILE}

    def delete(self, names: Iterable[str]) -> None:
        with _lock:
            for name in names:
                self.files.pop(check_name(self.location, name), None)

    def read_index(self, lazy: bool = False) -> _format.CheckpointIndex:
        meta, raw = self.url_of(METADATA_FILE), self.files.get(METADATA_FILE)
        if raw is None:
            raise FileNotFoundError(errno.ENOENT, "not a complete pyckpt checkpoint: "
                                    f"{METADATA_FILE} is missing", meta)
        # The one validation path, data files looked up here.
        return _format.validate(raw, meta, _DataFiles(self, meta), lazy=lazy)

    def _sources(self, segments: Iterable[Any]) -> dict[str, _C.MemorySource]:  # lent as is
        data = {seg[0]: self.files.get(seg[0].rsplit("/", 1)[-1], b"") for seg in segments}
        return {url: _C.MemorySource(len(b), [_C.MemoryRange(0, b)]) for url, b in data.items()}

    def read_requests(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        return _C.read_requests(requests, pool, self._sources(s for r in requests for s in r[1]))

    def reads(self, pool: Any) -> Any:
        return direct_reads(self, pool)

    def read_stored(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        return _C.read_stored(requests, pool, self._sources(s for r in requests for s in r[1]))

    def verify_segments(self, name: str, segments: list[Any], pool: Any) -> _C.ReadStats:
        return _C.verify_segments(name, segments, pool, self._sources(segments))

    def stage(self, directory: str, share: tuple[int, int] | None = None) -> list[str]:
        index = self.read_index()
        names = stage_shares(index.files, share[1])[share[0]] if share else sorted(index.files)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, METADATA_FILE), "wb") as f:
            f.write(_format.single_document(index) if index.version == 4 else
                    self.files[METADATA_FILE])
        for name in names:
            with open(os.path.join(directory, name), "wb") as f:
                f.write(self.files[name])
        return names

    def check(self) -> None:
        """A store is always there."""

    def put_file(self, path: str, *, last: bool = False) -> str:
        with open(path, "rb") as f, _lock:
            self.files[os.path.basename(path)] = f.read()
        return self.url_of(os.path.basename(path))

    def remove_files(self, urls: Iterable[str], *, strict: bool = False) -> None:
        with _lock:
            for url in urls:
                self.files.pop(url.rsplit("/", 1)[-1], None)

    def get_file(self, name: str, path: str) -> int:
        data = self.files.get(check_name(self.location, name))
        if data is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", self.url_of(name))
        write_atomic(path, data, fsync=False)
        return len(data)

    def list_children(self) -> dict[str, bool]:
        out: dict[str, bool] = {}
        prefix = self.location + "/"
        with _lock:
            for url, files in _stores.items():
                if url.startswith(prefix) and files:
                    child, _, rest = url[len(prefix):].partition("/")
                    out[child] = out.get(child, False) or (not rest and METADATA_FILE in files)
        return out

    def delete_checkpoint(self) -> None:
        """Empties the store, then forgets it (as :func:`drop`)."""
        delete_checkpoint(self)
        with _lock:
            if not self.files and _stores.get(self.location) is self.files:
                del _stores[self.location]


class _DataFiles(_format.DataFiles):
    """The data files of a checkpoint, looked up in the store."""

    def __init__(self, backend: MemoryBackend, meta: str) -> None:
        super().__init__(backend.location, meta)
        self.backend = backend

    def check_file(self, name: str, size: int) -> str:
        url = self.backend.url_of(name)
        have = self.backend.files.get(name)
        if have is None:
            raise FileNotFoundError(errno.ENOENT, "data file of checkpoint "
                                    f"{self.backend.location!r} is missing", url)
        if len(have) < size:
            raise CheckpointFormatError(f"{url}: data file is truncated: {len(have)} bytes, "
                                        f"expected {size}")
        return url

    def read_shards(self, refs: list[Any]) -> list[tuple[bytes, str]]:
        return [(bytes(self.backend.files.get(ref.file, b"")[ref.offset:ref.offset + ref.length]),
                 self.check_file(ref.file, ref.offset + ref.length)) for ref in refs]
