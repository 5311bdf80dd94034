"""On-disk format version 4, the reading side: the global ``pyckpt.json`` (:func:`parse_global`),
the shards (:func:`parse_shard`, verified against their digests first) and
:class:`ShardedIndex`, which reads the shards a load needs and assembles its pieces. The format
and its writing side: :mod:`pyckpt._format_shards`; ``docs/FORMAT.md``, "Version 4"."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyckpt import _C, _gc
from pyckpt._format_shards import (
    _BYTES_KEYS,
    _GLOBAL_KEYS,
    _MAX_RANK,
    _SHARD_KEYS,
    _TENSOR_KEYS,
    SHARD_FORMAT,
    SHARDED_VERSION,
    ZSTD_MAGIC,
    Grid,
    Holders,
    ShardRef,
    _describe,
    _fail,
    _int,
    _list,
    _obj,
    _parse_sealed,
    _shards_at_once,
    _shards_one_by_one,
    parse_grid,
    shard_text_limit,
)
from pyckpt._format_spec import (
    _BYTES_DTYPE,
    _GROUPING,
    _MAX_FILE_BYTES,
    _TRANSFORM_CODES,
    _ZSTD_LEVELS,
    _ZSTD_MAX_RATIO,
    CODEC_NONE,
    CODEC_ZSTD,
    DTYPE_SIZES,
    FORMAT_NAME,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    MAX_FILES,
    MAX_ITEM_BYTES,
    MAX_ITEMS,
    MAX_METADATA_BYTES,
    MAX_NDIM,
    MAX_NUMEL,
    MAX_PIECES,
    MAX_PLANNER_DEPTH,
    MEMORY_FORMATS,
    RAW_CODEC_PARAMS,
    StoredBytes,
    StoredPiece,
    StoredTensor,
    check_item_names,
    chunk_place_key,
    chunk_place_seed,
)
from pyckpt.errors import CheckpointFormatError, CompressionError, UnsupportedDtypeError

__all__ = ["GlobalDoc", "ShardRef", "ShardedIndex", "parse_global", "parse_shard"]



@dataclass(frozen=True, slots=True)
class TensorEntry:
    fqn: str
    dtype: str
    grid: Grid
    holders: Holders
    requires_grad: bool
    memory_format: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.grid.shape


@dataclass(frozen=True, slots=True)
class BytesEntry:
    fqn: str
    nbytes: int


@dataclass
class GlobalDoc:
    """A validated version-4 ``pyckpt.json``."""

    origin: str
    created_by: str
    save_id: str
    dcp_version: str | None
    modules: list[str]
    planner_data: Any
    files: Mapping[str, int]  # data file name -> size
    shards: Mapping[int, ShardRef]
    tensors: dict[str, TensorEntry]
    bytes_items: dict[str, BytesEntry]
    # Items stored here (Layout.inline): fqn -> (rank, raw_begin, params, chunks) by raw_begin
    inline: dict[str, list[tuple[int, int, Any, list[tuple[Any, ...]]]]] = field(
        default_factory=dict)
    # Stored ranges of the inline items' chunks in each rank's file (for the packing check)
    inline_ranges: dict[int, list[tuple[int, int, str]]] = field(default_factory=dict)


def _inline_segments(g: GlobalDoc, fqn: str, value: Any, nbytes: int, dtype: str,
                     holders: tuple[int, ...] | None, codecs: _CodecCheck, ip: str) -> None:
    """Validates the segments of an item stored in ``pyckpt.json`` (``[rank, raw_begin,
    codec, chunks]`` each, by raw_begin, covering its bytes) into ``g.inline``."""
    origin = g.origin
    out = []
    expect = 0
    seed = chunk_place_seed(fqn, [0] * len(g.tensors[fqn].shape) if fqn in g.tensors else ())
    for k, seg in enumerate(_list(value, origin, f"{ip}.segments")):
        sp = f"{ip}.segments[{k}]"
        if type(seg) is not list or len(seg) != 4:
            raise _fail(origin, sp, "must be [rank, raw_begin, codec, chunks]")
        rank = _int(seg[0], origin, f"{sp}[0]", 0, _MAX_RANK)
        ref = g.shards.get(rank)
        if ref is None or (holders is not None and rank not in holders):
            raise _fail(origin, f"{sp}[0]", f"rank {rank} "
                        + ("has no data file" if ref is None else "is not a holder of the item"))
        raw_begin = _int(seg[1], origin, f"{sp}[1]", 0, nbytes)
        if raw_begin != expect:
            raise _fail(origin, f"{sp}[1]", f"segments leave a gap or overlap: {raw_begin}, "
                                            f"expected {expect}")
        params = codecs(seg[2], dtype, origin, f"{sp}[2]")
        records, held = _chunks(seg[3], params, seed, raw_begin, ref.offset, origin,
                                f"{sp}[3]", g.inline_ranges.setdefault(rank, []))
        expect += held
        out.append((rank, raw_begin, params, records))
    if expect != nbytes:
        raise _fail(origin, f"{ip}.segments", f"hold {expect} raw bytes, expected {nbytes}")
    g.inline[fqn] = out


def _untag(v: Any, origin: str, path: str, depth: int) -> Any:
    if depth > MAX_PLANNER_DEPTH:
        raise _fail(origin, "planner_data", f"nested deeper than {MAX_PLANNER_DEPTH} levels")
    if type(v) is list:
        return [_untag(x, origin, path, depth + 1) for x in v]
    if type(v) is dict:
        if "__tuple__" in v:
            if len(v) != 1 or type(v["__tuple__"]) is not list:
                raise _fail(origin, path, "a {\"__tuple__\": ...} object must hold only that "
                                          "key, with a list")
            return tuple(_untag(x, origin, path, depth + 1) for x in v["__tuple__"])
        return {k: _untag(x, origin, path, depth + 1) for k, x in v.items()}
    return v


def parse_global(raw: bytes, origin: str) -> GlobalDoc:
    """Verifies and validates a version-4 ``pyckpt.json`` (``origin`` names it)."""
    if len(raw) > MAX_METADATA_BYTES:
        raise _fail(origin, "", f"more than the {MAX_METADATA_BYTES} bytes this pyckpt reads")
    doc = _parse_sealed(raw, origin)
    if type(doc) is dict:  # the first version-4 writers also listed every data file's size
        doc.pop("files", None)  # in "files": the shards give them (each file ends with its own)
    _obj(doc, origin, "", _GLOBAL_KEYS)
    if doc["format"] != FORMAT_NAME or doc["version"] != SHARDED_VERSION:
        raise _fail(origin, "format", "not a version-4 pyckpt document")
    for key in ("created_by", "save_id"):
        if type(doc[key]) is not str:
            raise _fail(origin, key, f"must be a string, got {_describe(doc[key])}")
    save_id = doc["save_id"]
    if len(save_id) != 12 or any(c not in "0123456789abcdef" for c in save_id):
        raise _fail(origin, "save_id", f"must be 12 lowercase hex digits, got {save_id!r}")
    dcp_version = doc["dcp_version"]
    if dcp_version is not None and type(dcp_version) is not str:
        raise _fail(origin, "dcp_version", "must be a string or null")
    sm = _obj(doc["storage_meta"], origin, "storage_meta", frozenset(("modules",)))
    modules = _list(sm["modules"], origin, "storage_meta.modules")
    if any(type(m) is not str for m in modules):
        raise _fail(origin, "storage_meta.modules", "must be a list of strings")
    planner_data = _untag(doc["planner_data"], origin, "planner_data", 0)

    shard_list = _list(doc["shards"], origin, "shards")
    if len(shard_list) > MAX_FILES:
        raise _fail(origin, "shards", f"more than {MAX_FILES} data files")
    shards = _shards_at_once(shard_list, save_id)
    if shards is None:  # something is wrong: find it, entry by entry
        shards = _shards_one_by_one(shard_list, save_id, origin)

    items = doc["items"]
    if type(items) is not dict:
        raise _fail(origin, "items", "must be an object")
    if len(items) > MAX_ITEMS:
        raise _fail(origin, "items", f"more than {MAX_ITEMS} items")
    tensors: dict[str, TensorEntry] = {}
    bytes_items: dict[str, BytesEntry] = {}
    inline: list[tuple[str, Any, int, str, tuple[int, ...] | None, str]] = []
    cells = 0
    check_item_names(items, origin)
    for fqn, item in items.items():
        ip = f"items[{fqn!r}]"
        if type(item) is dict and item.get("type") == "bytes":
            _obj(item, origin, ip, _BYTES_KEYS)
            nbytes = _int(item["nbytes"], origin, f"{ip}.nbytes", 0, MAX_ITEM_BYTES)
            bytes_items[fqn] = BytesEntry(fqn, nbytes)
            inline.append((fqn, item["segments"], nbytes, _BYTES_DTYPE, None, ip))
            continue
        if type(item) is not dict or item.get("type") != "tensor":
            raise _fail(origin, f"{ip}.type", "must be \"tensor\" or \"bytes\"")
        _obj(item, origin, ip, _TENSOR_KEYS | {"segments"} if "segments" in item
             else _TENSOR_KEYS)
        dtype = item["dtype"]
        if type(dtype) is not str:
            raise _fail(origin, f"{ip}.dtype", "must be a string")
        if dtype not in DTYPE_SIZES:
            raise UnsupportedDtypeError(f"{origin}: {ip}.dtype: {dtype!r} is not a dtype this "
                                        "pyckpt stores")
        shape = _list(item["shape"], origin, f"{ip}.shape")
        if len(shape) > MAX_NDIM:
            raise _fail(origin, f"{ip}.shape", f"more than {MAX_NDIM} dimensions")
        for d, n in enumerate(shape):
            _int(n, origin, f"{ip}.shape[{d}]", 0, MAX_NUMEL)
        numel = math.prod(shape)
        if numel > MAX_NUMEL or numel * DTYPE_SIZES[dtype] > MAX_ITEM_BYTES:
            raise _fail(origin, f"{ip}.shape", "beyond the documented limits")
        if type(item["requires_grad"]) is not bool:
            raise _fail(origin, f"{ip}.requires_grad", "must be true or false")
        if item["memory_format"] not in MEMORY_FORMATS or type(item["memory_format"]) is not str:
            raise _fail(origin, f"{ip}.memory_format", f"must be one of {list(MEMORY_FORMATS)}")
        grid = parse_grid(tuple(shape), item["grid"], origin, f"{ip}.grid")
        if grid.nonempty > max(1, len(shards)):  # before any read is planned for its cells
            raise _fail(origin, f"{ip}.grid", f"{grid.nonempty} non-empty pieces, more than the "
                                              f"{len(shards)} shards (ranks that wrote)")
        cells += grid.ncells
        if cells > MAX_PIECES:
            raise _fail(origin, "items", f"more than {MAX_PIECES} pieces")
        holders = Holders.parse(item["holders"], grid.ncells, shards, origin, f"{ip}.holders")
        tensors[fqn] = TensorEntry(fqn, dtype, grid, holders, item["requires_grad"],
                                   item["memory_format"])
        split = grid.ncells == 1 and len(holders.of(0)) > 1  # stored here (Layout.inline)
        if split != ("segments" in item):
            raise _fail(origin, ip, "a tensor of one piece held by several ranks lists its "
                                    "segments here, and only such a tensor")
        if split:
            nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
            inline.append((fqn, item["segments"], nbytes, dtype, holders.of(0), ip))
    g = GlobalDoc(origin, doc["created_by"], save_id, dcp_version, modules, planner_data,
                  shards.files(), shards, tensors, bytes_items)
    codecs = _CodecCheck()
    for fqn, value, nbytes, dtype, held_by, ip in inline:
        _inline_segments(g, fqn, value, nbytes, dtype, held_by, codecs, ip)
    return g


class _CodecCheck:
    """Codec fields of segments, checked against the item's dtype (the version-3 rules)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[Any, ...], Any] = {}

    def __call__(self, value: Any, dtype: str, origin: str, path: str) -> Any:
        key = (dtype, *value) if type(value) is list and len(value) == 4 and all(
            type(v) in (str, int) for v in value) else None
        if key is not None and key in self.cache:
            return self.cache[key]
        if type(value) is not list or len(value) != 4:
            raise _fail(origin, path, "must be [codec, level, elem_size, transform]")
        codec, level, elem_size, transform = value
        if codec == CODEC_NONE and type(codec) is str:
            if value != list(RAW_CODEC_PARAMS) or type(level) is not int or type(
                    elem_size) is not int:
                raise _fail(origin, path, f"codec 'none' is stored as "
                                          f"{json.dumps(RAW_CODEC_PARAMS)}, got {value}")
        elif codec == CODEC_ZSTD and type(codec) is str:
            _int(level, origin, f"{path}[1]", *_ZSTD_LEVELS)
            if type(transform) is not str or transform not in _TRANSFORM_CODES:
                raise _fail(origin, f"{path}[3]", f"unknown transform {_describe(transform)}")
            expect = (1, "none") if transform == "none" else _GROUPING.get(dtype)
            if type(elem_size) is not int or (elem_size, transform) != expect:
                raise _fail(origin, path, f"elem_size {_describe(elem_size)} and transform "
                                          f"{transform!r} do not fit dtype {dtype}")
        else:
            raise _fail(origin, f"{path}[0]", f"unknown codec {_describe(codec)}")
        params = _C.CodecParams(codec, level, elem_size, transform)
        if key is not None:
            self.cache[key] = params
        return params


