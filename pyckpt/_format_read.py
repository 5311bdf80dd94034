"""On-disk format, the reading side: opening ``pyckpt.json`` and :func:`read_index`, the one
validation path of every reader.

The metadata reader is native (``csrc/core/pyckpt_index.hpp``, ``_C.parse_pyckpt_index``): it
verifies the metadata checksum and parses and validates the document, every version and
spelling the format allows, in one pass without the GIL, and names what is wrong. What is left
here is what only a backend can check: that the data files it lists exist where the backend
keeps them, at least as large as recorded (:class:`DataFiles`).

Imported through :mod:`pyckpt._format`; ``docs/FORMAT.md`` is the specification.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import stat
from typing import Any

from pyckpt import _C, _format_shards, _format_shards_read, _gc
from pyckpt._format_spec import (
    MAX_METADATA_BYTES,
    METADATA_FILE,
    CheckpointIndex,
    StoredBytes,
    StoredPiece,
    StoredTensor,
    check_item_names,
)
from pyckpt.errors import CheckpointFormatError


def _fields(cls: type) -> tuple[type, tuple[str, ...]]:
    """(cls, its field names in order): how the reader makes instances without __init__
    (see ``_C.PyckptIndex.materialize``), which only holds for a plain slots dataclass."""
    if "__post_init__" in vars(cls) or not hasattr(cls, "__slots__"):
        raise TypeError(f"{cls.__name__} must stay a plain slots dataclass")
    return cls, tuple(f.name for f in dataclasses.fields(cls))


_TENSOR_FIELDS = _fields(StoredTensor)
_PIECE_FIELDS = _fields(StoredPiece)


def _open_metadata(root: str, meta: str) -> bytes:
    """Reads ``pyckpt.json``: a regular file, never followed through a link, bounded in size."""
    try:
        fd = os.open(meta, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as e:
        hint = ""
        if os.path.exists(os.path.join(root, ".metadata")):
            hint = " (it looks like a DCP FileSystemWriter checkpoint; use FileSystemReader)"
        raise FileNotFoundError(
            e.errno, f"not a complete pyckpt checkpoint: {METADATA_FILE} is missing{hint}", meta,
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointFormatError(
                f"{meta}: is a symbolic link; pyckpt does not follow links to its metadata"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError(f"{meta}: is not a regular file")
        if st.st_size > MAX_METADATA_BYTES:
            raise CheckpointFormatError(
                f"{meta}: {st.st_size} bytes, more than the {MAX_METADATA_BYTES} bytes this "
                "pyckpt reads"
            )
        parts = []
        total = 0
        while True:
            part = os.read(fd, min(max(st.st_size + 1 - total, 1 << 16),
                                   MAX_METADATA_BYTES + 1 - total))
            if not part:
                break
            parts.append(part)
            total += len(part)
            if total > MAX_METADATA_BYTES:
                raise CheckpointFormatError(
                    f"{meta}: more than the {MAX_METADATA_BYTES} bytes this pyckpt reads"
                )
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class DataFiles:
    """The data files of one checkpoint where a backend keeps them (here: a directory): checks
    each file a validated document lists, and builds the index with each file's full path.
    Other backends override :meth:`check_file`."""

    def __init__(self, root: str, meta: str, all_files: bool = True) -> None:
        self.root = root
        self.meta = meta
        self.all_files = all_files

    def check_file(self, name: str, size: int) -> str | None:
        """Checks that data file ``name`` (a validated plain name) exists as a regular file of
        at least ``size`` bytes; returns its full path, or None when it is missing and the
        checkpoint is node-local (``all_files`` False: another node holds it)."""
        full = os.path.join(self.root, name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            if not self.all_files:
                return None
            raise FileNotFoundError(
                errno.ENOENT, f"data file of checkpoint {self.root!r} is missing", full
            ) from None
        if stat.S_ISLNK(st.st_mode):
            raise CheckpointFormatError(f"{full}: data file is a symbolic link; pyckpt "
                                        "does not follow links out of a checkpoint")
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError(f"{full}: data file is not a regular file")
        if st.st_size < size:
            raise CheckpointFormatError(
                f"{full}: data file is truncated: {st.st_size} bytes, expected {size}"
            )
        return full

    def path_of(self, name: str, size: int) -> str:
        """Where data file ``name`` (a validated plain name, of ``size`` bytes) is read from,
        checked as :meth:`check_file` does (a file another node holds: where it would be)."""
        full = self.check_file(name, size)
        return os.path.join(self.root, name) if full is None else full

    def read_shards(self, refs: list[Any]) -> list[tuple[bytes, str]]:
        """The bytes of each metadata shard (``refs``: :class:`pyckpt._format_shards.ShardRef`)
        of a version-4 checkpoint, with the path of its data file; a shard cut short by the
        end of its file comes back short (the caller names it truncated)."""
        out = []
        for ref in refs:
            full = self.check_file(ref.file, ref.offset + ref.length)
            if full is None:
                raise FileNotFoundError(
                    errno.ENOENT, f"the metadata shard of rank {ref.rank} is in a data file "
                    "this node does not hold; a sharded (version 4) checkpoint loads from a "
                    "place every rank sees", os.path.join(self.root, ref.file))
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                out.append((os.pread(fd, ref.length, ref.offset), full))
            finally:
                os.close(fd)
        return out

    def sharded(self, raw: bytes, lazy: bool) -> CheckpointIndex:
        """The index of a version-4 document ``raw``: with ``lazy``, its global part only
        (``CheckpointIndex.sharded`` reads shards on demand), else every item in full."""
        g = _format_shards_read.parse_global(raw, self.meta)
        local_files = set()
        checked: dict[str, str] = {}
        if not lazy:  # a lazy read checks the files it uses, when it uses them
            for name, size in g.files.items():
                full = self.check_file(name, size)
                if full is not None:
                    local_files.add(name)
                    checked[name] = full
        sharded = _format_shards_read.ShardedIndex(
            g, self.read_shards, lambda n, z: checked.get(n) or self.path_of(n, z))
        tensors: dict[str, StoredTensor] = {}
        bytes_items: dict[str, StoredBytes] = {}
        if not lazy:
            tensors, bytes_items = sharded.full()
        return CheckpointIndex(
            path=self.root, tensors=tensors, bytes_items=bytes_items, files=g.files,
            save_id=g.save_id, dcp_version=g.dcp_version, planner_data=g.planner_data,
            storage_meta={"modules": g.modules}, created_by=g.created_by,
            version=4, local_files=local_files,
            sharded=sharded if lazy else None,
        )

    def index(self, x: _C.PyckptIndex) -> CheckpointIndex:
        """The index of the document the reader read (``x``), once its data files pass
        :meth:`check_file`, in the document's order."""
        files: dict[str, int] = {}
        local_files: set[str] = set()
        paths = []
        for name, size in x.files:
            full = self.check_file(name, size)
            files[name] = size
            paths.append(os.path.join(self.root, name) if full is None else full)
            if full is not None:  # None: node-local, held by another node
                local_files.add(name)
        tensors, bytes_items = x.materialize(paths, _TENSOR_FIELDS, _PIECE_FIELDS, StoredBytes,
                                             _C.CodecParams)
        return CheckpointIndex(
            path=self.root,
            tensors=tensors,
            bytes_items=bytes_items,
            files=files,
            save_id=x.save_id,
            dcp_version=x.dcp_version,
            planner_data=x.planner_data,
            storage_meta={"modules": x.modules},
            created_by=x.created_by,
            version=x.version,
            local_files=local_files,
        )


