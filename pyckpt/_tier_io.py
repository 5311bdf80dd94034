"""How the checkpoint manager's bytes get to a place: the fast tier's node-local step
directories and the durable tier (a directory or ``s3://``).

Every file operation of :class:`pyckpt.CheckpointManager` goes through this module: writing a
replica received from another node, writing and reading the completion marker, listing,
measuring and deleting steps, copying a committed data file to the durable tier, committing the
durable metadata, fetching a data file back from it. Nothing here encodes, decodes or plans;
the data files are pyckpt data files, already compressed and checksummed, and move as they are.

Layout (``<N>`` is the training step, in decimal)::

    <local>/step-<N>/               a node-local pyckpt checkpoint: this node's data files, the
                                    replicas of other nodes' files, pyckpt.json, and
                                    pyckpt.tier.json (the completion marker, written last)
    <durable>/step-<N>/             a plain pyckpt checkpoint (loadable with pyckpt.load)

Commit rule (the same as everywhere in pyckpt): data files first, each written to a temp name,
fsynced and renamed; the metadata last (``pyckpt.tier.json`` in the fast tier, ``pyckpt.json``
in the durable tier); deletion removes the metadata first, so a step that is half deleted never
looks complete.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyckpt import _format
from pyckpt._format import METADATA_FILE
from pyckpt.backends import is_remote
from pyckpt.backends.s3 import client as s3_client
from pyckpt.backends.s3.upload import upload_file

__all__ = [
    "MARKER_FILE",
    "StepView",
    "LocalTier",
    "DurableStore",
    "DirStore",
    "ObjectStore",
    "open_durable",
    "step_name",
    "parse_step",
]

MARKER_FILE = "pyckpt.tier.json"
MARKER_VERSION = 1
_STEP_RE = re.compile(r"step-(0|[1-9][0-9]{0,18})")
_MAX_MARKER_BYTES = 16 << 20


def step_name(step: int) -> str:
    """The directory (or prefix) name of ``step``."""
    if step < 0:
        raise ValueError(f"a step is a non-negative integer, got {step}")
    return f"step-{step}"


def parse_step(name: str) -> int | None:
    """The step of directory name ``name`` (None for any other name)."""
    m = _STEP_RE.fullmatch(name)
    return None if m is None else int(m.group(1))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"


def _write_atomic(path: str, data: bytes, fsync: bool) -> None:
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        _fsync_dir(os.path.dirname(path))


def _copy_atomic(src: str, dst: str, fsync: bool) -> int:
    """Copies file ``src`` to ``dst`` (temp + fsync + rename); returns the bytes copied."""
    tmp = _tmp_name(dst)
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, 16 << 20)
            if fsync:
                fout.flush()
                os.fsync(fout.fileno())
            size = fout.tell()
        os.rename(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        _fsync_dir(os.path.dirname(dst))
    return size


# ----------------------------------------------------------------------------- fast tier


@dataclass
class StepView:
    """What one rank sees of one fast-tier step on its node.

    Attributes:
        step: the training step.
        save_id: save id of this node's ``pyckpt.json`` (None: absent or unreadable).
        files: data files of that save (name -> size) from the metadata (empty without it).
        present: data files present in the step directory (own and replicas).
        marker: the completion marker's document (None: not written here).
    """

    step: int
    save_id: str | None = None
    files: dict[str, int] = field(default_factory=dict)
    present: list[str] = field(default_factory=list)
    marker: dict[str, Any] | None = None


class ReplicaFile:
    """A data file received from another node, written at offsets into a temp file, checked,
    then committed under its final name (fsync + rename + directory fsync)."""

    def __init__(self, path: str, size: int, fsync: bool) -> None:
        self.path = path
        self.size = size
        self.fsync = fsync
        self.tmp = _tmp_name(path)
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.received = 0

    def write_at(self, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = os.pwrite(self.fd, view, offset)
            view = view[n:]
            offset += n
            self.received += n

    def digest(self) -> int:
        """XXH64 of the received bytes (read back through a mapping)."""
        import mmap

        from pyckpt import _C

        if self.size == 0:
            return int(_C.xxh64(b""))
        with mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ) as m:
            return int(_C.xxh64(m))

    def commit(self) -> None:
        if self.fsync:
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.rename(self.tmp, self.path)
        if self.fsync:
            _fsync_dir(os.path.dirname(self.path))

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


class LocalTier:
    """The fast tier on this node: ``root/step-<N>/`` directories (not shared between nodes).

    Thread-safety: the methods touch the file system only; callers serialise work on one step.
    """

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = fsync

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, step_name(step))

    def steps(self) -> list[int]:
        """Steps with a directory on this node, ascending."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        out = [s for s in map(parse_step, names) if s is not None]
        return sorted(out)

    def view(self, step: int) -> StepView:
        """What this node holds of ``step`` (see :class:`StepView`)."""
        d = self.step_dir(step)
        out = StepView(step)
        try:
            out.present = sorted(n for n in os.listdir(d) if _format.is_data_file(n))
        except FileNotFoundError:
            return out
        try:
            index = _format.read_index(d, all_files=False)
            out.save_id = index.save_id
            out.files = dict(index.files)
        except (OSError, ValueError):
            pass  # no (readable) metadata here: the step is not usable from this node's copy
        out.marker = self.read_marker(step)
        return out

    def scan(self) -> dict[int, StepView]:
        return {s: self.view(s) for s in self.steps()}

    def read_marker(self, step: int) -> dict[str, Any] | None:
        path = os.path.join(self.step_dir(step), MARKER_FILE)
        try:
            with open(path, "rb") as fh:
                raw = fh.read(_MAX_MARKER_BYTES + 1)
            doc = json.loads(raw)
        except (OSError, ValueError):
            return None
        if (not isinstance(doc, dict) or doc.get("version") != MARKER_VERSION
                or doc.get("step") != step or not isinstance(doc.get("save_id"), str)):
            return None
        return doc

    def prepare(self, step: int) -> str:
        """Empties (or makes) the directory of ``step`` for a new save; returns it."""
        self.remove(step)
        d = self.step_dir(step)
        os.makedirs(d, exist_ok=True)
        return d

    def ensure(self, step: int) -> str:
        d = self.step_dir(step)
        os.makedirs(d, exist_ok=True)
        return d

    def open_replica(self, step: int, name: str, size: int) -> ReplicaFile:
        if not _format.is_data_file(name):
            raise ValueError(f"illegal data file name {name!r}")
        return ReplicaFile(os.path.join(self.ensure(step), name), size, self.fsync)

    def file_path(self, step: int, name: str) -> str:
        if not _format.is_data_file(name) and name != METADATA_FILE:
            raise ValueError(f"illegal data file name {name!r}")
        return os.path.join(self.step_dir(step), name)

    def write_marker(self, step: int, doc: Mapping[str, Any]) -> None:
        """Writes the completion marker of ``step`` (atomically; the last file of a step)."""
        body = dict(doc, version=MARKER_VERSION, step=step)
        _write_atomic(os.path.join(self.step_dir(step), MARKER_FILE),
                      json.dumps(body, sort_keys=True).encode(), self.fsync)

    def remove(self, step: int) -> None:
        """Deletes ``step`` here: the marker first, then the metadata, then the rest."""
        d = self.step_dir(step)
        for name in (MARKER_FILE, METADATA_FILE):
            try:
                os.unlink(os.path.join(d, name))
            except FileNotFoundError:
                pass
        shutil.rmtree(d, ignore_errors=True)

    def footprint(self) -> int:
        """Bytes of every file of the fast tier on this node."""
        total = 0
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                try:
                    total += os.lstat(os.path.join(dirpath, n)).st_size
                except FileNotFoundError:
                    pass
        return total