def _chunks(chunks: Any, params: Any, seed: int, raw_begin: int, limit: int, origin: str,
            path: str, ranges: list[tuple[int, int, str]]) -> tuple[list[tuple[Any, ...]], int]:
    """Validates a segment's chunk records (the version-3 rules); returns them with their
    checksums unbound from their place, and the raw bytes they hold."""
    chunks = _list(chunks, origin, path)
    codec, elem = params.codec, params.elem_size
    group_code = _TRANSFORM_CODES[params.transform] if codec == CODEC_ZSTD and elem > 1 else 0
    out = []
    pos = raw_begin
    for j, c in enumerate(chunks):
        cp = f"{path}[{j}]"
        if type(c) is not list or len(c) != 5 or type(c[4]) is not list:
            raise _fail(origin, cp, "must be [file_offset, raw_len, xxh64, transform, "
                                    "[plane modes and lengths]]")
        off, raw_len, checksum, tcode, planes = c
        _int(off, origin, f"{cp}[0]", 0, _MAX_FILE_BYTES)
        _int(raw_len, origin, f"{cp}[1]", 1, MAX_CHUNK_BYTES)
        _int(checksum, origin, f"{cp}[2]", 0, (1 << 64) - 1)
        grouped = group_code and raw_len % elem == 0
        want = group_code if grouped else 0
        if type(tcode) is not int or tcode != want:
            raise _fail(origin, f"{cp}[3]", f"transform code {_describe(tcode)} disagrees with "
                                            f"the codec params (expected {want})")
        nplanes = elem if grouped else 1
        if len(planes) != 2 * nplanes:
            raise _fail(origin, f"{cp}[4]", f"must list {nplanes} (mode, length) plane pairs")
        n = raw_len // nplanes
        stored = 0
        for p in range(nplanes):
            mode, length = planes[2 * p], planes[2 * p + 1]
            if type(mode) is not int or type(length) is not int:
                raise _fail(origin, f"{cp}[4]", "plane modes and lengths must be integers")
            if mode == 0:
                ok = length == n
            elif mode == 1:
                ok = codec == CODEC_ZSTD and 0 < length < n and n <= length * _ZSTD_MAX_RATIO
            else:
                ok = False
            if not ok:
                raise _fail(origin, f"{cp}[4]", f"plane {p} (mode {mode}, {length} bytes) "
                                                f"cannot hold {n} raw bytes")
            stored += length
        if off + stored > limit:
            raise _fail(origin, cp, f"stored bytes [{off}, {off + stored}) lie past the chunks "
                                    f"of the data file (which end at {limit})")
        ranges.append((off, off + stored, cp))
        out.append((off, raw_len, checksum ^ chunk_place_key(seed, pos), tcode, tuple(planes)))
        pos += raw_len
    return out, pos - raw_begin


