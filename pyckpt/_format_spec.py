"""On-disk format: constants, limits, dtype tables, data file names, codec params and the
parsed index's types (``docs/FORMAT.md``). Imported through :mod:`pyckpt._format`.
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyckpt import _C

if TYPE_CHECKING:
    from pyckpt._C import CodecParams


#: Default of ``raw_threshold`` (:func:`codec_params_for`): a plane is stored zstd-compressed only
#: when that saves more than 3% of its bytes, otherwise raw (decoding it is then a copy).
RAW_THRESHOLD = 0.97


FORMAT_NAME = "pyckpt"
FORMAT_VERSION = 3  # one document (pyckpt.json); version 4 (sharded): pyckpt._format_shards
# Version 1: the schema without the metadata checksum; version 2: chunk checksums not bound to
# their place (see chunk_place_seed).
READABLE_VERSIONS = (1, 2, 3, 4)
PLACE_BOUND_VERSION = 3  # the first version whose chunk checksums are bound to their place
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

# ----------------------------------------------------------------------------------------------
# Codecs (docs/FORMAT.md): the one table of their names. A segment's codec is one of CODECS,
# which are also the values of the writers' ``compression=`` option and of the CLI's
# ``--compression`` (None meaning CODEC_NONE); a zstd segment's transform is a key of
# _TRANSFORM_CODES (the code its chunk records store).

CODEC_NONE = "none"  # raw bytes
CODEC_ZSTD = "zstd"  # a zstd frame per byte plane of a chunk
CODECS = (CODEC_NONE, CODEC_ZSTD)
#: How a segment of codec "none" is stored: ``[codec, level, elem_size, transform]``.
RAW_CODEC_PARAMS = (CODEC_NONE, 0, 1, "none")
_TRANSFORM_CODES = {"none": 0, "group": 1, "group_rotl1": 2}

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


def check_item_names(names: Iterable[str], origin: str) -> None:
    """Refuses an item name that is not Unicode text (a ``\\u`` escape of a lone surrogate: the
    JSON reads it, but no tensor name can be one, and the native readers cannot take it) with
    ``CheckpointFormatError`` naming ``origin`` and the item."""
    from pyckpt.errors import CheckpointFormatError

    for name in names:
        if not name.isascii():
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise CheckpointFormatError(
                    f"{origin}: items[{name!r}]: the name holds a lone surrogate (not Unicode "
                    "text)") from None


def chunk_place_seed(fqn: str, offsets: Sequence[int] = ()) -> int:
    """The place seed of a piece (format version 3): XXH64 (seed 0) of the item's name in UTF-8,
    a zero byte, and each of the piece's offsets as a 64-bit little-endian integer (none for a
    bytes item)."""
    head = fqn.encode("utf-8", "surrogatepass") + b"\0"
    return _C.xxh64(head + b"".join(o.to_bytes(8, "little") for o in offsets))


def chunk_place_key(seed: int, raw_offset: int) -> int:
    """The key that binds a chunk to its place (format version 3): XXH64 of the chunk's raw
    offset in its piece (64-bit little-endian) with the piece's :func:`chunk_place_seed` as seed.
    A record's ``xxh64`` is the XXH64 (seed 0) of the chunk's stored bytes XOR this key, so a
    record moved to another tensor, piece or offset no longer matches its bytes."""
    return _C.xxh64(raw_offset.to_bytes(8, "little"), seed)


@functools.lru_cache(maxsize=256)  # params are immutable: one object per distinct choice
def codec_params_for(
    dtype_name: str,
    compression: str | None,
    level: int,
    byte_grouping: bool,
    raw_threshold: float = RAW_THRESHOLD,
) -> CodecParams:
    """Chooses the codec params for a tensor of ``dtype_name``.

    Args:
        dtype_name: torch dtype name (key of :data:`DTYPE_SIZES`), or ``"bytes"``.
        compression: ``None`` or one of :data:`CODECS` (checked by the writer).
        level: zstd level.
        byte_grouping: group bytes by element (and rotate bf16/fp32) before compressing.
        raw_threshold: store a plane compressed only below this fraction of its raw size.

    Returns:
        The ``params`` passed to the native core.

    Raises:
        ValueError: ``level`` or ``raw_threshold`` out of range (from ``_C.CodecParams``, the
            one place codec params are checked).
    """
    if compression in (None, CODEC_NONE):
        return _C.CodecParams(*RAW_CODEC_PARAMS, raw_threshold)
    planes, transform = _GROUPING.get(dtype_name, (1, "none")) if byte_grouping else (1, "none")
    return _C.CodecParams(CODEC_ZSTD, level, planes, transform, raw_threshold)


def codec_params_json(params: CodecParams) -> list[Any]:
    """The JSON form of ``params``: ``[codec, level, elem_size, transform]``."""
    return [params.codec, params.level, params.elem_size, params.transform]


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
    segments: list[tuple[str, int, CodecParams, list[tuple[Any, ...]]]]


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
    segments: list[tuple[str, int, CodecParams, list[tuple[Any, ...]]]]


@dataclass
class CheckpointIndex:
    """The parsed and validated metadata of a checkpoint (paths made absolute)."""

    path: str
    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    bytes_items: dict[str, StoredBytes] = field(default_factory=dict)
    files: Mapping[str, int] = field(default_factory=dict)  # data file name -> size in bytes
    save_id: str = ""
    dcp_version: str | None = None
    planner_data: Any = None
    storage_meta: dict[str, Any] = field(default_factory=dict)
    created_by: str = ""
    version: int = FORMAT_VERSION  # format version of the metadata file
    local_files: set[str] = field(default_factory=set)  # data files present under ``path``
    # A version-4 checkpoint read lazily (``read_index(..., lazy=True)``): the global document
    # and the shards read so far (pyckpt._format_shards.ShardedIndex); ``tensors`` and
    # ``bytes_items`` are then empty.
    sharded: Any = None

