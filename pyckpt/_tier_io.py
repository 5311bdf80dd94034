"""How the checkpoint manager's bytes get to a place: the fast tier's node-local step
directories and the durable tier (any pyckpt location: a directory, ``s3://``, ``memory://``).

Every file operation of :class:`pyckpt.CheckpointManager` goes through this module: writing a
replica received from another node, writing and reading the completion marker, listing,
measuring and deleting steps, copying a committed data file to the durable tier, committing the
durable metadata, fetching a data file back from it. Nothing here encodes, decodes or plans;
the data files are pyckpt data files, already compressed and checksummed, and move as they are.

A tier is a location with a backend (:mod:`pyckpt.backends`): durable step ``N`` is the
checkpoint ``open_backend(<durable>/step-<N>)``; data files go in with ``put_file``, the
metadata with the backends' one commit rule (:func:`~pyckpt.backends.base.commit_save`); steps
are listed (``list_children``), fetched (``get_file``) and deleted (``delete_checkpoint``)
through the backend, so any backend serves as the durable tier. The fast tier is a directory
on each node, written with the POSIX backend's atomic file writes.

Layout (``<N>`` is the training step, in decimal)::

    <local>/step-<N>/               a node-local pyckpt checkpoint: this node's data files, the
                                    replicas of other nodes' files, pyckpt.json, and
                                    pyckpt.tier.json (the completion marker, written last)
    <local>/.resave/step-<N>/       a step already complete here, being saved again (moved
                                    over <local>/step-<N> once its marker is written)
    <durable>/step-<N>              a plain pyckpt checkpoint (loadable with pyckpt.load)

Commit rule (the same as everywhere in pyckpt): data files first, each written to a temp name,
fsynced and renamed (or uploaded whole); the metadata last (``pyckpt.tier.json`` in the fast
tier, ``pyckpt.json`` in the durable tier); deletion removes the metadata first, so a step that
is half deleted never looks complete.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyckpt import _format
from pyckpt._format import METADATA_FILE
from pyckpt.backends import Backend, SaveState, child_location, commit_save, open_backend
from pyckpt.backends.posix import PosixBackend, fsync_dir, temp_name, write_atomic

__all__ = [
    "MARKER_FILE",
    "StepView",
    "LocalTier",
    "DurableTier",
    "ReplicaFile",
    "step_name",
    "parse_step",
]

MARKER_FILE = "pyckpt.tier.json"
MARKER_VERSION = 1
RESAVE_DIR = ".resave"  # under the fast tier's root: steps being saved again (LocalTier.resave_tier)
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
        self.tmp = temp_name(path)
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
            fsync_dir(os.path.dirname(self.path))

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
        if open_backend(root).local_dir is None:  # a URL: refused, never taken for a path
            raise ValueError(f"local={os.fspath(root)!r}: the fast tier is a directory on "
                             "each node, not a URL")
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = fsync
        self._dir = PosixBackend(self.root, fsync=fsync)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, step_name(step))

    def backend(self, step: int) -> PosixBackend:
        """The POSIX backend of step ``step``'s directory on this node."""
        return PosixBackend(self.step_dir(step), fsync=self.fsync, node_local=True)

    def steps(self) -> list[int]:
        """Steps with a directory on this node, ascending."""
        out = [s for s in map(parse_step, self._dir.list_children()) if s is not None]
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
            index = self.backend(step).read_index(all_files=False)
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

    def resave_tier(self) -> LocalTier:
        """Where a step that is already complete here is saved again: ``root/.resave``, a tier
        of its own (``root/.resave/step-<N>``) that :meth:`steps` never lists, so the complete
        copy stays in place until :meth:`replace` puts the new one there."""
        return LocalTier(os.path.join(self.root, RESAVE_DIR), self.fsync)

    def replace(self, step: int, work: LocalTier) -> None:
        """Puts ``work``'s complete copy of ``step`` (marker written) in place of this tier's:
        the old directory is renamed aside, the new one renamed in, then the old one deleted.
        Until the first rename the old copy is the step; from the second on, the new one."""
        new, here = work.step_dir(step), self.step_dir(step)
        old = os.path.join(work.root, f"old-{step_name(step)}")
        shutil.rmtree(old, ignore_errors=True)
        if os.path.isdir(here):
            os.rename(here, old)
        os.rename(new, here)
        if self.fsync:
            fsync_dir(self.root)
        for name in (MARKER_FILE, METADATA_FILE):  # as remove(): never looks complete half-gone
            try:
                os.unlink(os.path.join(old, name))
            except FileNotFoundError:
                pass
        shutil.rmtree(old, ignore_errors=True)

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
        write_atomic(os.path.join(self.step_dir(step), MARKER_FILE),
                     json.dumps(body, sort_keys=True).encode(), self.fsync)

    def write_metadata(self, step: int, document: bytes) -> None:
        """Writes ``pyckpt.json`` of ``step`` on this node (the durable tier's copy, before
        its lost data files are fetched) as the POSIX backend writes a node's copy."""
        self.backend(step).put_metadata(document, SaveState(is_coordinator=False))

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