class _Shard:
    """A shard whose digest, seal and header are checked. Its items are validated when first
    used (:meth:`item`): a rank loading a few items of a shard pays for those only;
    :meth:`check_all` validates the rest and that the chunks pack the data file."""

    def __init__(self, g: GlobalDoc, ref: ShardRef, path: str, items: dict[str, Any],
                 codecs: _CodecCheck) -> None:
        self.g, self.ref, self.path, self.codecs = g, ref, path, codecs
        self.origin = f"{path} (metadata shard of rank {ref.rank})"
        self.pending = items
        # (fqn, cell) -> [(raw_begin, segment)] of the items validated so far
        self.cells: dict[tuple[str, int], list[tuple[int, tuple[Any, ...]]]] = {}
        self.ranges: list[tuple[int, int, str]] = []
        self.nchunks = 0
        self.checked = False  # check_all done

    def item(self, fqn: str) -> None:
        """Validates the segments of ``fqn`` held here (once)."""
        segs = self.pending.pop(fqn, None)
        if segs is None:
            return
        g, ref, origin = self.g, self.ref, self.origin
        ip = f"items[{fqn!r}]"
        t = g.tensors[fqn]
        for s, seg in enumerate(segs):
            sp = f"{ip}[{s}]"
            if type(seg) is not list or len(seg) != 4:
                raise _fail(origin, sp, "must be [offsets, raw_begin, codec, chunks]")
            offsets, raw_begin, codec, chunk_list = seg
            offs = _list(offsets, origin, f"{sp}[0]")
            if any(type(o) is not int for o in offs):
                raise _fail(origin, f"{sp}[0]", "offsets must be integers")
            cell = t.grid.number(offs)
            if cell is None:
                raise _fail(origin, f"{sp}[0]", f"{offs} is not a piece of the tensor")
            nbytes = math.prod(t.grid.cell(cell)[1]) * DTYPE_SIZES[t.dtype]
            holders, dtype, seed = t.holders.of(cell), t.dtype, chunk_place_seed(fqn, offs)
            if ref.rank not in holders:
                raise _fail(origin, sp, f"rank {ref.rank} is not a holder of this piece in "
                                        f"{g.origin}")
            _int(raw_begin, origin, f"{sp}[1]", 0, nbytes)
            params = self.codecs(codec, dtype, origin, f"{sp}[2]")
            records, held = _chunks(chunk_list, params, seed, raw_begin, ref.offset, origin,
                                    f"{sp}[3]", self.ranges)
            self.nchunks += len(records)
            if self.nchunks > MAX_CHUNKS:
                raise _fail(origin, "items", f"more than {MAX_CHUNKS} chunk records")
            if raw_begin + held > nbytes:
                raise _fail(origin, sp, f"holds raw bytes up to {raw_begin + held}, the piece has "
                                        f"{nbytes}")
            self.cells.setdefault((fqn, cell), []).append(
                (raw_begin, (self.path, raw_begin, params, records)))

    def check_all(self) -> None:
        """Validates every item, then that the chunks (with those of the rank's items stored
        in ``pyckpt.json``) are the data file's bytes back to back up to the shard (once)."""
        if self.checked:
            return
        for fqn in list(self.pending):
            self.item(fqn)
        prev = 0
        for off, end, cp in sorted(self.ranges + self.g.inline_ranges.get(self.ref.rank, [])):
            if off != prev:
                raise _fail(self.origin, cp,
                            f"stored bytes at offset {off} overlap another chunk's" if off < prev
                            else f"bytes [{prev}, {off}) of the data file belong to no chunk")
            prev = end
        if prev != self.ref.offset:
            raise _fail(self.origin, "items", f"its chunks end at {prev}, the shard begins at "
                                              f"{self.ref.offset}")
        self.checked = True


