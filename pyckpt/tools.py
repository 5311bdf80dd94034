"""Checkpoint tools behind the ``pyckpt`` command line: inspect, verify, convert.

Each function takes paths and returns plain data (or raises typed errors); the CLI formats it.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pyckpt import _format, _knobs, _native, _progress
from pyckpt._collective import add_note
from pyckpt._format import CODECS  # the codec names: the CLI's --compression values
from pyckpt._knobs import worker_bytes  # PYCKPT_WORKER_BYTES, for the CLI's worker count
from pyckpt._native import apply_native_settings
from pyckpt._options import choice
from pyckpt._progress import Progress, rate  # the progress view and its rate, for the CLI
from pyckpt.backends import Backend, open_backend
from pyckpt.errors import PyckptError

__all__ = [
    "CheckpointSummary",
    "VerifyReport",
    "bytes_per_rank",
    "leftovers",
    "summarize",
    "verify",
    "convert",
    "Progress",
    "rate",
    "worker_bytes",
    "CODECS",
]

@dataclass
class CheckpointSummary:
    """What ``pyckpt inspect`` shows."""

    path: str
    version: int
    save_id: str
    created_by: str
    files: dict[str, int]
    tensors: int
    bytes_items: int
    raw_bytes: int
    stored_bytes: int
    dtypes: dict[str, int]  # dtype -> raw bytes
    codecs: dict[str, int]  # codec/transform -> raw bytes
    largest: list[tuple[str, str, tuple[int, ...], int]]  # fqn, dtype, shape, raw bytes
    rank_bytes: dict[int, int]  # rank -> bytes of the data files it wrote


def bytes_per_rank(path: str | os.PathLike[str]) -> dict[int, int]:
    """Bytes on disk of the data files each rank wrote for the checkpoint at ``path``.

    Sizes are read from the files themselves (``stat``), for the files the metadata lists.
    """
    backend = open_backend(path)
    return _rank_bytes(backend.read_index(), backend)


def _rank_bytes(index: _format.CheckpointIndex, backend: Backend) -> dict[int, int]:
    out: dict[int, int] = {}
    for name, recorded in index.files.items():
        rank = _format.data_file_rank(name)
        # Files are measured (stat); objects were checked against a listing when the index
        # was read: no second request.
        size = os.stat(backend.url_of(name)).st_size if backend.in_place else recorded
        out[rank] = out.get(rank, 0) + size
    return dict(sorted(out.items()))


def summarize(path: str | os.PathLike[str], top: int = 10) -> CheckpointSummary:
    """Reads a checkpoint's metadata (no tensor data) and summarises it, listing the ``top``
    largest tensors (``top`` >= 0)."""
    if top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    backend = open_backend(path)
    index = backend.read_index()
    dtypes: Counter[str] = Counter()
    codecs: Counter[str] = Counter()
    sizes = []
    raw_total = 0
    for fqn, t in index.tensors.items():
        nbytes = sum(p.nbytes for p in t.pieces)
        raw_total += nbytes
        dtypes[t.dtype] += nbytes
        sizes.append((fqn, t.dtype, t.shape, nbytes))
        for p in t.pieces:
            for _, _, params, chunks in p.segments:
                codecs[f"{params.codec}/{params.transform}"] += sum(c[1] for c in chunks)
    raw_total += sum(b.nbytes for b in index.bytes_items.values())
    sizes.sort(key=lambda s: -s[3])
    return CheckpointSummary(
        path=index.path,
        version=index.version,
        save_id=index.save_id,
        created_by=index.created_by,
        files=dict(index.files),
        tensors=len(index.tensors),
        bytes_items=len(index.bytes_items),
        raw_bytes=raw_total,
        stored_bytes=sum(index.files.values()),
        dtypes=dict(dtypes),
        codecs=dict(codecs),
        largest=sizes[:top],
        rank_bytes=_rank_bytes(index, backend),
    )


@dataclass
class VerifyReport:
    """What ``pyckpt verify`` found: checked items and the errors, by item name."""

    items_checked: int = 0
    chunks_checked: int = 0
    bytes_read: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    # Files of saves that did not commit (:func:`leftovers`): the checkpoint is intact, and the
    # next save into the directory removes them.
    leftovers: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors


def _verify_piece(name: str, segments: list[Any], nbytes: int, pool: Any,
                  report: VerifyReport, backend: Backend) -> None:
    # Each chunk is decoded once, through a bounded window, and its output discarded (an
    # object store downloads one segment's chunks at a time).
    stats = backend.verify_segments(name, segments, pool)
    report.bytes_read += stats.bytes_read
    report.chunks_checked += stats.chunks


def verify(path: str | os.PathLike[str], threads: int | None = None,
           progress: Any = False) -> VerifyReport:
    """Reads every chunk of a checkpoint, checking sizes, checksums and zstd frames.

    ``threads``: reader threads, >= 1 (default ``PYCKPT_READ_THREADS``). ``progress``: ``True``
    shows progress on stderr (a bar on a terminal, a log line every few seconds otherwise), or
    a callable ``(raw_bytes_checked, raw_bytes_total)``.

    Raises:
        FileNotFoundError / CheckpointFormatError: the metadata itself is missing or invalid.
            Per-item data errors (ChecksumError, CompressionError, CheckpointFormatError,
            UnsupportedDtypeError, OSError) are collected in the report instead, keyed by item
            name, as ``"<ErrorClass>: <message>"``.
        MemoryError: too little memory to verify an item (says nothing about the data).
    """
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    backend = open_backend(path)
    try:
        index = backend.read_index()
    except FileNotFoundError as e:
        left = leftovers(path) if backend.in_place else {}
        if not left or e.filename != backend.url_of(_format.METADATA_FILE):
            raise
        raise FileNotFoundError(
            e.errno, f"{e.strerror}; the directory holds only what saves that did not commit "
            f"left ({', '.join(sorted(left))}): the next save into it removes them",
            e.filename) from e
    apply_native_settings()
    report = VerifyReport(leftovers=leftovers(path, index) if backend.in_place else {})
    with _native.call_pool(threads or _knobs.read_threads()) as pool:
        work: list[tuple[str, list[Any], int]] = [
            (b.fqn, b.segments, b.nbytes) for b in index.bytes_items.values()
        ]
        for t in index.tensors.values():
            for i, p in enumerate(t.pieces):
                label = t.fqn if len(t.pieces) == 1 else f"{t.fqn}[piece {i}]"
                work.append((label, p.segments, p.nbytes))
        total = sum(nbytes for _, _, nbytes in work)
        with _progress.job(progress, "verify") as report_to, \
                _progress.native_counter(report_to, total):
            for name, segments, nbytes in work:
                report.items_checked += 1
                try:
                    _verify_piece(name, segments, nbytes, pool, report, backend)
                except MemoryError as e:
                    # Not damage: every size is bounded by the validated metadata, and each
                    # chunk's checksum is checked before it is decoded.
                    raise MemoryError(
                        f"not enough memory to verify {name!r} ({e}); the checkpoint may be "
                        "intact: run with fewer --threads or more memory") from e
                except (PyckptError, OSError, ValueError, RuntimeError) as e:
                    # Every typed error of one item (CompressionError and UnsupportedDtypeError
                    # are not ValueErrors) marks that item corrupt, names it and the reason,
                    # and the other items still run.
                    report.errors[name] = f"{type(e).__name__}: {e}"
    return report


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: it exists
        return False
    return False


def leftovers(path: str | os.PathLike[str],
              index: _format.CheckpointIndex | None = None) -> dict[str, str]:
    """Files a save that did not commit left in checkpoint directory ``path``, each with what it
    is: temp files (``<name>.tmp-<pid>-<n>``) of a process that is gone (killed mid-write),
    data files the committed ``index`` does not name, and a lock file alone in a directory
    holding nothing else. The checkpoint (if any) is intact; the next save removes them.
    A temp file of a live process (a save running now) is not listed."""
    from pyckpt._paths import LOCK_FILE, TEMP_MARKER

    directory = os.fspath(path)
    try:
        names = sorted(e.name for e in os.scandir(directory) if e.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return {}
    out: dict[str, str] = {}
    for name in names:
        base, marker, tail = name.partition(TEMP_MARKER)
        if marker and (base == _format.METADATA_FILE or _format.is_data_file(base)):
            pid = tail.split("-", 1)[0]
            if pid.isdigit() and _process_gone(int(pid)):
                out[name] = (f"temp file of a save by process {pid}, which ended before "
                             "renaming it (killed mid-write)")
        elif _format.is_data_file(name) and (index is None or name not in index.files):
            out[name] = "data file no committed checkpoint here names (a save that did not commit)"
    if index is None and names == [LOCK_FILE]:
        out[LOCK_FILE] = "lock file of a save that committed nothing"
    elif index is None and out and LOCK_FILE in names:
        out[LOCK_FILE] = "lock file of a save that did not commit"
    return out


def _empty_state_dict(metadata: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sd: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            sd[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            sd[fqn] = None  # a BYTE_IO value: DCP's planner replaces it on load
    return _nest(sd, getattr(metadata, "planner_data", None))


def _nest(flat: dict[str, Any], planner_data: Any) -> dict[str, Any]:
    """Rebuilds the nesting DCP flattened on save from ``Metadata.planner_data``.

    DCP's default planner flattens ``{"model": {"b": [t0, 3]}}`` into the keys ``model.b.0``,
    ``model.b.1`` and records each key's path (``("model", "b", 0)``) in ``planner_data``; lists
    appear as integer path steps. Without that mapping (a checkpoint saved flat) the flat keys
    are the state dict.
    """
    if not isinstance(planner_data, dict) or not all(
        isinstance(planner_data.get(k), tuple) and planner_data[k] for k in flat
    ):
        return flat
    root: dict[Any, Any] = {}
    for fqn, value in flat.items():
        node = root
        path = planner_data[fqn]
        for step in path[:-1]:
            node = node.setdefault(step, {})
        node[path[-1]] = value

    def lists(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: lists(v) for k, v in node.items()}
        keys = list(out)
        if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
            return [out[i] for i in range(len(keys))]
        return out

    nested = lists(root)
    return nested if isinstance(nested, dict) else flat


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
            to: str | None = None, compression: str | None = "zstd",
            trusted: bool = False, overwrite: bool = False) -> str:
    """Converts a checkpoint between DCP's ``FileSystemWriter`` format and pyckpt's.

    The whole state is materialised in host memory once (single process).

    Args:
        src: source checkpoint directory (format detected from its metadata file), or an
            ``s3://`` URL of a pyckpt checkpoint.
        dst: destination directory, or an ``s3://`` URL for ``to="pyckpt"``.
        to: ``"pyckpt"`` or ``"dcp"`` (any case); default: the other format.
        compression: for ``to="pyckpt"``: ``None`` or one of :data:`CODECS` (``"none"``,
            ``"zstd"``; any case), as for :class:`pyckpt.Writer`.
        trusted: unpickle non-tensor values with ``weights_only=False`` (as DCP's
            ``DefaultLoadPlanner`` does); by default ``weights_only=True``, see
            :func:`pyckpt.load`.
        overwrite: replace what ``dst`` holds; by default a destination that exists and is
            not empty (a directory with any entry, or a URL holding a checkpoint or its data
            objects) is refused before anything is read or written. A checkpoint of the other
            format in the directory is removed once the new one is committed, so that no
            reader of either format finds the old state there.

    Returns:
        The destination format.

    Raises:
        FileNotFoundError: ``src`` holds neither format's metadata.
        FileExistsError: ``dst`` is not empty and ``overwrite`` is False (``filename`` is
            ``dst``).
        KeyboardInterrupt: Ctrl-C; its note says whether the converted checkpoint was
            committed at ``dst``.
        CheckpointFormatError: a non-tensor value's pickle is refused (not ``trusted``).
    """
    import torch.distributed.checkpoint as dcp

    from pyckpt.storage import Reader, Writer

    src_s = os.fspath(src)
    reader: Any
    if not open_backend(src_s).in_place:  # stores hold pyckpt checkpoints only
        src_fmt, reader = "pyckpt", Reader(src_s)
    elif os.path.isfile(os.path.join(src_s, _format.METADATA_FILE)):
        src_fmt, reader = "pyckpt", Reader(src_s)
    elif os.path.isfile(os.path.join(src_s, ".metadata")):
        src_fmt, reader = "dcp", dcp.FileSystemReader(src_s)
    else:
        raise FileNotFoundError(2, "no pyckpt.json or DCP .metadata: not a checkpoint", src_s)
    target = str(choice("to", to, ("pyckpt", "dcp"))) if to else (
        "dcp" if src_fmt == "pyckpt" else "pyckpt")
    if not open_backend(dst).in_place and target == "dcp":  # refuses gs:// etc. too
        raise ValueError("converting to DCP's format writes a local directory, not an "
                         f"object-store URL ({os.fspath(dst)!r})")
    if not overwrite:
        _refuse_existing(dst)
    sd = _empty_state_dict(reader.read_metadata())
    reader.reset()
    from pyckpt.api import _single_process_quiet, _typed_errors, load_planner

    before = _committed_identity(dst, target)
    try:
        with _typed_errors(), _single_process_quiet(no_dist=True):  # one process by design
            dcp.load(sd, storage_reader=reader, planner=load_planner(trusted), no_dist=True)
            stale = _other_checkpoint(dst, target) if overwrite else []
            if target == "dcp" and overwrite:  # FileSystemWriter rewrites data files in place:
                # cut short, the old .metadata would name new bytes
                _remove(dst, [".metadata"])
            if target == "pyckpt":
                with Writer(dst, compression=compression, overwrite=overwrite) as w:
                    dcp.save(sd, storage_writer=w, no_dist=True)
            else:
                with warnings.catch_warnings():  # "Detected an existing checkpoint ...,
                    # overwriting": the caller asked for it (overwrite=True)
                    warnings.filterwarnings("ignore", "Detected an existing checkpoint")
                    dcp.save(sd, storage_writer=dcp.FileSystemWriter(dst, overwrite=overwrite),
                             no_dist=True)
            _remove(dst, stale)  # once the new one is committed: dst may be src
    except KeyboardInterrupt as e:
        after = _committed_identity(dst, target)
        add_note(e, f"the converted checkpoint at {os.fspath(dst)} was committed"
                 if after is not None and after != before else
                 f"no converted checkpoint was committed at {os.fspath(dst)}")
        raise
    return target


def _other_checkpoint(dst: str | os.PathLike[str], target: str) -> list[str]:
    """The files of the other format's checkpoint in local directory ``dst`` (its metadata
    and data files), which would still read as a checkpoint beside the ``target`` one a
    conversion writes there."""
    import re

    if not open_backend(dst).in_place or not os.path.isdir(dst):
        return []
    from pyckpt._ranklocal import is_metadata_file

    def other(name: str) -> bool:
        if target == "pyckpt":
            return re.fullmatch(r"(__\d+)?\.metadata|__\d+_\d+\.distcp", name) is not None
        return (name == _format.METADATA_FILE or is_metadata_file(name)
                or _format.is_data_file(name))

    return sorted(e.name for e in os.scandir(dst)
                  if e.is_file(follow_symlinks=False) and other(e.name))


def _remove(dst: str | os.PathLike[str], names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(dst, name))
        except (FileNotFoundError, NotADirectoryError):  # the writer names what dst is
            pass


def _committed_identity(dst: str | os.PathLike[str], target: str) -> Any:
    """What identifies the checkpoint committed at ``dst`` (None: none, or unknown): its
    metadata file's inode, size and time (a commit renames a new file into place), or the save
    id of a pyckpt checkpoint in an object store."""
    backend = open_backend(dst)
    if not backend.in_place:
        try:
            return backend.read_index().save_id
        except Exception:
            return None
    name = _format.METADATA_FILE if target == "pyckpt" else ".metadata"
    try:
        st = os.stat(os.path.join(os.fspath(dst), name))
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _refuse_existing(dst: str | os.PathLike[str]) -> None:
    """Raises FileExistsError naming ``dst`` when it is not empty: a file, a directory with
    any entry, or a URL holding a checkpoint's metadata or data objects."""
    import errno

    message = "the destination is not empty; pass --overwrite (overwrite=True) to replace it"
    backend = open_backend(dst)
    if backend.in_place:
        path = os.fspath(dst)
        if os.path.isdir(path):
            with os.scandir(path) as it:
                if next(it, None) is None:
                    return
        elif not os.path.lexists(path):
            return
        raise FileExistsError(errno.EEXIST, message, path)
    try:
        holds = bool(backend.list_names())  # data and temp objects
        if not holds:
            backend.read_index()  # a pyckpt.json (even a damaged one) is something to keep
            holds = True
    except FileNotFoundError:  # no pyckpt.json, or no bucket yet
        holds = False
    except PyckptError:  # a pyckpt.json that does not parse
        holds = True
    if holds:
        raise FileExistsError(errno.EEXIST, message, backend.location)
