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
import stat
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyckpt import _format
from pyckpt._format import METADATA_FILE
from pyckpt._paths import fsync_dir, temp_name, write_atomic
from pyckpt.backends import Backend, SaveState, child_location, commit_save, open_backend
from pyckpt.errors import (
    CheckpointFormatError,
    ConcurrentSaveError,
    JobMismatchError,
    PyckptError,
)

__all__ = [
    "MARKER_FILE",
    "JOB_DIR",
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
#: ``<durable>/pyckpt-job/pyckpt.json`` names the job whose steps the durable tier holds.
JOB_DIR = "pyckpt-job"
JOB_VERSION = 1
#: Suffix of a fast-tier file a restore found damaged and set aside.
DAMAGED_SUFFIX = ".damaged"
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
        path: the step's directory on that node.
        save_id: save id of this node's ``pyckpt.json`` (None: absent or unreadable).
        files: data files of that save (name -> size) from the metadata (empty without it).
        present: data files present in the step directory (own and replicas).
        marker: the completion marker's document (None: not written here).
        metadata_error: why this node's ``pyckpt.json`` could not be read, when it exists
            (None: read, or absent).
        damaged: data files here that do not match the metadata (truncated, not regular
            files): name -> what is wrong (not in ``present``).
    """

    step: int
    path: str = ""
    save_id: str | None = None
    files: dict[str, int] = field(default_factory=dict)
    present: list[str] = field(default_factory=list)
    marker: dict[str, Any] | None = None
    metadata_error: str | None = None
    damaged: dict[str, str] = field(default_factory=dict)


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
        if not open_backend(root).in_place:  # a URL: refused, never taken for a path
            raise ValueError(f"local={os.fspath(root)!r}: the fast tier is a directory on "
                             "each node, not a URL")
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = fsync
        self._dir = open_backend(self.root, fsync=fsync)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, step_name(step))

    def backend(self, step: int) -> Any:
        """The backend of step ``step``'s directory on this node (a directory's backend, whose
        ``read_index`` also takes ``all_files``)."""
        return open_backend(self.step_dir(step), fsync=self.fsync)

    def steps(self) -> list[int]:
        """Steps with a directory on this node, ascending."""
        out = [s for s in map(parse_step, self._dir.list_children()) if s is not None]
        return sorted(out)

    def view(self, step: int) -> StepView:
        """What this node holds of ``step`` (see :class:`StepView`)."""
        d = self.step_dir(step)
        out = StepView(step, d)
        try:
            out.present = sorted(n for n in os.listdir(d) if _format.is_data_file(n))
        except FileNotFoundError:
            return out
        try:
            index = self.backend(step).read_index(all_files=False)
        except (OSError, ValueError) as e:
            index = self._index_apart(d, out, e)
        if index is not None:
            out.save_id = index.save_id
            out.files = dict(index.files)
        out.marker = self.read_marker(step)
        return out

    @staticmethod
    def _index_apart(d: str, out: StepView, error: BaseException) -> Any:
        """The index of ``d``'s ``pyckpt.json`` when validating it with the data files present
        failed with ``error``: the document alone is validated (against no data file), and if
        it is sound the present files that do not match it (size, not a regular file) are the
        damaged ones (``out.damaged``, taken out of ``out.present``). None, with
        ``out.metadata_error``, when the metadata itself is damaged; None when it is absent."""
        meta = os.path.join(d, METADATA_FILE)
        if not os.path.lexists(meta):
            return None
        try:
            with open(meta, "rb") as fh:
                raw = fh.read(_format.MAX_METADATA_BYTES + 1)
            with tempfile.TemporaryDirectory(prefix="pyckpt-meta-") as empty:
                index = _format.read_index(empty, all_files=False, document=raw)
        except (OSError, ValueError):
            out.metadata_error = f"{type(error).__name__}: {error}"  # names the file
            return None
        for name in out.present:
            if name not in index.files:
                continue
            st = os.lstat(os.path.join(d, name))
            if not stat.S_ISREG(st.st_mode):
                out.damaged[name] = "not a regular file"
            elif st.st_size != index.files[name]:
                out.damaged[name] = (f"{st.st_size} bytes where its metadata records "
                                     f"{index.files[name]}")
        if not out.damaged:  # not a data file's size or type: take the copy as unusable
            out.metadata_error = f"{type(error).__name__}: {error}"
            return None
        out.present = [n for n in out.present if n not in out.damaged]
        return index

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

    def recover(self) -> list[int]:
        """Completes the moves a crash cut short: a copy under ``.resave`` whose marker is
        written (this node committed it) replaces its step, when the step's directory or the
        old copy the move set aside is still there (not a step retention deleted since).
        Returns the steps moved in."""
        work = self.resave_tier()
        moved = []
        for s in work.steps():
            old = os.path.join(work.root, f"old-{step_name(s)}")
            if work.read_marker(s) is not None and (os.path.isdir(self.step_dir(s))
                                                    or os.path.isdir(old)):
                self.replace(s, work)
                moved.append(s)
        return moved

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

    def damaged_files(self, step: int) -> dict[str, str]:
        """Data files of ``step`` on this node that fail their checks (the size the metadata
        records; every chunk's size and checksum): name -> what is wrong. Empty when this
        node's metadata cannot be read (that is reported by :meth:`view`)."""
        from pyckpt import _C, _native

        d = self.step_dir(step)
        try:
            index = self.backend(step).read_index(all_files=False)
        except (OSError, ValueError):
            return {}
        segments: dict[str, list[Any]] = {}
        pieces = [p.segments for t in index.tensors.values() for p in t.pieces]
        pieces += [b.segments for b in index.bytes_items.values()]
        for segs in pieces:
            for seg in segs:
                segments.setdefault(os.path.basename(os.fspath(seg[0])), []).append(seg)
        out: dict[str, str] = {}
        with _native.call_pool(2) as pool:
            for name in sorted(n for n in os.listdir(d) if n in index.files):
                try:
                    size = os.path.getsize(os.path.join(d, name))
                    if size != index.files[name]:
                        out[name] = f"{size} bytes where its metadata records {index.files[name]}"
                        continue
                    _C.verify_segments(name, segments.get(name, []), pool)
                except (PyckptError, OSError, ValueError, RuntimeError) as e:
                    out[name] = f"{type(e).__name__}: {e}"
        return out

    def set_aside(self, step: int, name: str) -> str:
        """Renames damaged file ``name`` of ``step`` (a data file or ``pyckpt.json``) to
        ``<name>.damaged``, out of every later load's way but kept for inspection; returns the
        new path."""
        path = self.file_path(step, name)
        os.replace(path, path + DAMAGED_SUFFIX)
        return path + DAMAGED_SUFFIX

    def remove(self, step: int) -> None:
        """Deletes ``step`` here: the marker first, then the metadata, then the rest; and the
        copies of it a crash left in ``.resave`` (a fresh save or retention makes them stale:
        :meth:`recover` must never move them in later)."""
        aside = os.path.join(self.root, RESAVE_DIR)
        for d in (self.step_dir(step), os.path.join(aside, step_name(step)),
                  os.path.join(aside, f"old-{step_name(step)}")):
            for name in (MARKER_FILE, METADATA_FILE):
                try:
                    os.unlink(os.path.join(d, name))
                except (FileNotFoundError, NotADirectoryError):
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
                 storage_options: Mapping[str, Any] | None = None, fsync: bool = True,
                 job: str | None = None, kind: str = "durable tier") -> None:
        if job is not None and (not isinstance(job, str) or not job):
            raise ValueError(f"job must be a non-empty string or None, got {job!r}")
        self._options = dict(storage_options or {})
        self.fsync = fsync
        self.job = job
        self.kind = kind  # how messages name the tier (a fast tier claims its job the same way)
        self._owner: str | None = None
        self._job_checked = False
        base = open_backend(location, self._options or None, fsync=fsync)
        if base.in_place:
            if self._options:
                raise ValueError(f"{base.location}: storage_options are for object-store URLs")
            if os.path.exists(base.location) and not os.path.isdir(base.location):
                raise NotADirectoryError(errno.ENOTDIR, "the durable tier must be a directory",
                                         base.location)
        self.base: Backend = base
        # A path made absolute (a later chdir does not move the tier); a URL as normalised.
        self.url = os.path.abspath(base.location) if base.in_place else base.location
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

    # -- the job that owns the tier ----------------------------------------------------

    def job_location(self) -> str:
        """Where the job marker lives: ``<durable>/pyckpt-job/pyckpt.json``."""
        return child_location(self.url, JOB_DIR)

    def _job_backend(self, deadline_s: float | None) -> Backend:
        backend = open_backend(self.job_location(), self._options or None, fsync=self.fsync)
        return backend.with_deadline(deadline_s) if deadline_s is not None else backend

    def read_job(self, deadline_s: float | None = None) -> str | None:
        """The job named by the marker (None: no marker); ``deadline_s`` as for
        :meth:`list_steps`.

        Raises:
            CheckpointFormatError: the marker is not a job marker.
        """
        backend = self._job_backend(deadline_s)
        with tempfile.TemporaryDirectory(prefix="pyckpt-job-") as d:
            path = os.path.join(d, METADATA_FILE)
            try:
                backend.get_file(METADATA_FILE, path)
            except FileNotFoundError:
                return None
            with open(path, "rb") as fh:
                raw = fh.read(_MAX_MARKER_BYTES + 1)
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if (not isinstance(doc, dict) or doc.get("pyckpt_job") != JOB_VERSION
                or not isinstance(doc.get("job"), str)):
            raise CheckpointFormatError(
                f"{backend.url_of(METADATA_FILE)}: not a pyckpt job marker (it names the job "
                f"whose checkpoints this {self.kind} holds)")
        return str(doc["job"])

    def check_job(self, deadline_s: float | None = None) -> str | None:
        """Checks that this tier belongs to :attr:`job` (claiming it, by writing the marker,
        when no job has), once per tier object; returns the job of the tier. ``deadline_s``
        as for :meth:`list_steps`.

        Without a job of its own (``job=None``) a tier that no named job claimed is used as it
        is (nothing is written); one that a named job claimed is refused.

        Raises:
            JobMismatchError: another job's marker is there (naming the location, that job and
                this one).
        """
        if self._job_checked:
            return self._owner
        owner = self.read_job(deadline_s)
        if owner is None and self.job is not None:
            backend = self._job_backend(deadline_s)
            doc = json.dumps({"pyckpt_job": JOB_VERSION, "job": self.job}).encode()
            try:
                state = backend.begin_save(True, overwrite=False)
                try:
                    backend.put_metadata(doc, state)
                finally:
                    state.end()
                owner = self.job
            except (FileExistsError, ConcurrentSaveError):  # another job claimed it first
                owner = self.read_job(deadline_s)
        if owner is not None and owner != self.job:
            how = (f"pass job={owner!r} to continue that job" if self.job is None else
                   f"this manager's job is {self.job!r}")
            raise JobMismatchError(
                f"the {self.kind} {self.url} holds the checkpoints of job {owner!r} (marker "
                f"{child_location(self.job_location(), METADATA_FILE)}); {how}, or give this "
                "job a location of its own (two jobs on one location would delete and restore "
                "each other's steps)", self.url, owner, self.job)
        self._owner, self._job_checked = owner, True
        return owner

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

    def list_steps(self, deadline_s: float | None = None) -> dict[int, bool]:
        """Steps with anything stored: step -> committed (its ``pyckpt.json`` exists).

        Args:
            deadline_s: give up after about this long (retries included) on a backend that
                reaches a remote store, instead of its full retry budget (minutes): for a
                restore that has a fast-tier step to fall back on.
        """
        base = self.base
        if deadline_s is not None:
            base = base.with_deadline(deadline_s)
        out = {}
        for name, committed in base.list_children().items():
            s = parse_step(name)
            if s is not None:
                out[s] = committed
        return out

    def begin(self, step: int, is_coordinator: bool) -> SaveState:
        """Sets up persisting ``step`` (the backend's save set-up: the place made, and on the
        coordinator the lock or the condition its commit checks).

        Raises:
            JobMismatchError: the tier belongs to another job (nothing is written).
        """
        self.check_job()
        return self.backend(step).begin_save(is_coordinator, overwrite=True)

    def put_file(self, step: int, src: str) -> int:
        """Stores the committed local data file ``src`` into ``step``; returns its size."""
        size = os.path.getsize(src)
        self.backend(step).put_file(src)
        self._count(written=size)
        return size

    def commit(self, step: int, document: bytes, files: Iterable[str], state: SaveState) -> None:
        """Commits ``pyckpt.json`` of ``step`` by the backends' one rule (conditional on
        ``state``), removing what it made stale; then ends ``state``.

        Raises:
            JobMismatchError: the tier belongs to another job (nothing is committed).
        """
        try:
            self.check_job()
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
