"""On-disk format v2: the JSON metadata file, its validation, and the DCP ``Metadata`` it rebuilds.

See ``docs/FORMAT.md`` for the specification. This module is the one place that knows the
format: :func:`build_metadata` writes the metadata document and :func:`read_index` is the single
validation path every reader goes through (DCP ``Reader``, ``pyckpt.load``, the CLI tools and the
consolidator). It does no I/O of tensor data (that is the native core's job) and never unpickles
anything.

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

import errno
import json
import logging
import math
import os
import re
import stat
import uuid
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from pyckpt import _C
from pyckpt.errors import CheckpointFormatError, UnsupportedDtypeError

if TYPE_CHECKING:
    from pyckpt._C import CodecParams

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "METADATA_FILE",
    "DTYPE_SIZES",
    "MEMORY_FORMATS",
    "MAX_METADATA_BYTES",
    "MAX_ITEMS",
    "MAX_FILES",
    "MAX_PIECES",
    "MAX_SEGMENTS",
    "MAX_CHUNKS",
    "MAX_CHUNK_BYTES",
    "MAX_NDIM",
    "MAX_NUMEL",
    "MAX_ITEM_BYTES",
    "MAX_PLANNER_DEPTH",
    "StoredPiece",
    "StoredTensor",
    "StoredBytes",
    "CheckpointIndex",
    "codec_params_for",
    "new_save_id",
    "data_file_name",
    "is_data_file",
    "data_file_rank",
    "read_index",
    "tensor_index",
    "build_metadata",
    "encode_metadata",
    "encode_planner_data",
    "rewrite_metadata",
    "segments_to_json",
]

logger = logging.getLogger(__name__)

FORMAT_NAME = "pyckpt"
FORMAT_VERSION = 2  # written by this pyckpt
READABLE_VERSIONS = (1, 2)  # version 1: the same schema without the metadata checksum
METADATA_FILE = "pyckpt.json"

# ----------------------------------------------------------------------------------------------
# Limits (docs/FORMAT.md, "Limits"). Metadata beyond them is refused with CheckpointFormatError
# before any data is read or any large buffer is allocated.

MAX_METADATA_BYTES = 1 << 30  # size of pyckpt.json
MAX_ITEMS = 1 << 22  # entries of "items"
MAX_FILES = 1 << 20  # entries of "files"
MAX_PIECES = 1 << 24  # pieces, over all tensors
MAX_SEGMENTS = 1 << 24  # segments, over all items
MAX_CHUNKS = 1 << 24  # chunk records, over all items
MAX_CHUNK_BYTES = _C.MAX_CHUNK_BYTES  # raw bytes of one chunk (256 MiB; the native reader's limit)
MAX_NDIM = 64  # dimensions of a tensor
MAX_NUMEL = 1 << 60  # elements of a tensor
MAX_ITEM_BYTES = 1 << 62  # raw bytes of a tensor or BYTE_IO item
MAX_PLANNER_DEPTH = 64  # nesting of planner_data
_MAX_FILE_BYTES = (1 << 63) - 1  # file offsets and sizes (off_t)
# A zstd frame cannot decode to more than 32768x its size (a 4-byte RLE block per 128 KiB block);
# twice that bounds what a zstd plane of a given stored length may claim to decode to.
_ZSTD_MAX_RATIO = 1 << 16
_ZSTD_LEVELS = (-(1 << 17), 22)  # ZSTD_minCLevel() .. ZSTD_maxCLevel()
# Irregular tilings (not a product of per-dimension cuts) with more pieces than this are refused:
# the exact overlap test for them is quadratic.
_MAX_IRREGULAR_PIECES = 1 << 14
_MAX_GRID_CELLS = 1 << 24

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
    "float4_e2m1fn_x2": 1,  # two fp4 values packed per byte (torch's element)
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

MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")

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

_TRANSFORM_CODES = {"none": 0, "group": 1, "group_rotl1": 2}
_BYTES_DTYPE = "uint8"  # BYTE_IO items are encoded as bytes

# Exactly the names the writer produces: ranks and file numbers without leading zeros, a save id
# of 12 lowercase hex digits. ASCII only (no \d: it matches other scripts' digits).
_SAVE_ID_RE = re.compile(r"[0-9a-f]{12}", re.ASCII)
_DATA_FILE_RE = re.compile(
    r"(0|[1-9][0-9]{0,9})-(0|[1-9][0-9]{0,9})\.([0-9a-f]{12})\.pyckpt", re.ASCII
)

# The metadata checksum is the document's last member; it covers every byte before it.
_SEAL_HEAD = b',"checksum":"xxh64:'
_SEAL_LEN = len(_SEAL_HEAD) + 16 + 2  # + 16 hex digits + '"}'
_SEAL_RE = re.compile(rb',"checksum":"xxh64:([0-9a-f]{16})"\}', re.ASCII)

_TOP_KEYS_V1 = frozenset(
    ("format", "version", "created_by", "save_id", "dcp_version", "storage_meta",
     "planner_data", "files", "items")
)
_TOP_KEYS_V2 = _TOP_KEYS_V1 | {"checksum"}
_TENSOR_KEYS = frozenset(
    ("type", "dtype", "shape", "requires_grad", "memory_format", "pieces")
)
_BYTES_KEYS = frozenset(("type", "nbytes", "segments"))
_PIECE_KEYS = frozenset(("offsets", "sizes", "segments"))
_SEGMENT_KEYS = frozenset(("file", "raw_begin", "codec", "chunks"))
_STORAGE_META_KEYS = frozenset(("modules",))
_JUST_INT = {int}


def new_save_id() -> str:
    """A fresh save id (12 lowercase hex digits), new for every save."""
    return uuid.uuid4().hex[:12]


def data_file_name(rank: int, k: int, save_id: str) -> str:
    """Returns the name of data file ``k`` of ``rank`` for one save."""
    return f"{rank}-{k}.{save_id}.pyckpt"


def is_data_file(name: str) -> bool:
    """True when ``name`` is exactly a pyckpt data file name (of any save)."""
    return _DATA_FILE_RE.fullmatch(name) is not None


def data_file_rank(name: str) -> int:
    """The rank that wrote data file ``name``. Raises ValueError for other names."""
    m = _DATA_FILE_RE.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a pyckpt data file name")
    return int(m.group(1))


def codec_params_for(
    dtype_name: str, compression: str | None, level: int, byte_grouping: bool
) -> CodecParams:
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
        return cast("CodecParams", ("none", 0, 1, "none"))
    if compression != "zstd":
        raise ValueError(f"unknown compression {compression!r}; expected None or 'zstd'")
    planes, transform = _GROUPING.get(dtype_name, (1, "none")) if byte_grouping else (1, "none")
    return cast("CodecParams", ("zstd", int(level), planes, transform))


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor of the checkpoint: dtype (torch name), full shape and its stored pieces."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[StoredPiece]
    requires_grad: bool = False
    memory_format: str = "contiguous_format"


@dataclass(frozen=True, slots=True)
class StoredBytes:
    """A non-tensor value (DCP BYTE_IO): its serialized bytes, stored as one piece."""

    fqn: str
    nbytes: int
    segments: list[tuple[str, int, tuple[str, int, int, str], list[tuple[Any, ...]]]]


@dataclass
class CheckpointIndex:
    """The parsed and validated metadata of a checkpoint (paths made absolute)."""

    path: str
    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    bytes_items: dict[str, StoredBytes] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)  # data file name -> size in bytes
    save_id: str = ""
    dcp_version: str | None = None
    planner_data: Any = None
    storage_meta: dict[str, Any] = field(default_factory=dict)
    created_by: str = ""
    version: int = FORMAT_VERSION  # format version of the metadata file
    local_files: set[str] = field(default_factory=set)  # data files present under ``path``


# ----------------------------------------------------------------------------------------------
# JSON helpers for DCP's planner_data (flatten mappings hold tuples of str/int).


def _tag(value: Any, depth: int = 0) -> Any:
    if depth > MAX_PLANNER_DEPTH:
        raise TypeError(f"planner_data is nested deeper than {MAX_PLANNER_DEPTH} levels")
    if isinstance(value, tuple):
        return {"__tuple__": [_tag(v, depth + 1) for v in value]}
    if isinstance(value, list):
        return [_tag(v, depth + 1) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("planner_data dict keys must be str to be stored")
        if "__tuple__" in value:
            raise TypeError("planner_data dicts must not use the reserved key '__tuple__'")
        return {k: _tag(v, depth + 1) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        raise TypeError(f"planner_data holds the non-finite float {value!r}, which JSON lacks")
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"planner_data value of type {type(value).__name__} is not storable")


def encode_planner_data(planner_data: Any) -> Any:
    """Encodes DCP planner_data as JSON; raises TypeError when it holds non-plain objects."""
    return _tag(planner_data)


# ----------------------------------------------------------------------------------------------
# Writing


def _seal(body: bytes) -> bytes:
    """Appends the checksum member to the compact JSON ``body`` of a non-empty object."""
    if not (body.startswith(b"{") and body.endswith(b"}")) or body == b"{}":
        raise ValueError("the metadata document must be a non-empty JSON object")
    head = body[:-1]
    return head + _SEAL_HEAD + b"%016x" % _C.xxh64(head) + b'"}'


def encode_metadata(doc: Mapping[str, Any]) -> bytes:
    """Serialises a metadata document: compact JSON (UTF-8) ending in its checksum member.

    A document of ``version`` 1 is written as version 1 files were, without a checksum.
    """
    if "checksum" in doc:
        raise ValueError("the metadata document already has a checksum member")
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )
    return body if doc.get("version") == 1 else _seal(body)


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


def build_metadata(
    metadata: Any,
    segments: Mapping[Any, Sequence[Any]],
    files: Mapping[str, int],
    *,
    save_id: str,
    created_by: str,
) -> bytes:
    """Builds the metadata file of one save (what ``Writer.finish`` writes).

    Args:
        metadata: DCP's global ``Metadata`` of the save.
        segments: ``MetadataIndex`` (fqn, and offsets for a tensor piece) -> the ``segment``
            tuples written for it by every rank, with data-file *names*.
        files: every data file of the save -> its exact size.
        save_id: the save's id (:func:`new_save_id`).
        created_by: the writer's name and version.

    Returns:
        The bytes of ``pyckpt.json``.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    items: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            segs = sorted(segments.get(MetadataIndex(fqn), []), key=lambda s: s[1])
            items[fqn] = {
                "type": "bytes",
                "nbytes": sum(c[1] for s in segs for c in s[3]),
                "segments": segments_to_json(segs),
            }
            continue
        props = md.properties
        pieces = []
        for chunk in md.chunks:
            segs = sorted(segments.get(MetadataIndex(fqn, chunk.offsets), []), key=lambda s: s[1])
            pieces.append(
                {
                    "offsets": list(chunk.offsets),
                    "sizes": list(chunk.sizes),
                    "segments": segments_to_json(segs),
                }
            )
        memory_format = str(props.memory_format).removeprefix("torch.")
        items[fqn] = {
            "type": "tensor",
            "dtype": str(props.dtype).removeprefix("torch."),
            "shape": list(md.size),
            "requires_grad": bool(props.requires_grad),
            "memory_format": memory_format if memory_format in MEMORY_FORMATS else
            "contiguous_format",
            "pieces": pieces,
        }

    try:
        planner_data = encode_planner_data(metadata.planner_data)
    except TypeError as e:
        logger.warning("pyckpt: planner_data not stored (%s)", e)
        planner_data = None
    storage_meta = metadata.storage_meta
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created_by": created_by,
        "save_id": save_id,
        "dcp_version": metadata.version,
        "storage_meta": {"modules": list(storage_meta.modules) if storage_meta else []},
        "planner_data": planner_data,
        "files": dict(files),
        "items": items,
    }
    return encode_metadata(doc)