class DurableTier:
    """The durable tier: step ``N`` is the checkpoint at ``<location>/step-<N>``, through the
    backend :func:`pyckpt.backends.open_backend` gives for it (any pyckpt location).

    Counters (this process): ``data_bytes_read`` (every data byte read back, by fetches and by
    direct loads), ``data_files_fetched`` (files fetched whole by :meth:`fetch_file`),
    ``direct_loads`` (steps read straight from this tier), ``metadata_reads``,
    ``bytes_written``.

    Raises:
        ValueError: an unsupported URL, or ``storage_options`` for a directory.
        NotADirectoryError: ``location`` is a path naming a file.
    """

    def __init__(self, location: str | os.PathLike[str],
                 storage_options: Mapping[str, Any] | None = None, fsync: bool = True) -> None:
        self._options = dict(storage_options or {})
        self.fsync = fsync
        base = open_backend(location, self._options or None, fsync=fsync)
        if base.local_dir is not None:
            if self._options:
                raise ValueError(f"{base.location}: storage_options are for object-store URLs")
            if os.path.exists(base.local_dir) and not os.path.isdir(base.local_dir):
                raise NotADirectoryError(errno.ENOTDIR, "the durable tier must be a directory",
                                         base.local_dir)
        self.base: Backend = base
        # A path made absolute (a later chdir does not move the tier); a URL as normalised.
        self.url = base.location if base.local_dir is None else os.path.abspath(base.local_dir)
        self._backends: dict[int, Backend] = {}
        self.data_bytes_read = 0
        self.data_files_fetched = 0
        self.direct_loads = 0
        self.metadata_reads = 0
        self.bytes_written = 0
        self._lock = threading.Lock()

    @property
    def storage_options(self) -> dict[str, Any]:
        return dict(self._options)

    def step_location(self, step: int) -> str:
        """Location of the checkpoint of ``step`` (for pyckpt.load / Reader / Writer)."""
        return child_location(self.url, step_name(step))

    def backend(self, step: int) -> Backend:
        """The backend of step ``step`` (one per step, kept: an object-store client is made
        once)."""
        with self._lock:
            b = self._backends.get(step)
            if b is None:
                b = self._backends[step] = open_backend(
                    self.step_location(step), self._options or None, fsync=self.fsync)
            return b

    def _count(self, read: int = 0, written: int = 0, fetched: int = 0, loads: int = 0) -> None:
        with self._lock:
            self.data_bytes_read += read
            self.bytes_written += written
            self.data_files_fetched += fetched
            self.direct_loads += loads

    def count_direct_load(self, nbytes: int) -> None:
        """Records a load that read ``nbytes`` of a step straight from this tier."""
        self._count(read=nbytes, loads=1)

    def list_steps(self) -> dict[int, bool]:
        """Steps with anything stored: step -> committed (its ``pyckpt.json`` exists)."""
        out = {}
        for name, committed in self.base.list_children().items():
            s = parse_step(name)
            if s is not None:
                out[s] = committed
        return out

    def begin(self, step: int, is_coordinator: bool) -> SaveState:
        """Sets up persisting ``step`` (the backend's save set-up: the place made, and on the
        coordinator the lock or the condition its commit checks)."""
        return self.backend(step).begin_save(is_coordinator, overwrite=True)

    def put_file(self, step: int, src: str) -> int:
        """Stores the committed local data file ``src`` into ``step``; returns its size."""
        size = os.path.getsize(src)
        self.backend(step).put_file(src)
        self._count(written=size)
        return size

    def commit(self, step: int, document: bytes, files: Iterable[str], state: SaveState) -> None:
        """Commits ``pyckpt.json`` of ``step`` by the backends' one rule (conditional on
        ``state``), removing what it made stale; then ends ``state``."""
        try:
            commit_save(self.backend(step), list(files), document, state)
        finally:
            state.end()
        self._count(written=len(document))

    def read_metadata(self, step: int) -> bytes:
        with self._lock:
            self.metadata_reads += 1
        with tempfile.TemporaryDirectory(prefix="pyckpt-meta-") as d:
            path = os.path.join(d, METADATA_FILE)
            self.backend(step).get_file(METADATA_FILE, path)
            with open(path, "rb") as fh:
                return fh.read(_format.MAX_METADATA_BYTES + 1)

    def fetch_file(self, step: int, name: str, dst: str) -> int:
        """Copies data file ``name`` of ``step`` to local path ``dst`` (temp + rename)."""
        if not _format.is_data_file(name):
            raise ValueError(f"illegal data file name {name!r}")
        size = self.backend(step).get_file(name, dst)
        self._count(read=size, fetched=1)
        return size

    def remove(self, step: int) -> None:
        """Deletes ``step``: its metadata first, then its data."""
        self.backend(step).delete_checkpoint()
        with self._lock:
            self._backends.pop(step, None)
