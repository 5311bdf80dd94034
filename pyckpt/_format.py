"""On-disk format v1: the JSON metadata file, its validation, and the DCP ``Metadata`` it rebuilds.

See ``docs/FORMAT.md`` for the specification. This module knows the format; it does no I/O of
tensor data (that is the native core's job) and never unpickles anything.

Layout of a checkpoint directory::

    pyckpt.json                      metadata, written last and atomically
    <rank>-<k>.<save_id>.pyckpt      data files (stored chunks back to back)

Python representations used across the package (all plain tuples/lists, JSON-compatible):

* ``params`` = ``(codec, level, elem_size, transform)``, e.g. ``("zstd", 1, 2, "group_rotl1")``.
* ``chunk`` = ``(file_offset, raw_len, checksum, transform_code, planes)`` where ``planes`` is a
  flat ``(mode0, len0, mode1, len1, ...)``; mode 0 = raw, 1 = zstd.
* ``segment`` = ``(path, raw_begin, params, chunks)``: consecutive chunks of one piece stored in
  one file, covering the piece's raw bytes from ``raw_begin`` on.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyckpt.errors import CheckpointFormatError, UnsupportedDtypeError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "DTYPE_SIZES",
    "StoredPiece",
    "StoredTensor",
    "StoredBytes",
    "CheckpointIndex",
    "codec_params_for",
    "data_file_name",
    "is_data_file",
    "data_file_rank",
    "read_index",
    "tensor_index",
    "encode_metadata",
]

FORMAT_NAME = "pyckpt"
FORMAT_VERSION = 1
METADATA_FILE = "pyckpt.json"

# Every dtype the format stores, by torch name -> element size in bytes (STYLE I4: a table, never
# torch.finfo, which breaks on int and bool).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}

# Byte grouping per dtype: (planes, transform). Rotating left by one bit before grouping puts the
# whole exponent of bf16/fp32 (and of each fp32 half of complex64) in one byte plane.
_GROUPING: dict[str, tuple[int, str]] = {
    "bfloat16": (2, "group_rotl1"),
    "float32": (4, "group_rotl1"),
    "complex64": (4, "group_rotl1"),
    "float16": (2, "group"),
    "complex32": (2, "group"),
    "float64": (8, "group"),
    "complex128": (8, "group"),
    "int64": (8, "group"),
    "uint64": (8, "group"),
    "int32": (4, "group"),
    "uint32": (4, "group"),
    "int16": (2, "group"),
    "uint16": (2, "group"),
}

_CODECS = ("none", "zstd")
_TRANSFORMS = ("none", "group", "group_rotl1")
_DATA_FILE_RE = re.compile(r"^(\d+)-(\d+)\.([0-9a-f]+)\.pyckpt$")


def data_file_name(rank: int, k: int, save_id: str) -> str:
    """Returns the name of data file ``k`` of ``rank`` for one save."""
    return f"{rank}-{k}.{save_id}.pyckpt"


def is_data_file(name: str) -> bool:
    """True when ``name`` is a pyckpt data file name (of any save)."""
    return _DATA_FILE_RE.match(name) is not None


def data_file_rank(name: str) -> int:
    """The rank that wrote data file ``name``. Raises ValueError for other names."""
    m = _DATA_FILE_RE.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a pyckpt data file name")
    return int(m.group(1))


def codec_params_for(
    dtype_name: str, compression: str | None, level: int, byte_grouping: bool
) -> tuple[str, int, int, str]:
    """Chooses the codec params for a tensor of ``dtype_name``.

    Args:
        dtype_name: torch dtype name (key of :data:`DTYPE_SIZES`), or ``"bytes"``.
        compression: ``None``/``"none"`` or ``"zstd"``.
        level: zstd level.
        byte_grouping: group bytes by element (and rotate bf16/fp32) before compressing.

    Returns:
        The ``params`` tuple passed to the native core.
    """
    if compression in (None, "none"):
        return ("none", 0, 1, "none")
    if compression != "zstd":
        raise ValueError(f"unknown compression {compression!r}; expected None or 'zstd'")
    planes, transform = _GROUPING.get(dtype_name, (1, "none")) if byte_grouping else (1, "none")
    return ("zstd", int(level), planes, transform)


@dataclass(frozen=True)
class StoredPiece:
    """One stored DCP chunk of a tensor: a hyper-rectangle of the full tensor.

    Attributes:
        offsets: position of the piece in the full tensor.
        sizes: shape of the piece.
        nbytes: raw (decoded) size; the raw bytes are the piece's row-major contiguous bytes.
        segments: ``segment`` tuples covering ``[0, nbytes)`` in order (absolute paths).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    segments: list[tuple[str, int, tuple[str, int, int, str], list[tuple[Any, ...]]]]


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of the checkpoint: dtype (torch name), full shape and its stored pieces."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[StoredPiece]
    requires_grad: bool = False
    memory_format: str = "contiguous_format"