def parse_shard(g: GlobalDoc, ref: ShardRef, raw: bytes, path: str,
                codecs: _CodecCheck | None = None) -> _Shard:
    """Verifies rank ``ref.rank``'s shard ``raw`` (read from data file ``path``) against its
    digest in ``g`` and checks its header and that it names only items of ``g``; its items are
    validated as they are used (:class:`_Shard`)."""
    origin = f"{path} (metadata shard of rank {ref.rank})"
    if len(raw) != ref.length:
        raise _fail(origin, "", f"{len(raw)} bytes, {g.origin} records {ref.length}: the shard "
                                "is truncated")
    actual = _C.xxh64(raw)
    if actual != ref.xxh64:
        raise _fail(origin, "", f"digest mismatch (recorded in {g.origin}: xxh64:"
                                f"{ref.xxh64:016x}, computed xxh64:{actual:016x}): the shard is "
                                "damaged, or another save's or another rank's")
    if raw[:4] == ZSTD_MAGIC:  # else the JSON text itself, which begins with "{"
        try:
            raw = _C.zstd_unframe(raw, shard_text_limit(len(raw)))
        except (CompressionError, CheckpointFormatError) as e:
            raise _fail(origin, "", f"not one zstd frame of a shard: {e}") from e
    doc = _parse_sealed(raw, origin)
    _obj(doc, origin, "", _SHARD_KEYS)
    if doc["format"] != SHARD_FORMAT or doc["version"] != SHARDED_VERSION \
            or type(doc["version"]) is not int:
        raise _fail(origin, "format", "not a version-4 pyckpt metadata shard")
    if doc["save_id"] != g.save_id or type(doc["save_id"]) is not str:
        raise _fail(origin, "save_id", f"{_describe(doc['save_id'])} is not this save's "
                                       f"({g.save_id})")
    if doc["rank"] != ref.rank or type(doc["rank"]) is not int:
        raise _fail(origin, "rank", f"{_describe(doc['rank'])}: this is not rank {ref.rank}'s "
                                    "shard")
    items = doc["items"]
    if type(items) is not dict:
        raise _fail(origin, "items", "must be an object")
    for fqn, segs in items.items():
        if fqn not in g.tensors or fqn in g.inline:
            raise _fail(origin, f"items[{fqn!r}]", f"{g.origin} lists no such item stored in "
                                                   "shards")
        _list(segs, origin, f"items[{fqn!r}]")
    return _Shard(g, ref, path, items, codecs or _CodecCheck())