def rewrite_metadata(
    path: str | os.PathLike[str], mutate: Callable[[dict[str, Any]], Any]
) -> None:
    """Rewrites the metadata of checkpoint ``path`` through ``mutate``, re-computing its checksum.

    For repairs and tests: the document is parsed without validation (its checksum member
    dropped), passed to ``mutate`` (which edits it in place or returns a replacement dict) and
    written back with a fresh checksum (none for a version-1 document). Not atomic.
    """
    meta = os.path.join(os.fspath(path), METADATA_FILE)
    with open(meta, "rb") as f:
        doc = json.loads(f.read())
    doc.pop("checksum", None)
    new = mutate(doc)
    data = encode_metadata(new if isinstance(new, dict) else doc)
    with open(meta, "wb") as f:
        f.write(data)


# ----------------------------------------------------------------------------------------------
# Reading: every reader goes through read_index().


class _Duplicate:
    """Stands for a JSON object that repeats a key (reported with its key path later)."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


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


def _describe(value: Any) -> str:
    if isinstance(value, _Duplicate):
        return f"an object that repeats the key {value.key!r}"
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _member(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class _Validator:
    """Walks a parsed metadata document, checking it and building the index."""

    def __init__(self, root: str, meta: str, version: int, all_files: bool = True) -> None:
        self.root = root
        self.all_files = all_files
        self.local_files: set[str] = set()
        self.meta = meta
        self.version = version
        self.files: dict[str, int] = {}
        self.paths: dict[str, str] = {}  # data file name -> absolute path (one string per file)
        self.ranges: dict[str, array[int]] = {}  # data file name -> [begin, end, begin, end...]
        self.params: dict[tuple[Any, ...], tuple[str, int, int, str]] = {}
        self.pieces = 0
        self.segments = 0
        self.chunks = 0

    # -- helpers ---------------------------------------------------------------------------

    def fail(self, path: str, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.meta}: {path}: {what}" if path else
                                     f"{self.meta}: {what}")

    def obj(self, value: Any, path: str, keys: frozenset[str] | None = None) -> dict[str, Any]:
        if type(value) is not dict:
            if isinstance(value, _Duplicate):
                raise self.fail(path, f"repeats the key {value.key!r}")
            raise self.fail(path, f"must be an object, got {_describe(value)}")
        if keys is not None and value.keys() != keys:
            missing = sorted(keys - value.keys())
            if missing:
                raise self.fail(_member(path, missing[0]), "missing")
            unknown = sorted(value.keys() - keys)
            raise self.fail(_member(path, unknown[0]), "unknown key")
        return value

    def lst(self, value: Any, path: str, limit: int | None = None) -> list[Any]:
        if type(value) is not list:
            raise self.fail(path, f"must be a list, got {_describe(value)}")
        if limit is not None and len(value) > limit:
            raise self.fail(path, f"has {len(value)} entries, more than {limit}")
        return value

    def int_(self, value: Any, path: str, lo: int, hi: int) -> int:
        if type(value) is not int:
            raise self.fail(path, f"must be an integer, got {_describe(value)}")
        if not lo <= value <= hi:
            raise self.fail(path, f"{value} is outside [{lo}, {hi}]")
        return value

    def str_(self, value: Any, path: str) -> str:
        if type(value) is not str:
            raise self.fail(path, f"must be a string, got {_describe(value)}")
        return value

    def count(self, attr: str, n: int, limit: int, what: str) -> None:
        total = getattr(self, attr) + n
        if total > limit:
            raise self.fail("", f"more than {limit} {what}: this pyckpt refuses such metadata")
        setattr(self, attr, total)

    # -- document ----------------------------------------------------------------------------

    def index(self, doc: dict[str, Any]) -> CheckpointIndex:
        self.obj(doc, "", _TOP_KEYS_V2 if self.version >= 2 else _TOP_KEYS_V1)
        created_by = self.str_(doc["created_by"], "created_by")
        save_id = self.str_(doc["save_id"], "save_id")
        if _SAVE_ID_RE.fullmatch(save_id) is None:
            raise self.fail("save_id", f"{save_id!r} is not 12 lowercase hex digits")
        dcp_version = doc["dcp_version"]
        if dcp_version is not None:
            self.str_(dcp_version, "dcp_version")
        sm = self.obj(doc["storage_meta"], "storage_meta", _STORAGE_META_KEYS)
        modules = [
            self.str_(m, f"storage_meta.modules[{i}]")
            for i, m in enumerate(self.lst(sm["modules"], "storage_meta.modules"))
        ]
        planner_data = self.untag(doc["planner_data"], "planner_data", 0)
        self.read_files(doc["files"])

        index = CheckpointIndex(
            path=self.root,
            files=self.files,
            save_id=save_id,
            dcp_version=dcp_version,
            planner_data=planner_data,
            storage_meta={"modules": modules},
            created_by=created_by,
            version=self.version,
            local_files=self.local_files,
        )
        items = self.obj(doc["items"], "items")
        if len(items) > MAX_ITEMS:
            raise self.fail("items", f"has {len(items)} entries, more than {MAX_ITEMS}")
        for fqn, raw in items.items():
            ip = f"items[{fqn!r}]"
            item = self.obj(raw, ip)
            kind = item.get("type")
            if kind == "tensor":
                self.obj(item, ip, _TENSOR_KEYS)
                index.tensors[fqn] = self.tensor(fqn, item, ip)
            elif kind == "bytes":
                self.obj(item, ip, _BYTES_KEYS)
                nbytes = self.int_(item["nbytes"], f"{ip}.nbytes", 0, MAX_ITEM_BYTES)
                segs = self.segments_of(item["segments"], nbytes, ip, _BYTES_DTYPE)
                index.bytes_items[fqn] = StoredBytes(fqn, nbytes, segs)
            elif "type" not in item:
                raise self.fail(f"{ip}.type", "missing")
            else:
                raise self.fail(f"{ip}.type", f"unknown item type {_describe(kind)}")
        self.check_packing(index)
        return index

    def read_files(self, raw: Any) -> None:
        files = self.obj(raw, "files")
        if len(files) > MAX_FILES:
            raise self.fail("files", f"has {len(files)} entries, more than {MAX_FILES}")
        for name, size in files.items():
            fp = f"files[{name!r}]"
            # Checked before anything is opened: a plain name inside the checkpoint directory.
            if not is_data_file(name):
                raise self.fail(fp, "illegal data file name (expected <rank>-<k>.<save_id>.pyckpt)")
            self.int_(size, fp, 0, _MAX_FILE_BYTES)
            full = os.path.join(self.root, name)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                if not self.all_files:  # node-local: held by another node
                    self.files[name] = size
                    self.paths[name] = full
                    self.ranges[name] = array("Q")
                    continue
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
            self.files[name] = size
            self.paths[name] = full
            self.ranges[name] = array("Q")
            self.local_files.add(name)

    def untag(self, value: Any, path: str, depth: int) -> Any:
        if depth > MAX_PLANNER_DEPTH:
            raise self.fail(path, f"nested deeper than {MAX_PLANNER_DEPTH} levels")
        t = type(value)
        if t is dict:
            if "__tuple__" in value:
                self.obj(value, path, frozenset(("__tuple__",)))
                inner = self.lst(value["__tuple__"], f"{path}.__tuple__")
                return tuple(
                    self.untag(v, f"{path}.__tuple__[{i}]", depth + 1) for i, v in enumerate(inner)
                )
            return {k: self.untag(v, f"{path}[{k!r}]", depth + 1) for k, v in value.items()}
        if t is list:
            return [self.untag(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
        if t is tuple:  # a chunk-like list the parser compacted (see _object_hook)
            return [self.untag(v, f"{path}[{i}]", depth + 1)
                    for i, v in enumerate(value[:4])] + [self.untag(list(value[4]),
                                                                    f"{path}[4]", depth + 1)]
        if value is None or t in (str, int, float, bool):
            return value
        raise self.fail(path, f"unexpected {_describe(value)}")

    # -- items -------------------------------------------------------------------------------

    def dims(self, value: Any, path: str, n: int | None) -> tuple[int, ...]:
        dims = self.lst(value, path, MAX_NDIM)
        if n is not None and len(dims) != n:
            raise self.fail(path, f"has {len(dims)} entries, the tensor has {n} dimensions")
        for i, d in enumerate(dims):
            if type(d) is not int or not 0 <= d <= MAX_NUMEL:
                raise self.fail(f"{path}[{i}]", f"must be an integer in [0, {MAX_NUMEL}], got "
                                                f"{_describe(d)}")
        return tuple(dims)

    def tensor(self, fqn: str, item: dict[str, Any], ip: str) -> StoredTensor:
        dtype = self.str_(item["dtype"], f"{ip}.dtype")
        if dtype not in DTYPE_SIZES:
            raise UnsupportedDtypeError(f"{self.meta}: {ip}.dtype: unsupported dtype {dtype!r}")
        esize = DTYPE_SIZES[dtype]
        shape = self.dims(item["shape"], f"{ip}.shape", None)
        numel = math.prod(shape)
        if numel > MAX_NUMEL or numel * esize > MAX_ITEM_BYTES:
            raise self.fail(f"{ip}.shape", f"{list(shape)} holds more than {MAX_NUMEL} elements "
                                           f"or {MAX_ITEM_BYTES} bytes")
        requires_grad = item["requires_grad"]
        if type(requires_grad) is not bool:
            raise self.fail(f"{ip}.requires_grad", f"must be true or false, got "
                                                   f"{_describe(requires_grad)}")
        memory_format = item["memory_format"]
        if memory_format not in MEMORY_FORMATS or type(memory_format) is not str:
            raise self.fail(f"{ip}.memory_format", f"must be one of {list(MEMORY_FORMATS)}, got "
                                                   f"{_describe(memory_format)}")
        raw_pieces = self.lst(item["pieces"], f"{ip}.pieces")
        self.count("pieces", len(raw_pieces), MAX_PIECES, "pieces")
        pieces = []
        for n, raw in enumerate(raw_pieces):
            pp = f"{ip}.pieces[{n}]"
            piece = self.obj(raw, pp, _PIECE_KEYS)
            offsets = self.dims(piece["offsets"], f"{pp}.offsets", len(shape))
            sizes = self.dims(piece["sizes"], f"{pp}.sizes", len(shape))
            for d, (o, s, full) in enumerate(zip(offsets, sizes, shape)):
                if o > full or s > full - o:
                    raise self.fail(pp, f"offsets {list(offsets)} + sizes {list(sizes)} leave "
                                        f"the tensor's shape {list(shape)} (dimension {d})")
            nbytes = math.prod(sizes) * esize
            segs = self.segments_of(piece["segments"], nbytes, pp, dtype)
            pieces.append(StoredPiece(offsets, sizes, nbytes, segs))
        self.check_tiling(ip, shape, numel, pieces)
        return StoredTensor(fqn, dtype, shape, pieces, requires_grad, memory_format)

    def codec(self, value: Any, path: str, dtype: str) -> tuple[str, int, int, str]:
        if type(value) is list and len(value) == 4:
            cached = self.params.get((dtype, *value)) if all(
                type(v) in (str, int) for v in value) else None
            if cached is not None:
                return cached
        params = self.lst(value, path)
        if len(params) != 4:
            raise self.fail(path, "must be [codec, level, elem_size, transform]")
        codec, level, elem_size, transform = params
        if codec == "none" and type(codec) is str:
            if params != ["none", 0, 1, "none"] or type(level) is not int or type(
                    elem_size) is not int:
                raise self.fail(path, f"codec 'none' is stored as [\"none\", 0, 1, \"none\"], "
                                      f"got {params}")
        elif codec == "zstd" and type(codec) is str:
            self.int_(level, f"{path}[1]", *_ZSTD_LEVELS)
            if type(transform) is not str or transform not in _TRANSFORM_CODES:
                raise self.fail(f"{path}[3]", f"unknown transform {_describe(transform)}")
            expect = (1, "none") if transform == "none" else _GROUPING.get(dtype)
            if type(elem_size) is not int or (elem_size, transform) != expect:
                raise self.fail(path, f"elem_size {_describe(elem_size)} and transform "
                                      f"{transform!r} do not fit dtype {dtype}")
        else:
            raise self.fail(f"{path}[0]", f"unknown codec {_describe(codec)}")
        result = (codec, level, elem_size, transform)
        key = (dtype, *params)
        self.params[key] = result
        return result

    def segments_of(
        self, value: Any, nbytes: int, where: str, dtype: str
    ) -> list[tuple[str, int, tuple[str, int, int, str], list[tuple[Any, ...]]]]:
        raw_segments = self.lst(value, f"{where}.segments")
        self.count("segments", len(raw_segments), MAX_SEGMENTS, "segments")
        out = []
        expect = 0
        for s, raw in enumerate(raw_segments):
            sp = f"{where}.segments[{s}]"
            seg = self.obj(raw, sp, _SEGMENT_KEYS)
            name = seg["file"]
            if type(name) is not str or name not in self.files:
                raise self.fail(f"{sp}.file", f"{_describe(name)} is not a data file listed in "
                                              "'files'")
            raw_begin = self.int_(seg["raw_begin"], f"{sp}.raw_begin", 0, MAX_ITEM_BYTES)
            if raw_begin != expect:
                raise self.fail(f"{sp}.raw_begin", f"segments leave a gap or overlap: {raw_begin}"
                                                   f", expected {expect}")
            params = self.codec(seg["codec"], f"{sp}.codec", dtype)
            chunks = self.lst(seg["chunks"], f"{sp}.chunks")
            self.count("chunks", len(chunks), MAX_CHUNKS, "chunk records")
            expect += self.chunks_of(chunks, name, params, sp)
            out.append((self.paths[name], raw_begin, params, chunks))
        if expect != nbytes:
            raise self.fail(f"{where}.segments", f"hold {expect} raw bytes, expected {nbytes}")
        return out

    def chunks_of(self, chunks: list[Any], name: str, params: tuple[str, int, int, str],
                  sp: str) -> int:
        """Validates the (parser-compacted) chunk records of a segment; returns raw bytes."""
        size = self.files[name]
        ranges = self.ranges[name]
        codec, _, E, transform = params
        group_code = _TRANSFORM_CODES[transform] if codec == "zstd" and E > 1 else 0
        total = 0
        for j, c in enumerate(chunks):
            if type(c) is not tuple:  # the parser compacts every well-formed record
                raise self.fail(f"{sp}.chunks[{j}]", "must be [file_offset, raw_len, xxh64, "
                                                     "transform, [plane modes and lengths]]")
            off, raw_len, checksum, tcode, planes = c
            if type(off) is not int or not 0 <= off <= _MAX_FILE_BYTES:
                raise self.fail(f"{sp}.chunks[{j}][0]", f"bad file offset {_describe(off)}")
            if type(raw_len) is not int or not 1 <= raw_len <= MAX_CHUNK_BYTES:
                raise self.fail(f"{sp}.chunks[{j}][1]", f"raw_len must be an integer in "
                                                        f"[1, {MAX_CHUNK_BYTES}], got "
                                                        f"{_describe(raw_len)}")
            if type(checksum) is not int or not 0 <= checksum < 1 << 64:
                raise self.fail(f"{sp}.chunks[{j}][2]", f"xxh64 must be an integer in "
                                                        f"[0, 2**64), got {_describe(checksum)}")
            grouped = group_code and raw_len % E == 0
            want = group_code if grouped else 0
            if type(tcode) is not int or tcode != want:
                raise self.fail(f"{sp}.chunks[{j}][3]", f"transform code {_describe(tcode)} "
                                                        f"disagrees with the codec params "
                                                        f"{list(params)} (expected {want})")
            nplanes = E if grouped else 1
            if len(planes) != 2 * nplanes:
                raise self.fail(f"{sp}.chunks[{j}][4]", f"must list {nplanes} (mode, length) "
                                                        "plane pairs")
            n = raw_len // nplanes
            stored = 0
            for p in range(nplanes):
                mode, length = planes[2 * p], planes[2 * p + 1]
                if type(mode) is not int or type(length) is not int:
                    raise self.fail(f"{sp}.chunks[{j}][4]", "plane modes and lengths must be "
                                                            "integers")
                if mode == 0:
                    ok = length == n
                elif mode == 1:
                    ok = codec == "zstd" and 0 < length < n and n <= length * _ZSTD_MAX_RATIO
                else:
                    ok = False
                if not ok:
                    raise self.fail(f"{sp}.chunks[{j}][4]", f"plane {p} (mode {mode}, "
                                                            f"{length} bytes) cannot hold {n} "
                                                            "raw bytes")
                stored += length
            if off + stored > size:
                raise self.fail(f"{sp}.chunks[{j}]", f"stored bytes [{off}, {off + stored}) lie "
                                                     f"past the end of {name} ({size} bytes)")
            ranges.append(off)
            ranges.append(off + stored)
            total += raw_len
        return total

    # -- whole-checkpoint checks -------------------------------------------------------------

    def check_tiling(self, ip: str, shape: tuple[int, ...], numel: int,
                     pieces: list[StoredPiece]) -> None:
        """The pieces must tile the tensor: no gap, no overlap (empty pieces are allowed)."""
        if numel == 0:
            return  # every piece is inside the shape, hence empty
        boxes = [(n, p) for n, p in enumerate(pieces) if p.nbytes]
        covered = sum(math.prod(p.sizes) for _, p in boxes)
        if covered != numel:
            raise self.fail(f"{ip}.pieces", f"cover {covered} element(s) of the tensor's {numel} "
                                            f"(shape {list(shape)}): "
                                            + ("a piece is missing" if covered < numel else
                                               "pieces overlap"))
        if len(boxes) == 1:
            return
        varying = [d for d in range(len(shape))
                   if any(p.offsets[d] or p.sizes[d] != shape[d] for _, p in boxes)]
        if len(varying) == 1:  # slices along one dimension: sort and compare neighbours
            d = varying[0]
            order = sorted(boxes, key=lambda b: b[1].offsets[d])
            for (n0, a), (n1, b) in zip(order, order[1:]):
                if b.offsets[d] < a.offsets[d] + a.sizes[d]:
                    raise self.fail(f"{ip}.pieces[{n1}]", f"overlaps {ip}.pieces[{n0}]")
            return
        # Cut every varying dimension at every piece boundary; each piece covers a box of grid
        # cells, and the pieces tile the tensor iff every cell is covered exactly once. The
        # counters are uint8: with the element total already equal, a count that wraps past
        # 255 still leaves some other cell at 0.
        cuts = [sorted({0, shape[d]} | {p.offsets[d] for _, p in boxes}
                       | {p.offsets[d] + p.sizes[d] for _, p in boxes}) for d in varying]
        cells = math.prod(len(c) - 1 for c in cuts)
        if cells > min(_MAX_GRID_CELLS, 16 * len(boxes) + 4096):
            self.check_irregular_tiling(ip, shape, boxes)
            return
        import numpy as np

        where = [{v: i for i, v in enumerate(c)} for c in cuts]
        grid = np.zeros([len(c) - 1 for c in cuts], dtype=np.uint8)
        for _, p in boxes:
            grid[tuple(slice(w[p.offsets[d]], w[p.offsets[d] + p.sizes[d]])
                       for w, d in zip(where, varying))] += 1
        bad = np.argwhere(grid != 1)
        if len(bad):
            cell = [int(v) for v in bad[0]]
            element = [0] * len(shape)
            for k, d in enumerate(varying):
                element[d] = cuts[k][cell[k]]
            count = int(grid[tuple(cell)])
            raise self.fail(f"{ip}.pieces", f"element {element} is covered "
                                            + ("by no piece" if count == 0 else "more than once"))

    def check_irregular_tiling(self, ip: str, shape: tuple[int, ...],
                               boxes: list[tuple[int, StoredPiece]]) -> None:
        if len(boxes) > _MAX_IRREGULAR_PIECES:
            raise self.fail(f"{ip}.pieces", f"{len(boxes)} pieces that are not a product of "
                                            f"per-dimension cuts (at most "
                                            f"{_MAX_IRREGULAR_PIECES} supported)")
        try:
            _C.check_tiling(ip, list(shape), [(list(p.offsets), list(p.sizes), f"pieces[{n}]")
                                              for n, p in boxes])
        except CheckpointFormatError as e:
            raise self.fail(f"{ip}.pieces", str(e)) from None

    def check_packing(self, index: CheckpointIndex) -> None:
        """Every data file is its chunks back to back: no overlap, no gap, nothing after."""
        import numpy as np

        for name, ranges in self.ranges.items():
            size = self.files[name]
            r = np.frombuffer(ranges, dtype=np.uint64).reshape(-1, 2)
            r = r[np.argsort(r[:, 0], kind="stable")]
            if len(r) == 0:
                if size:
                    raise self.fail(f"files[{name!r}]", f"{size} bytes but no chunk is stored "
                                                        "in it")
                continue
            ends = np.concatenate(([0], r[:-1, 1]))
            bad = np.nonzero(r[:, 0] != ends)[0]
            if len(bad):
                i = int(bad[0])
                off, prev = int(r[i, 0]), int(ends[i])
                where = self.chunk_path(index, name, off)
                if off < prev:
                    raise self.fail(where, f"stored bytes at offset {off} of {name} overlap "
                                           f"another chunk's (which end at {prev})")
                raise self.fail(where, f"bytes [{prev}, {off}) of {name} belong to no chunk")
            if int(r[-1, 1]) != size:
                raise self.fail(f"files[{name!r}]", f"records {size} bytes, its chunks end at "
                                                    f"{int(r[-1, 1])}")

    def chunk_path(self, index: CheckpointIndex, name: str, off: int) -> str:
        """The key path of the chunk stored at ``off`` of data file ``name`` (for messages)."""
        full = self.paths[name]
        found = f"files[{name!r}]"
        walk: list[tuple[str, list[Any]]] = [
            (f"items[{b.fqn!r}]", b.segments) for b in index.bytes_items.values()
        ] + [
            (f"items[{t.fqn!r}].pieces[{n}]", p.segments)
            for t in index.tensors.values() for n, p in enumerate(t.pieces)
        ]
        for where, segments in walk:
            for s, (path, _, _, chunks) in enumerate(segments):
                if path != full:
                    continue
                for j, c in enumerate(chunks):
                    if c[0] == off:
                        found = f"{where}.segments[{s}].chunks[{j}]"
        return found


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


def _parse(holder: list[bytes], meta: str) -> tuple[dict[str, Any], int]:
    """Checks the metadata checksum, then parses strict UTF-8 JSON; returns (doc, version).

    ``holder`` holds the file's bytes; they are released once decoded, before the parse.
    """
    raw = holder.pop()
    seal = _SEAL_RE.fullmatch(raw, len(raw) - _SEAL_LEN) if len(raw) > _SEAL_LEN else None
    if seal is not None:
        recorded = int(seal.group(1), 16)
        actual = _C.xxh64(memoryview(raw)[: len(raw) - _SEAL_LEN])
        if actual != recorded:
            raise CheckpointFormatError(
                f"{meta}: metadata checksum mismatch (recorded xxh64:{recorded:016x}, computed "
                f"xxh64:{actual:016x}): the file is damaged"
            )
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
    doc, version = _parse([raw], meta)
    return _Validator(root, meta, version, all_files).index(doc)


def tensor_index(path: str | os.PathLike[str]) -> dict[str, StoredTensor]:
    """Returns the stored tensors of checkpoint ``path`` by FQN (see :func:`read_index`)."""
    return read_index(path).tensors