@dataclass(frozen=True)
class StoredBytes:
    """A non-tensor value (DCP BYTE_IO): its serialized bytes, stored as one piece."""

    fqn: str
    nbytes: int
    segments: list[tuple[str, int, tuple[str, int, int, str], list[tuple[Any, ...]]]]


@dataclass
class CheckpointIndex:
    """The parsed metadata of a checkpoint (paths made absolute)."""

    path: str
    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    bytes_items: dict[str, StoredBytes] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)  # data file name -> size in bytes
    save_id: str = ""
    dcp_version: str | None = None
    planner_data: Any = None
    storage_meta: dict[str, Any] = field(default_factory=dict)
    created_by: str = ""


# ----------------------------------------------------------------------------------------------
# JSON helpers for DCP's planner_data (flatten mappings hold tuples of str/int).


def _tag(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"__tuple__": [_tag(v) for v in value]}
    if isinstance(value, list):
        return [_tag(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("planner_data dict keys must be str to be stored")
        return {k: _tag(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"planner_data value of type {type(value).__name__} is not storable")


def _untag(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_untag(v) for v in value["__tuple__"])
        return {k: _untag(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untag(v) for v in value]
    return value


def encode_planner_data(planner_data: Any) -> Any:
    """Encodes DCP planner_data as JSON; raises TypeError when it holds non-plain objects."""
    return _tag(planner_data)


# ----------------------------------------------------------------------------------------------
# Writing


def encode_metadata(doc: dict[str, Any]) -> bytes:
    """Serialises a metadata document (compact JSON, UTF-8)."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# ----------------------------------------------------------------------------------------------
# Reading and validation


def _fail(path: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{path}: {what}")


def _int_list(value: Any, where: str, path: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise _fail(path, f"{where} must be a list of non-negative integers")
    return tuple(value)


def _check_params(value: Any, where: str, path: str) -> tuple[str, int, int, str]:
    if not (isinstance(value, list) and len(value) == 4):
        raise _fail(path, f"{where}: codec params must be [codec, level, elem_size, transform]")
    codec, level, elem_size, transform = value
    if codec not in _CODECS or transform not in _TRANSFORMS:
        raise _fail(path, f"{where}: unknown codec {codec!r} or transform {transform!r}")
    if not isinstance(level, int) or not isinstance(elem_size, int) or elem_size not in (1, 2, 4, 8):
        raise _fail(path, f"{where}: bad level/elem_size {level!r}/{elem_size!r}")
    return (codec, level, elem_size, transform)


def _check_segments(
    raw: Any, nbytes: int, where: str, ckpt: str, files: dict[str, int]
) -> list[tuple[str, int, tuple[str, int, int, str], list[tuple[Any, ...]]]]:
    if not isinstance(raw, list):
        raise _fail(ckpt, f"{where}: segments must be a list")
    segments = []
    expect = 0
    for seg in raw:
        if not (isinstance(seg, dict) and {"file", "raw_begin", "codec", "chunks"} <= set(seg)):
            raise _fail(ckpt, f"{where}: malformed segment")
        name = seg["file"]
        if not isinstance(name, str) or name not in files:
            raise _fail(ckpt, f"{where}: segment refers to unknown data file {name!r}")
        raw_begin = seg["raw_begin"]
        if raw_begin != expect:
            raise _fail(ckpt, f"{where}: segments leave a gap or overlap at byte {expect}")
        params = _check_params(seg["codec"], where, ckpt)
        chunks = []
        size = files[name]
        for c in seg["chunks"]:
            if not (isinstance(c, list) and len(c) == 5 and isinstance(c[4], list)):
                raise _fail(ckpt, f"{where}: malformed chunk record")
            off, raw_len, checksum, transform, planes = c
            if not all(isinstance(v, int) and v >= 0 for v in (off, raw_len, checksum, transform)):
                raise _fail(ckpt, f"{where}: malformed chunk record")
            if len(planes) % 2 or not all(isinstance(v, int) and v >= 0 for v in planes):
                raise _fail(ckpt, f"{where}: malformed plane list")
            stored = sum(planes[1::2])
            if off + stored > size:
                raise _fail(ckpt, f"{where}: chunk at offset {off} (+{stored} bytes) lies past "
                                  f"the end of {name} ({size} bytes)")
            chunks.append((off, raw_len, checksum, transform, tuple(planes)))
            expect += raw_len
        segments.append((os.path.join(os.path.dirname(ckpt), name), raw_begin, params, chunks))
    if expect != nbytes:
        raise _fail(ckpt, f"{where}: segments hold {expect} bytes, expected {nbytes}")
    return segments


def read_index(path: str | os.PathLike[str]) -> CheckpointIndex:
    """Reads and validates the metadata of the checkpoint directory ``path``.

    Raises:
        FileNotFoundError: ``path`` has no metadata file (not a complete pyckpt checkpoint).
        CheckpointFormatError: the metadata is malformed, of an unknown version, or refers to
            data files that are missing or too short.
    """
    root = os.fspath(path)
    meta_path = os.path.join(root, METADATA_FILE)
    try:
        with open(meta_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        hint = ""
        if os.path.exists(os.path.join(root, ".metadata")):
            hint = " (it looks like a DCP FileSystemWriter checkpoint; use FileSystemReader)"
        raise FileNotFoundError(
            e.errno, f"not a complete pyckpt checkpoint: {METADATA_FILE} is missing{hint}",
            meta_path,
        ) from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(meta_path, f"metadata is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise _fail(meta_path, "not a pyckpt metadata file")
    version = doc.get("version")
    if version != FORMAT_VERSION:
        raise _fail(
            meta_path,
            f"format version {version!r} is not supported by this pyckpt "
            f"(reads version {FORMAT_VERSION}); upgrade pyckpt to read it",
        )

    files_raw = doc.get("files")
    if not isinstance(files_raw, dict):
        raise _fail(meta_path, "'files' must be an object")
    files: dict[str, int] = {}
    for name, size in files_raw.items():
        if not is_data_file(name) or os.path.basename(name) != name:
            raise _fail(meta_path, f"illegal data file name {name!r}")
        if not isinstance(size, int) or size < 0:
            raise _fail(meta_path, f"bad size for {name!r}")
        full = os.path.join(root, name)
        try:
            actual = os.stat(full).st_size
        except FileNotFoundError:
            raise FileNotFoundError(
                2, f"data file of checkpoint {root!r} is missing", full
            ) from None
        if actual < size:
            raise _fail(full, f"data file is truncated: {actual} bytes, expected {size}")
        files[name] = size

    index = CheckpointIndex(
        path=root,
        files=files,
        save_id=str(doc.get("save_id", "")),
        dcp_version=doc.get("dcp_version"),
        planner_data=_untag(doc.get("planner_data")),
        storage_meta=doc.get("storage_meta") or {},
        created_by=str(doc.get("created_by", "")),
    )
    items = doc.get("items")
    if not isinstance(items, dict):
        raise _fail(meta_path, "'items' must be an object")
    for fqn, item in items.items():
        where = f"item {fqn!r}"
        if not isinstance(item, dict):
            raise _fail(meta_path, f"{where} is malformed")
        kind = item.get("type")
        if kind == "bytes":
            nbytes = item.get("nbytes")
            if not isinstance(nbytes, int) or nbytes < 0:
                raise _fail(meta_path, f"{where}: bad nbytes")
            segs = _check_segments(item.get("segments"), nbytes, where, meta_path, files)
            index.bytes_items[fqn] = StoredBytes(fqn, nbytes, segs)
        elif kind == "tensor":
            dtype = item.get("dtype")
            if dtype not in DTYPE_SIZES:
                raise UnsupportedDtypeError(f"{meta_path}: {where} has unsupported dtype {dtype!r}")
            shape = _int_list(item.get("shape"), f"{where} shape", meta_path)
            pieces = []
            for n, piece in enumerate(item.get("pieces") or []):
                pw = f"{where} piece {n}"
                if not isinstance(piece, dict):
                    raise _fail(meta_path, f"{pw} is malformed")
                offsets = _int_list(piece.get("offsets"), f"{pw} offsets", meta_path)
                sizes = _int_list(piece.get("sizes"), f"{pw} sizes", meta_path)
                if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o + s > d for o, s, d in zip(offsets, sizes, shape)
                ):
                    raise _fail(meta_path, f"{pw} lies outside the tensor's shape {list(shape)}")
                numel = 1
                for s in sizes:
                    numel *= s
                nbytes = numel * DTYPE_SIZES[dtype]
                segs = _check_segments(piece.get("segments"), nbytes, pw, meta_path, files)
                pieces.append(StoredPiece(offsets, sizes, nbytes, segs))
            index.tensors[fqn] = StoredTensor(
                fqn=fqn,
                dtype=dtype,
                shape=shape,
                pieces=pieces,
                requires_grad=bool(item.get("requires_grad", False)),
                memory_format=str(item.get("memory_format", "contiguous_format")),
            )
        else:
            raise _fail(meta_path, f"{where}: unknown item type {kind!r}")
    return index


def tensor_index(path: str | os.PathLike[str]) -> dict[str, StoredTensor]:
    """Returns the stored tensors of checkpoint ``path`` by FQN (see :func:`read_index`)."""
    return read_index(path).tensors


def segments_to_json(
    segments: Iterable[tuple[str, int, Sequence[Any], Sequence[Sequence[Any]]]],
) -> list[dict[str, Any]]:
    """Turns ``segment`` tuples with data-file *names* into their JSON form."""
    return [
        {
            "file": name,
            "raw_begin": raw_begin,
            "codec": list(params),
            "chunks": [[c[0], c[1], c[2], c[3], list(c[4])] for c in chunks],
        }
        for name, raw_begin, params, chunks in segments
    ]
