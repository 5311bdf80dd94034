"""Type stubs for the private native module ``pyckpt._C`` (each component owns one section)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, NamedTuple, TypeAlias, TypedDict

from typing_extensions import Buffer

__version__: str
zstd_version: str

# --- core ---

CodecName = Literal["none", "zstd"]
TransformName = Literal["none", "group", "group_rotl1"]

class CodecParams:
    """How a run of chunks is encoded; immutable, validated when made (ValueError naming the
    field). codec "none" stores raw bytes (transform ignored); "zstd" compresses. elem_size in
    {1, 2, 4, 8}. transform "group" splits elements into byte planes, "group_rotl1" first rotates
    each element left by one bit (bf16/fp32: the whole exponent lands in the top byte). A plane
    is stored compressed only below raw_threshold * its raw size (in (0, 1], default 0.97).
    Equal params compare and hash equal; they pickle."""

    def __init__(
        self,
        codec: str,
        level: int = 1,
        elem_size: int = 1,
        transform: str = "none",
        raw_threshold: float = 0.97,
    ) -> None: ...
    @property
    def codec(self) -> CodecName: ...
    @property
    def level(self) -> int: ...
    @property
    def elem_size(self) -> int: ...
    @property
    def transform(self) -> TransformName: ...
    @property
    def raw_threshold(self) -> float: ...

# --- named tuple types (csrc/bindings/records.cpp) ---
# Every tuple a binding takes or returns has one of these types. At run time inputs may also be
# plain tuples (or lists) of the same layout (the annotations below ask for the named type where
# pyckpt builds the value); outputs are instances, except Chunk and Segment records: they
# are made in bulk (by the metadata readers, and by write_items, whose results travel pickled to
# the coordinator, where a tuple subclass pickles many times slower than a tuple), so they come
# as plain tuples of the layout (ChunkRecord, SegmentRecord) and read by position or unpacking.

class Chunk(NamedTuple):
    """A chunk record: stored bytes at file_offset, decoding to raw_len bytes, checksum xxh64;
    transform 0 none / 1 group / 2 group_rotl1; planes the flat tuple (mode0, len0, mode1, len1,
    ...), mode 0 raw / 1 zstd frame; stored_len = sum of the lens."""

    file_offset: int
    raw_len: int
    xxh64: int
    transform: int
    planes: tuple[int, ...]

#: A chunk record as made in bulk (a plain tuple of Chunk's layout).
ChunkRecord: TypeAlias = tuple[int, int, int, int, tuple[int, ...]]
#: What the bindings accept as a chunk record (a Chunk, a ChunkRecord, a list decoded from JSON).
ChunkRecordLike: TypeAlias = Sequence[int | Sequence[int]]

class Segment(NamedTuple):
    """Chunks of one data file (or `sources` name) holding an item's raw bytes from raw_begin
    on, back to back, encoded with params."""

    path: str  # the binding accepts any os.PathLike too
    raw_begin: int
    params: CodecParams
    chunks: Sequence[ChunkRecord]

#: A segment as made in bulk (a plain tuple of Segment's layout).
SegmentRecord: TypeAlias = tuple[str, int, CodecParams, Sequence[ChunkRecord]]
SegmentLike: TypeAlias = Segment | SegmentRecord

class WriteItem(NamedTuple):
    """An item of write_items. SAFETY: data_ptr must point to nbytes readable bytes that stay
    alive and unmodified until write_items returns."""

    name: str
    data_ptr: int
    nbytes: int
    params: CodecParams

class WrittenItem(NamedTuple):
    """write_items' result per item: file offset of its first stored byte, stored bytes, its
    chunk records."""

    offset: int
    stored_bytes: int
    chunks: list[ChunkRecord]

class ReadRequest(NamedTuple):
    """One read into a caller's buffer: raw bytes [lo, hi) of the item ``name`` (named by
    errors) stored in ``segments``, to address ``dst``. SAFETY: dst must point to hi - lo
    writable bytes (read_stored: the segments' stored bytes) kept alive until the call returns."""

    name: str
    segments: Sequence[SegmentLike]
    lo: int
    hi: int
    dst: int

class ReadStats(NamedTuple):
    """Bytes read and chunks decoded (read_requests), copied (read_stored) or checked
    (verify_segments)."""

    bytes_read: int
    chunks: int

class MemoryRange(NamedTuple):
    """Bytes of a MemorySource from ``offset`` on (lent for the call, no copy)."""

    offset: int
    data: Buffer

class MemorySource(NamedTuple):
    """A source held in memory: its size and its non-overlapping byte ranges."""

    size: int
    ranges: list[MemoryRange]

class EncodedChunk(NamedTuple):
    """encode_chunk's result: the stored bytes and the chunk record."""

    stored: bytes
    record: ChunkRecord

class PoolStats(TypedDict):
    block_bytes: int
    max_blocks: int
    allocated: int
    in_use: int
    peak_in_use: int
    acquires: int
    pinned: bool

class ThreadPool:
    """Fixed pool of native worker threads (started lazily; joined by shutdown())."""

    def __init__(self, num_threads: int) -> None: ...
    @property
    def size(self) -> int: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> ThreadPool: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

def set_host_cache_limit(bytes: int) -> None:
    """Bound on the idle pageable host memory the process keeps for reuse; 0 keeps none."""

def host_cache_info() -> dict[str, int]:
    """The host cache: ``{"bytes": held now, "limit": its bound}``."""

def set_read_piece_bytes(bytes: int) -> None:
    """Bytes per read call of every native file read (process-wide; at least 4096)."""

def read_piece_bytes() -> int:
    """Bytes per read call of every native file read."""

class BufferPool:
    """Bounded pool of 4 KiB-aligned host blocks (block_bytes rounded up to 4096)."""

    def __init__(self, block_bytes: int, max_blocks: int) -> None: ...
    @property
    def block_bytes(self) -> int: ...
    def stats(self) -> PoolStats: ...

def xxh64(data: Buffer, seed: int = 0) -> int: ...
def block_digests(
    buffers: Sequence[Any], block: int, seeds: Sequence[int], threads: int = 1
) -> list[int]: ...
def sampled_digests(
    buffers: Sequence[Any], block: int, count: int, threads: int = 1
) -> list[int]: ...
def sampled_blocks(nbytes: int, block: int, count: int, first: int, last: int) -> list[int]: ...
def max_encoded_size(raw_len: int, params: CodecParams) -> int: ...
def zstd_frame(data: Buffer, level: int = 3) -> bytes: ...
def zstd_unframe(data: Buffer, max_len: int) -> bytes: ...
def encode_chunk(data: Buffer, params: CodecParams) -> EncodedChunk: ...
def encode_chunk_into(data: Buffer, params: CodecParams, out: Buffer) -> ChunkRecord: ...
def decode_chunk(
    stored: Buffer, record: ChunkRecordLike, params: CodecParams, out: Buffer
) -> None: ...
def group_bytes(data: Buffer, elem_size: int, rotl1: bool, out: Buffer) -> None: ...
def ungroup_bytes(planes: Buffer, elem_size: int, rotl1: bool, out: Buffer) -> None: ...

class FileWriter:
    """Writes ``path`` through a sibling temp file renamed into place by commit().

    Used by one thread at a time. ``direct``: "auto" (O_DIRECT where accepted), "on", "off".
    ``staging`` reuses a caller-owned BufferPool for the staging blocks (must not be the pool
    passed as ``blocks`` to write_items). ``_test_fault`` ("direct_open" / "direct_write") makes
    the writer act as if O_DIRECT were refused; tests only.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        direct: Literal["auto", "on", "off"] = "auto",
        fsync: bool = True,
        staging_block_bytes: int = 8 << 20,
        staging_blocks: int = 3,
        *,
        staging: BufferPool | None = None,
        _test_fault: str = "",
    ) -> None: ...
    def append(self, data: Buffer) -> int: ...
    def write_items(
        self, items: Sequence[WriteItem], chunk_bytes: int, pool: ThreadPool, blocks: BufferPool
    ) -> list[WrittenItem]: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...
    @property
    def size(self) -> int: ...
    @property
    def direct(self) -> bool: ...
    @property
    def path(self) -> str: ...
    @property
    def temp_path(self) -> str: ...
    @property
    def committed(self) -> bool: ...
    def __enter__(self) -> FileWriter: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

#: {source name: MemorySource}: non-overlapping byte ranges already in memory (downloaded
#: objects, chunks received from a peer); other names are files.
MemorySources: TypeAlias = Mapping[str, MemorySource]

def read_requests(
    requests: Sequence[ReadRequest], pool: ThreadPool, sources: MemorySources | None = None
) -> ReadStats: ...
def read_stored(
    requests: Sequence[ReadRequest], pool: ThreadPool, sources: MemorySources | None = None
) -> ReadStats: ...
def verify_segments(
    name: str, segments: Sequence[SegmentLike], pool: ThreadPool,
    sources: MemorySources | None = None,
) -> ReadStats: ...

class Block:
    """Encoded bytes handed to an uploader: a read-only buffer (no copy)."""

    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...

class BlockWriter:
    """Encodes chunks into blocks of about ``block_bytes`` and calls ``on_block(block)`` with
    each, in order (the last one in commit()); an exception of ``on_block`` propagates as itself.
    Up to ``spare_blocks`` buffers of blocks the uploader has let go of are reused for later
    blocks. Used by one thread at a time."""

    def __init__(
        self, name: str, block_bytes: int, on_block: Callable[[Block], object],
        spare_blocks: int = 0,
    ) -> None: ...
    def append(self, data: Buffer) -> int: ...
    def write_items(
        self, items: Sequence[WriteItem], chunk_bytes: int, pool: ThreadPool, blocks: BufferPool
    ) -> list[WrittenItem]: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...
    @property
    def size(self) -> int: ...
    @property
    def committed(self) -> bool: ...
    @property
    def reused_blocks(self) -> int: ...

#: Largest raw length of one chunk: the writer refuses larger chunk_bytes, readers larger records.
MAX_CHUNK_BYTES: int

# --- cuda ---

class CudaRuntime:
    """A CUDA runtime loaded at run time (``available`` is False without CUDA)."""

    @staticmethod
    def load(path: str | None = None) -> CudaRuntime: ...
    @property
    def available(self) -> bool: ...
    @property
    def error(self) -> str: ...
    @property
    def library(self) -> str: ...
    @property
    def reused_loaded(self) -> bool: ...
    @property
    def device_count(self) -> int: ...

class HostBlock:
    """A leased 4 KiB-aligned pool block (buffer protocol, writable)."""

    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def release(self) -> None: ...
    def __enter__(self) -> HostBlock: ...
    def __exit__(self, *args: object) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

class PinnedPool:
    """Bounded pool of host blocks, page-locked through ``runtime`` (plain memory if None)."""

    def __init__(self, runtime: CudaRuntime | None, block_bytes: int, max_blocks: int) -> None: ...
    @property
    def block_bytes(self) -> int: ...
    def acquire(self) -> HostBlock: ...
    def try_acquire(self) -> HostBlock | None: ...
    def stats(self) -> dict[str, Any]: ...

class StageItem(NamedTuple):
    """Device bytes for Stager.stream_to_host (kept alive until the stream is done)."""

    name: str
    device_ptr: int
    nbytes: int

class CopySpec(NamedTuple):
    """A copy of Stager.copy_into / upload: nbytes between ``offset`` in the host block and
    ``device_ptr``."""

    offset: int
    device_ptr: int
    nbytes: int
    name: str

class StagePiece(NamedTuple):
    """Bytes of a StagedBlock: nbytes of StageItem number ``item`` from item_offset on, at
    block_offset in the block."""

    item: int
    item_offset: int
    block_offset: int
    nbytes: int

class StagerEvent:
    def wait(self) -> None: ...
    def ready(self) -> bool: ...

class StagedBlock:
    """A pool block filled by device-to-host copies (buffer protocol)."""

    def wait(self) -> None: ...
    def ready(self) -> bool: ...
    @property
    def pieces(self) -> list[StagePiece]: ...
    @property
    def used(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def release(self) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

class D2HStream:
    def next(self) -> StagedBlock | None: ...
    @property
    def done(self) -> bool: ...

class Stager:
    """Device<->host staging through pool blocks on a side stream (one device)."""

    def __init__(self, runtime: CudaRuntime, pool: PinnedPool, device: int) -> None: ...
    def stream_to_host(self, items: Sequence[StageItem], stream: int) -> D2HStream: ...
    def copy_into(
        self, region: HostBlock, specs: Sequence[CopySpec], stream: int
    ) -> StagerEvent: ...
    def acquire_upload_block(self) -> HostBlock: ...
    def upload(self, block: HostBlock, specs: Sequence[CopySpec]) -> None: ...
    def order_after(self, stream: int) -> None: ...
    def finish_uploads(self, stream: int) -> None: ...
    def synchronize(self) -> None: ...
    @property
    def side_stream(self) -> int: ...
    @property
    def device(self) -> int: ...
    def stats(self) -> dict[str, int]: ...

# --- safetensors ---

MAX_SAFETENSORS_HEADER: int
#: Most tensors one safetensors header may declare.
MAX_SAFETENSORS_TENSORS: int
#: Most dimensions of one safetensors tensor.
MAX_SAFETENSORS_RANK: int

class HeaderTensor(NamedTuple):
    """A tensor of a safetensors header: data bytes [begin, end) of the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

class TensorSpec(NamedTuple):
    """A tensor to declare in a safetensors header."""

    name: str
    dtype: str
    shape: Sequence[int]

class TensorSpan(NamedTuple):
    """Where safetensors_header placed a tensor: data bytes [begin, end) of the data section."""

    name: str
    begin: int
    end: int

class EmittedHeader(NamedTuple):
    """safetensors_header's result: the header (with its 8-byte length), the tensors' spans
    sorted by name, the size of the data section."""

    header: bytes
    layout: list[TensorSpan]
    data_bytes: int

class TileBlock(NamedTuple):
    """A block for check_tiling; ``origin`` names it in errors."""

    offsets: Sequence[int]
    sizes: Sequence[int]
    origin: str

def safetensors_dtype_bits(dtype: str) -> int: ...
def read_safetensors_header(path: str) -> dict[str, object]: ...
def parse_safetensors_header(
    json: bytes, file_size: int, origin: str = "<bytes>"
) -> dict[str, object]: ...
def safetensors_header(
    tensors: Sequence[TensorSpec], metadata: Mapping[str, str]
) -> EmittedHeader: ...
def check_tiling(name: str, shape: Sequence[int], blocks: Sequence[TileBlock]) -> None: ...

# --- metadata reader (core/pyckpt_index.hpp) ---
class PyckptIndex:
    @property
    def version(self) -> int: ...
    @property
    def created_by(self) -> str: ...
    @property
    def save_id(self) -> str: ...
    @property
    def modules(self) -> list[str]: ...
    @property
    def dcp_version(self) -> str | None: ...
    @property
    def planner_data(self) -> Any: ...
    @property
    def files(self) -> list[tuple[str, int]]: ...
    def materialize(
        self,
        paths: list[str],
        tensor_cls: tuple[type, tuple[str, ...]],
        piece_cls: tuple[type, tuple[str, ...]],
        bytes_cls: Any,
        codec_cls: Any,
    ) -> tuple[dict[str, Any], dict[str, Any]]: ...

def parse_pyckpt_index(
    doc: bytes | bytearray | memoryview,
    origin: str,
    *,
    disjoint_pieces: int = 0,
    rank: int = -1,
    limits: dict[str, int] | None = None,
) -> PyckptIndex: ...
def pyckpt_index_tables() -> tuple[dict[str, Any], dict[str, tuple[int, int, str]]]: ...

class StitchChunk(NamedTuple):
    """The source of a StitchItem stored as one encoded chunk."""

    chunk: ChunkRecord
    params: CodecParams

class FloatCast(NamedTuple):
    """Float elements cast on the way: safetensors dtype names among F64, F32, F16, BF16
    (to_dtype: not F64)."""

    from_dtype: str
    to_dtype: str

class StitchItem(NamedTuple):
    """One copy job of stitch(): the elements [lo, hi) of tensor ``name`` (full ``shape``) that
    a source block of ``sizes`` at ``offsets`` in it holds, elements of ``item`` bytes."""

    name: str
    shape: Sequence[int]
    offsets: Sequence[int]  # the block's offsets in the tensor
    sizes: Sequence[int]  # the block's sizes
    item: int  # bytes per element of the geometry (the source element size with a cast)
    source: str  # the input file
    at: int | StitchChunk  # safetensors: the block's byte offset; pyckpt: one encoded chunk
    out_path: str
    out_offset: int  # the tensor's first byte in the output file
    lo: int  # output elements of the tensor this item may write: [lo, hi)
    hi: int
    p: int  # block elements this item holds: [p, q) (a chunk), or [0, 2**64 - 1) (a shard)
    q: int
    cast: FloatCast | None = None

def stitch(
    items: Sequence[StitchItem],
    threads: int,
    task_bytes: int,
    input_mode: str,
    fsync: bool,
    *,
    partial: bool = False,
) -> dict[str, int]: ...
def convert_floats(src: Buffer, from_dtype: str, to_dtype: str, out: Buffer) -> None: ...

class ProgressCounter:
    """Raw bytes finished by the native saves, loads, verifies and stitches of the threads it is
    set on (the one native progress counter type)."""
    def __init__(self) -> None: ...
    @property
    def bytes(self) -> int: ...

def set_progress_counter(counter: ProgressCounter | None) -> None: ...