def read_index(
    path: str | os.PathLike[str], *, all_files: bool = True, document: bytes | None = None,
    lazy: bool = False,
) -> CheckpointIndex:
    """Reads and validates the metadata of the checkpoint directory ``path``.

    ``all_files=False`` reads a node-local checkpoint (``shared_filesystem=False``): a data file
    absent from ``path`` is held by another node and is not an error here (the files present are
    checked as usual); ``CheckpointIndex.local_files`` names the files present. ``document``
    validates those bytes (another node's copy of ``pyckpt.json``) instead of reading the file.
    ``lazy`` reads only the global part of a version-4 (sharded) checkpoint: its
    ``CheckpointIndex.sharded`` then reads the shards a load needs (see
    :mod:`pyckpt._format_shards`); without it every shard is read and checked.

    This is the one validation path of every reader. The metadata checksum is verified before
    anything in the document is used; then every object must have exactly its keys, every value
    its type and range (docs/FORMAT.md), data file names must be plain names of the checkpoint
    directory, the pieces of each tensor must tile it, each data file must be its chunks back to
    back, and every chunk record must be one the writer can produce.

    Raises:
        FileNotFoundError: ``path`` has no metadata file (not a complete pyckpt checkpoint), or
            a data file it lists is missing; ``filename`` names the file.
        CheckpointFormatError: the metadata is damaged, malformed, of an unknown version, beyond
            the documented limits, or refers to data files that are too short, not regular
            files, or symbolic links.
        UnsupportedDtypeError: a tensor has a dtype this pyckpt does not know.
        OSError: the metadata or a data file cannot be opened or examined.
    """
    root = os.fspath(path)
    meta = os.path.join(root, METADATA_FILE)
    raw = _open_metadata(root, meta) if document is None else bytes(document)
    return validate(raw, meta, DataFiles(root, meta, all_files), lazy=lazy)


def validate(raw: bytes, meta: str, files: DataFiles, lazy: bool = False,
             **options: Any) -> CheckpointIndex:
    """The index of the metadata bytes ``raw`` (of ``meta``, for messages), read by the metadata
    reader, its data files checked by ``files`` (where the backend keeps them). ``options``:
    those of ``_C.parse_pyckpt_index`` (a rank-local part: ``disjoint_pieces``, ``rank``).
    A version-4 document (sharded, :mod:`pyckpt._format_shards`) is read by that module, its
    shards through ``files``; ``lazy``: see :func:`read_index`."""
    with _gc.paused():  # objects per tensor, piece and chunk, all kept (see pyckpt._gc)
        if _format_shards.is_sharded(raw) and not options:
            return files.sharded(raw, lazy)
        index = files.index(_C.parse_pyckpt_index(raw, meta, **options))
        check_item_names(itertools.chain(index.tensors, index.bytes_items), meta)
        return index


def tensor_index(path: str | os.PathLike[str]) -> dict[str, StoredTensor]:
    """Returns the stored tensors of checkpoint ``path`` by FQN (see :func:`read_index`)."""
    return read_index(path).tensors