# ----------------------------------------------------------------------------- durable tier


class DurableStore:
    """The durable tier: one pyckpt checkpoint per step under a base location.

    Counters (this process): ``data_bytes_read`` (every data byte read back, by fetches and by
    direct loads), ``data_files_fetched`` (files fetched whole by :meth:`fetch_file`),
    ``direct_loads`` (steps read straight from this tier), ``metadata_reads``,
    ``bytes_written``.
    """

    url: str

    def __init__(self) -> None:
        self.data_bytes_read = 0
        self.data_files_fetched = 0
        self.direct_loads = 0
        self.metadata_reads = 0
        self.bytes_written = 0
        self._lock = threading.Lock()

    def _count_read(self, nbytes: int) -> None:
        with self._lock:
            self.data_bytes_read += nbytes
            self.data_files_fetched += 1

    def count_direct_load(self, nbytes: int) -> None:
        """Records a load that read ``nbytes`` of a step straight from this tier."""
        with self._lock:
            self.data_bytes_read += nbytes
            self.direct_loads += 1

    def _count_write(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_written += nbytes

    # Interface -------------------------------------------------------------------------------

    def step_location(self, step: int) -> str:
        """Path or URL of the checkpoint of ``step`` (for pyckpt.load / Reader / Writer)."""
        raise NotImplementedError

    @property
    def storage_options(self) -> dict[str, Any]:
        return {}

    def list_steps(self) -> dict[int, bool]:
        """Steps with anything stored: step -> committed (its ``pyckpt.json`` exists)."""
        raise NotImplementedError

    def put_file(self, step: int, src: str) -> int:
        """Copies the committed local data file ``src`` into ``step``; returns its size."""
        raise NotImplementedError

    def commit(self, step: int, document: bytes, files: Iterable[str]) -> None:
        """Writes ``pyckpt.json`` of ``step`` (atomically), then deletes other data files there."""
        raise NotImplementedError

    def read_metadata(self, step: int) -> bytes:
        raise NotImplementedError

    def fetch_file(self, step: int, name: str, dst: str) -> int:
        """Copies data file ``name`` of ``step`` to local path ``dst`` (temp + rename)."""
        raise NotImplementedError

    def remove(self, step: int) -> None:
        """Deletes ``step``: its metadata first, then its data."""
        raise NotImplementedError


class DirStore(DurableStore):
    """A durable tier in a directory (a shared or local file system)."""

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True) -> None:
        super().__init__()
        self.url = os.path.abspath(os.fspath(root))
        self.fsync = fsync

    def step_location(self, step: int) -> str:
        return os.path.join(self.url, step_name(step))

    def list_steps(self) -> dict[int, bool]:
        try:
            names = os.listdir(self.url)
        except FileNotFoundError:
            return {}
        out = {}
        for n in names:
            s = parse_step(n)
            if s is not None:
                out[s] = os.path.isfile(os.path.join(self.url, n, METADATA_FILE))
        return out

    def put_file(self, step: int, src: str) -> int:
        d = self.step_location(step)
        os.makedirs(d, exist_ok=True)
        size = _copy_atomic(src, os.path.join(d, os.path.basename(src)), self.fsync)
        self._count_write(size)
        return size

    def commit(self, step: int, document: bytes, files: Iterable[str]) -> None:
        d = self.step_location(step)
        os.makedirs(d, exist_ok=True)
        _write_atomic(os.path.join(d, METADATA_FILE), document, self.fsync)
        self._count_write(len(document))
        keep = set(files)
        for n in os.listdir(d):
            if (_format.is_data_file(n) and n not in keep) or ".tmp-" in n:
                try:
                    os.unlink(os.path.join(d, n))
                except FileNotFoundError:
                    pass

    def read_metadata(self, step: int) -> bytes:
        self.metadata_reads += 1
        with open(os.path.join(self.step_location(step), METADATA_FILE), "rb") as fh:
            return fh.read(_format.MAX_METADATA_BYTES + 1)

    def fetch_file(self, step: int, name: str, dst: str) -> int:
        if not _format.is_data_file(name):
            raise ValueError(f"illegal data file name {name!r}")
        size = _copy_atomic(os.path.join(self.step_location(step), name), dst, self.fsync)
        self._count_read(size)
        return size

    def remove(self, step: int) -> None:
        d = self.step_location(step)
        try:
            os.unlink(os.path.join(d, METADATA_FILE))
        except FileNotFoundError:
            pass
        if self.fsync and os.path.isdir(d):
            _fsync_dir(d)
        shutil.rmtree(d, ignore_errors=True)


