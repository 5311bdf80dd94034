"""On-disk format, the reading side: opening ``pyckpt.json``, checking its seal, parsing it
strictly, and :func:`read_index`, the one validation path of every reader.

Imported through :mod:`pyckpt._format`; ``docs/FORMAT.md`` is the specification.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Callable
from typing import Any

from pyckpt import _C, _gc, _knobs
from pyckpt._format_json import _describe, _Duplicate
from pyckpt._format_schema import _Validator
from pyckpt._format_spec import (
    _JUST_INT,
    _SEAL_LEN,
    _SEAL_RE,
    _SEGMENT_KEYS,
    FORMAT_NAME,
    MAX_METADATA_BYTES,
    METADATA_FILE,
    READABLE_VERSIONS,
    CheckpointIndex,
    StoredTensor,
)
from pyckpt.errors import CheckpointFormatError


def _object_hook() -> Callable[[list[tuple[str, Any]]], Any]:
    """The ``object_pairs_hook`` of one parse.

    Besides marking repeated keys, it compacts chunk records while the document is being parsed
    (the parsed lists of a large checkpoint would otherwise dominate memory): in every object
    with exactly the segment keys, each ``[a, b, c, d, [planes...]]`` chunk list becomes the tuple
    ``(a, b, c, d, (planes...))`` and repeated raw lengths and all-raw plane tuples are shared.
    The values are not checked here; the validator checks the tuples as it would the lists (and
    :meth:`_Validator.untag` turns them back into lists inside planner_data).
    """
    ints: dict[int, int] = {}
    raw_planes: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def hook(pairs: list[tuple[str, Any]]) -> Any:
        d = dict(pairs)
        if len(d) != len(pairs):
            seen: set[str] = set()
            for k, _ in pairs:
                if k in seen:
                    return _Duplicate(k)
                seen.add(k)
        chunks = d.get("chunks")
        if type(chunks) is list and len(d) == 4 and d.keys() == _SEGMENT_KEYS:
            for j, c in enumerate(chunks):
                if type(c) is list and len(c) == 5 and type(c[4]) is list:
                    planes = tuple(c[4])
                    # All raw planes: the tuple repeats across chunks. Only exact ints are
                    # shared (False == 0 and hash alike: sharing must not hide a bool).
                    if not any(planes[0::2]) and set(map(type, planes)) == _JUST_INT:
                        planes = raw_planes.setdefault(planes, planes)
                    raw_len = c[1]
                    if type(raw_len) is int:
                        raw_len = ints.setdefault(raw_len, raw_len)
                    chunks[j] = (c[0], raw_len, c[2], c[3], planes)
        return d

    return hook


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


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


def _check_seal(raw: bytes, meta: str) -> re.Match[bytes] | None:
    """The metadata checksum member at the end of ``raw``, verified; None when there is none."""
    seal = _SEAL_RE.fullmatch(raw, len(raw) - _SEAL_LEN) if len(raw) > _SEAL_LEN else None
    if seal is not None:
        recorded = int(seal.group(1), 16)
        actual = _C.xxh64(memoryview(raw)[: len(raw) - _SEAL_LEN])
        if actual != recorded:
            raise CheckpointFormatError(
                f"{meta}: metadata checksum mismatch (recorded xxh64:{recorded:016x}, computed "
                f"xxh64:{actual:016x}): the file is damaged"
            )
    return seal


def _native(raw: bytes, meta: str, seal: re.Match[bytes] | None) -> _C.PyckptIndex | None:
    """``raw`` read by the native reader (``csrc/core/pyckpt_index.hpp``): a document of the
    current version as this pyckpt writes it, parsed and checked in one pass outside Python.
    None for every other document (older versions, other spellings, damaged or hostile files),
    which the Python validator then reads: it accepts the rest of the format and names what is
    wrong. ``seal``: :func:`_check_seal` of ``raw`` (a version 3 document has one)."""
    if not _knobs.native_index() or seal is None:
        return None
    try:
        return _C.parse_pyckpt_index(raw, meta)
    except CheckpointFormatError:
        return None


_UNCHECKED: Any = object()


def _parse(holder: list[bytes], meta: str,
           seal: re.Match[bytes] | None = _UNCHECKED) -> tuple[dict[str, Any], int]:
    """Checks the metadata checksum, then parses strict UTF-8 JSON; returns (doc, version).

    ``holder`` holds the file's bytes; they are released once decoded, before the parse.
    ``seal``: the caller's :func:`_check_seal` of them, when it has checked them already.
    """
    raw = holder.pop()
    if seal is _UNCHECKED:
        seal = _check_seal(raw, meta)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(
            f"{meta}: metadata is not UTF-8 ({e.reason} at byte {e.start})"
        ) from None
    del raw
    if not text.startswith("{"):
        raise CheckpointFormatError(
            f"{meta}: metadata must start with '{{' (no byte order mark, no whitespace)"
        )
    try:
        doc = json.loads(text, object_pairs_hook=_object_hook(), parse_constant=_reject_constant)
    except RecursionError:
        raise CheckpointFormatError(f"{meta}: metadata is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, integers of too many digits
        raise CheckpointFormatError(f"{meta}: metadata is not valid JSON ({e})") from None
    del text
    if type(doc) is not dict:
        what = f"repeats the top-level key {doc.key!r}" if isinstance(doc, _Duplicate) else (
            "is not a JSON object")
        raise CheckpointFormatError(f"{meta}: metadata {what}")
    if doc.get("format") != FORMAT_NAME or type(doc.get("format")) is not str:
        raise CheckpointFormatError(f"{meta}: not a pyckpt metadata file ('format' is not "
                                    f"{FORMAT_NAME!r})")
    version = doc.get("version")
    if type(version) is not int:
        raise CheckpointFormatError(
            f"{meta}: version: must be an integer, got {_describe(version)}"
        )
    if version not in READABLE_VERSIONS:
        raise CheckpointFormatError(
            f"{meta}: format version {version} is not supported by this pyckpt (reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}); upgrade pyckpt to read it"
        )
    if version >= 2 and seal is None:
        raise CheckpointFormatError(
            f"{meta}: the metadata checksum is missing or malformed (a version {version} file "
            "ends with ,\"checksum\":\"xxh64:<16 hex digits>\"}): the file is damaged"
        )
    return doc, version


def read_index(
    path: str | os.PathLike[str], *, all_files: bool = True, document: bytes | None = None
) -> CheckpointIndex:
    """Reads and validates the metadata of the checkpoint directory ``path``.

    ``all_files=False`` reads a node-local checkpoint (``shared_filesystem=False``): a data file
    absent from ``path`` is held by another node and is not an error here (the files present are
    checked as usual); ``CheckpointIndex.local_files`` names the files present. ``document``
    validates those bytes (another node's copy of ``pyckpt.json``) instead of reading the file.

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
    return validate(raw, meta, lambda version: _Validator(root, meta, version, all_files))


def validate(raw: bytes, meta: str, validator: Callable[[int], _Validator]) -> CheckpointIndex:
    """The index of the metadata bytes ``raw`` (of ``meta``, for messages): read by the native
    reader when it accepts them, else by the Python validator. ``validator(version)`` makes the
    validator whose ``check_file`` checks the data files where the backend keeps them."""
    with _gc.paused():  # objects per tensor, piece and chunk, all kept (see pyckpt._gc)
        seal = _check_seal(raw, meta)  # once, for either reader
        native = _native(raw, meta, seal)
        if native is not None:
            return validator(native.version).from_native(native, raw)
        doc, version = _parse([raw], meta, seal)
        return validator(version).index(doc)


def tensor_index(path: str | os.PathLike[str]) -> dict[str, StoredTensor]:
    """Returns the stored tensors of checkpoint ``path`` by FQN (see :func:`read_index`)."""
    return read_index(path).tensors