ReadShards = Callable[[list[ShardRef]], list[tuple[bytes, str]]]
_FULL_BATCH = 64  # shards read at once by ShardedIndex.full (one read batch; parsed, checked)


class ShardedIndex:
    """A version-4 checkpoint being read: the global document, and the shards read so far.

    ``read`` fetches shards: given their refs, returns each one's bytes and the path of its
    data file (for messages and segments); the backend's :class:`~pyckpt._format.DataFiles`
    does it (pread, a ranged GET). :meth:`load` reads the shards holding given cells;
    :meth:`piece` and :meth:`bytes_item` assemble what they hold, checking that the segments
    of all holders cover the piece exactly."""

    def __init__(self, g: GlobalDoc, read: ReadShards, path_of: Callable[[str, int], str]
                 ) -> None:
        self.g = g
        self._read = read
        self._path_of = path_of  # (data file name, size) -> where the backend reads it, checked
        self._file_paths: dict[str, str] = {}
        self._shards: dict[int, _Shard] = {}
        self._codecs = _CodecCheck()
        self._pieces: dict[tuple[str, int], Any] = {}
        self._paths: dict[int, str] = {}

    @property
    def shards_read(self) -> int:
        return len(self._shards)

    def holders(self, fqn: str, cell: int) -> tuple[int, ...]:
        """The ranks whose shards hold the cell (none for an item stored in pyckpt.json)."""
        if fqn in self.g.inline:
            return ()
        return self.g.tensors[fqn].holders.of(cell)

    def load(self, ranks: set[int] | list[int], check: bool = False) -> None:
        """Reads and validates the shards of ``ranks`` not read yet (``check``: each one whole,
        as it is parsed, so that one shard's parsed JSON is alive at a time)."""
        refs = [self.g.shards[r] for r in sorted(set(ranks)) if r not in self._shards]
        if not refs:
            return
        with _gc.paused():  # parsed shards stay alive (see pyckpt._gc)
            for ref, (raw, path) in zip(refs, self._read(refs)):
                shard = parse_shard(self.g, ref, raw, path, self._codecs)
                if check:
                    shard.check_all()
                self._shards[ref.rank] = shard
                self._paths[ref.rank] = path

    def load_cells(self, keys: list[tuple[str, int]]) -> None:
        """Reads the shards holding each (fqn, cell) of ``keys``."""
        ranks: set[int] = set()
        for fqn, cell in keys:
            ranks.update(self.holders(fqn, cell))
        self.load(ranks)

    def _segments(self, fqn: str, cell: int, nbytes: int, where: str) -> list[Any]:
        inline = self.g.inline.get(fqn)
        if inline is not None:  # checked with the global document
            return [(self._path(r), rb, params, records) for r, rb, params, records in inline]
        holders = self.holders(fqn, cell)
        missing = [r for r in holders if r not in self._shards]
        if missing:
            raise KeyError(f"{self.g.origin}: {where}: the shard of rank {missing[0]} was not "
                           "read")
        found: list[tuple[int, int, tuple[Any, ...]]] = []
        for r in holders:
            self._shards[r].item(fqn)
            segs = self._shards[r].cells.get((fqn, cell))
            if not segs and nbytes:
                raise _fail(self._origin(r), f"items[{fqn!r}]", f"holds no segment of {where}, "
                                                               f"{self.g.origin} names it a holder")
            found.extend((rb, r, seg) for rb, seg in segs or ())
        found.sort(key=lambda x: x[0])
        expect = 0
        for raw_begin, r, seg in found:
            if raw_begin != expect:
                raise _fail(self._origin(r), f"items[{fqn!r}]",
                            f"segments of {where} leave a gap or overlap: raw_begin {raw_begin}"
                            f", expected {expect}")
            expect += sum(c[1] for c in seg[3])
        if expect != nbytes:
            r = found[-1][1] if found else holders[0] if holders else -1
            raise _fail(self._origin(r) if r >= 0 else self.g.origin, f"items[{fqn!r}]",
                        f"the segments of {where} hold {expect} raw bytes, expected {nbytes}")
        return [seg for _, _, seg in found]

    def _path(self, rank: int) -> str:
        name = self.g.shards[rank].file
        path = self._file_paths.get(name)
        if path is None:
            path = self._file_paths[name] = self._path_of(name, self.g.files[name])
        return path

    def _origin(self, rank: int) -> str:
        return f"{self._paths.get(rank, self.g.shards[rank].file)} (metadata shard of rank {rank})"

    def tensor(self, fqn: str) -> StoredTensor:
        """The tensor's entry without its pieces (for its dtype and shape)."""
        t = self.g.tensors[fqn]
        return StoredTensor(fqn, t.dtype, t.shape, [], t.requires_grad, t.memory_format)

    def piece(self, fqn: str, cell: int) -> StoredPiece:
        key = (fqn, cell)
        p = self._pieces.get(key)
        if p is None:
            t = self.g.tensors[fqn]
            offsets, sizes = t.grid.cell(cell)
            nbytes = math.prod(sizes) * DTYPE_SIZES[t.dtype]
            p = StoredPiece(offsets, sizes, nbytes,
                            self._segments(fqn, cell, nbytes, f"piece {list(offsets)}"))
            self._pieces[key] = p
        return p

    def bytes_item(self, fqn: str) -> StoredBytes:
        b = self.g.bytes_items[fqn]
        return StoredBytes(fqn, b.nbytes, self._segments(fqn, 0, b.nbytes, "the value"))

    def full(self) -> tuple[dict[str, StoredTensor], dict[str, StoredBytes]]:
        """Every item with all its pieces (every shard read and checked)."""
        ranks = list(self.g.shards)
        for k in range(0, len(ranks), _FULL_BATCH):  # one read batch at a time
            self.load(ranks[k:k + _FULL_BATCH], check=True)
        for shard in self._shards.values():  # those read before, lazily
            shard.check_all()
        tensors = {}
        for fqn, t in self.g.tensors.items():
            pieces = [self.piece(fqn, c) for c in range(t.grid.ncells)]
            tensors[fqn] = StoredTensor(fqn, t.dtype, t.shape, pieces, t.requires_grad,
                                        t.memory_format)
        self._pieces.clear()
        return tensors, {fqn: self.bytes_item(fqn) for fqn in self.g.bytes_items}