class ObjectStore(DurableStore):
    """A durable tier in an object store (``s3://bucket/prefix``): step ``N`` is the
    checkpoint ``s3://bucket/prefix/step-<N>``."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._options = dict(storage_options or {})
        self.base = s3_client.location(url, self._options)
        self.url = self.base.url
        self._locations: dict[int, s3_client.Location] = {}

    @property
    def storage_options(self) -> dict[str, Any]:
        return dict(self._options)

    def _loc(self, step: int) -> s3_client.Location:
        with self._lock:
            loc = self._locations.get(step)
            if loc is None:
                loc = s3_client.location(self.step_location(step), self._options)
                self._locations[step] = loc
            return loc

    def step_location(self, step: int) -> str:
        return f"{self.url}/{step_name(step)}"

    def list_steps(self) -> dict[int, bool]:
        import obstore

        prefix = self.base.prefix + "/" if self.base.prefix else ""
        out: dict[int, bool] = {}
        try:
            for batch in obstore.list(self.base.store(), prefix or None):
                for meta in batch:
                    rel = str(meta["path"])[len(prefix):]
                    parts = rel.split("/")
                    if len(parts) != 2:
                        continue
                    s = parse_step(parts[0])
                    if s is None:
                        continue
                    out[s] = out.get(s, False) or parts[1] == METADATA_FILE
        except Exception as e:
            raise self.base.error(e, "LIST", self.url) from None
        return out

    def put_file(self, step: int, src: str) -> int:
        size = os.path.getsize(src)
        upload_file(self._loc(step), src)
        self._count_write(size)
        return size

    def commit(self, step: int, document: bytes, files: Iterable[str]) -> None:
        loc = self._loc(step)
        loc.put(METADATA_FILE, document)
        self._count_write(len(document))
        keep = set(files)
        loc.delete([n for n in loc.list_names() if _format.is_data_file(n) and n not in keep])

    def read_metadata(self, step: int) -> bytes:
        self.metadata_reads += 1
        return self._loc(step).get(METADATA_FILE, _format.MAX_METADATA_BYTES)

    def fetch_file(self, step: int, name: str, dst: str) -> int:
        import obstore

        loc = self._loc(step)
        url = loc.url_of(name)
        tmp = _tmp_name(dst)
        size = 0
        try:
            stream = obstore.get(loc.store(), loc.key(name)).stream(min_chunk_size=8 << 20)
            with open(tmp, "wb") as fh:
                for part in stream:
                    fh.write(part)
                    size += len(part)
                fh.flush()
                os.fsync(fh.fileno())
            os.rename(tmp, dst)
        except Exception as e:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            if isinstance(e, OSError) and e.filename in (url, dst):
                raise
            raise loc.error(e, "GET", url) from None
        self._count_read(size)
        return size

    def remove(self, step: int) -> None:
        loc = self._loc(step)
        loc.delete([METADATA_FILE])
        names = [n for n in loc.list_names() if _format.is_data_file(n)]
        loc.delete(names)


def open_durable(location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None,
                 fsync: bool = True) -> DurableStore:
    """The durable store at ``location``: a directory, or an ``s3://`` URL."""
    path = os.fspath(location)
    if is_remote(path):
        return ObjectStore(path, storage_options)
    if storage_options:
        raise ValueError(f"{path}: storage_options are for object-store URLs")
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, "the durable tier must be a directory", path)
    return DirStore(path, fsync)
