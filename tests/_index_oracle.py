"""The Python metadata validator: the reference reading of ``pyckpt.json`` (docs/FORMAT.md,
"Strict schema") that the metadata reader (``_C.parse_pyckpt_index``) is compared with.

It was pyckpt's reader before the native one read every document; it stays here as an
independent oracle: the differential tests (the suite's conftest, tests/test_native_index.py,
the metadata fuzzers) check that both readers accept the same documents, build the same index
and refuse the others with the same error and message. Data files are not looked at: paths are
the files' names.
"""

from __future__ import annotations

import json
import math
import re
from array import array
from collections.abc import Callable
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from pyckpt import _C
from pyckpt._format_spec import (
    _BYTES_DTYPE,
    _BYTES_KEYS,
    _GROUPING,
    _JUST_INT,
    _MAX_FILE_BYTES,
    _MAX_GRID_CELLS,
    _MAX_IRREGULAR_PIECES,
    _PIECE_KEYS,
    _SAVE_ID_RE,
    _SEAL_LEN,
    _SEAL_RE,
    _SEGMENT_KEYS,
    _STORAGE_META_KEYS,
    _TENSOR_KEYS,
    _TOP_KEYS_V1,
    _TOP_KEYS_V2,
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
    MAX_NDIM,
    MAX_NUMEL,
    MAX_PIECES,
    MAX_PLANNER_DEPTH,
    MAX_SEGMENTS,
    MEMORY_FORMATS,
    PLACE_BOUND_VERSION,
    RAW_CODEC_PARAMS,
    READABLE_VERSIONS,
    CheckpointIndex,
    StoredBytes,
    StoredPiece,
    StoredTensor,
    chunk_place_key,
    chunk_place_seed,
    codec_params_json,
    data_file_rank,
    is_data_file,
)
from pyckpt.errors import CheckpointFormatError, UnsupportedDtypeError

if TYPE_CHECKING:
    from pyckpt._C import CodecParams


class _Duplicate:
    """Stands for a JSON object that repeats a key (reported with its key path later)."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


def _describe(value: Any) -> str:
    if isinstance(value, _Duplicate):
        return f"an object that repeats the key {value.key!r}"
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _member(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _dims_ok(dims: list[Any]) -> bool:
    """Every entry an exact int (not a bool) in [0, MAX_NUMEL]: the common case, checked with
    C-level loops (the validator's per-entry loop then only runs to report a failure)."""
    return not dims or (set(map(type, dims)) == _JUST_INT and min(dims) >= 0
                        and max(dims) <= MAX_NUMEL)


class _Path:
    """A key path spelled out only when a message needs it: ``{base}{member}[{n}]`` (no index
    when ``n`` is None)."""

    __slots__ = ("base", "member", "n")

    def __init__(self, base: object, member: str, n: int | None = None) -> None:
        self.base, self.member, self.n = base, member, n

    def __str__(self) -> str:
        if self.n is None:
            return f"{self.base}{self.member}"
        return f"{self.base}{self.member}[{self.n}]"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class _Key:
    """A key path spelled out only when a message needs it: ``{base}[{key!r}]``."""

    __slots__ = ("base", "key")

    def __init__(self, base: object, key: str) -> None:
        self.base, self.key = base, key

    def __str__(self) -> str:
        return f"{self.base}[{self.key!r}]"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


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
    if version == 4:
        raise CheckpointFormatError(
            f"{meta}: a version 4 (sharded) document must begin with "
            '{"format":"pyckpt","version":4, (docs/FORMAT.md, "Version 4")')
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


# Files with at most this many chunk bounds (2 per chunk) are checked for packing in Python.
_PACKING_IN_PYTHON = 2048
_first = itemgetter(0)

# planner_data leaves (JSON scalars), and the keys of its tagged tuples.
_PLAIN = (str, int, float, bool)
_TUPLE_KEYS = frozenset(("__tuple__",))

# The types of a well-formed codec entry [codec, level, elem_size, transform].
_CODEC_TYPES = (str, int, int, str)


class _Validator:
    """Walks a parsed metadata document, checking it and building the index."""

    def __init__(self, meta: str, version: int, disjoint_pieces: int = 0,
                 rank: int = -1) -> None:
        self.root = ""
        self.disjoint_pieces = disjoint_pieces  # > 0: a rank-local part (see check_tiling)
        self.rank = rank
        self.local_files: set[str] = set()
        self.meta = meta
        self.version = version
        self.files: dict[str, int] = {}
        self.paths: dict[str, str] = {}  # data file name -> absolute path (one string per file)
        self.ranges: dict[str, array[int]] = {}  # data file name -> [begin, end, begin, end...]
        self.params: dict[tuple[Any, ...], CodecParams] = {}
        # id(params) -> (params, codec, elem_size, transform): the fields as Python values (reading
        # them from the native object on every segment costs more than the checks themselves).
        self.param_info: dict[int, tuple[CodecParams, str, int, str]] = {}
        self.pieces = 0
        self.segments = 0
        self.chunks = 0

    def place_seed(self, fqn: str, offsets: tuple[int, ...] = ()) -> int | None:
        """The place seed of a piece, or None for versions whose checksums are not bound."""
        return chunk_place_seed(fqn, offsets) if self.version >= PLACE_BOUND_VERSION else None

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

    def too_many(self, limit: int, what: str) -> CheckpointFormatError:
        """The failure of :meth:`count` (for the counters the hot paths advance inline)."""
        return self.fail("", f"more than {limit} {what}: this pyckpt refuses such metadata")

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
                segs = self.segments_of(item["segments"], nbytes, ip, _BYTES_DTYPE,
                                        self.place_seed(fqn))
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
            full = self.check_file(name, size)
            self.files[name] = size
            self.paths[name] = full
            self.ranges[name] = array("Q")
            self.local_files.add(name)

    def check_file(self, name: str, size: int) -> str:
        """Data files are not looked at; a rank-local part names only its rank's."""
        if self.rank >= 0 and data_file_rank(name) != self.rank:
            raise self.fail(f"files[{name!r}]", f"is not a data file of rank {self.rank}; "
                                                "rank-local metadata names only its rank's files")
        return name

    def untag(self, value: Any, path: Any, depth: int) -> Any:
        t = type(value)
        if value is None or t in _PLAIN:  # the leaves first: most values are
            if depth > MAX_PLANNER_DEPTH:
                raise self.fail(path, f"nested deeper than {MAX_PLANNER_DEPTH} levels")
            return value
        if depth > MAX_PLANNER_DEPTH:
            raise self.fail(path, f"nested deeper than {MAX_PLANNER_DEPTH} levels")
        if t is dict:
            if "__tuple__" in value:
                self.obj(value, path, _TUPLE_KEYS)
                inner = value["__tuple__"]
                if type(inner) is not list:
                    self.lst(inner, f"{path}.__tuple__")  # raises
                return tuple(self.untag(v, _Path(path, ".__tuple__", i), depth + 1)
                             for i, v in enumerate(inner))
            return {k: self.untag(v, _Key(path, k), depth + 1) for k, v in value.items()}
        if t is list:
            return [self.untag(v, _Path(path, "", i), depth + 1) for i, v in enumerate(value)]
        if t is tuple:  # a chunk-like list the parser compacted (see _object_hook)
            return [self.untag(v, _Path(path, "", i), depth + 1)
                    for i, v in enumerate(value[:4])] + [self.untag(list(value[4]),
                                                                    f"{path}[4]", depth + 1)]
        raise self.fail(path, f"unexpected {_describe(value)}")

    # -- items -------------------------------------------------------------------------------

    def dims(self, value: Any, path: str, n: int | None) -> tuple[int, ...]:
        if type(value) is list and len(value) == (len(value) if n is None else n) <= MAX_NDIM \
                and _dims_ok(value):
            return tuple(value)
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
        ndim = len(shape)
        # The key path of a piece is only spelled out for a message: each check below runs the
        # common case inline and calls the general helper (which raises) only when it fails.
        for n, raw in enumerate(raw_pieces):
            piece = raw if type(raw) is dict and raw.keys() == _PIECE_KEYS else self.obj(
                raw, f"{ip}.pieces[{n}]", _PIECE_KEYS)
            offsets, sizes = piece["offsets"], piece["sizes"]
            if (type(offsets) is list and type(sizes) is list and len(offsets) == ndim
                    and len(sizes) == ndim and _dims_ok(offsets) and _dims_ok(sizes)):
                offsets, sizes = tuple(offsets), tuple(sizes)
            else:
                pp = f"{ip}.pieces[{n}]"
                offsets = self.dims(offsets, f"{pp}.offsets", ndim)
                sizes = self.dims(sizes, f"{pp}.sizes", ndim)
            for d, (o, s, full) in enumerate(zip(offsets, sizes, shape)):
                if o > full or s > full - o:
                    raise self.fail(f"{ip}.pieces[{n}]",
                                    f"offsets {list(offsets)} + sizes {list(sizes)} leave "
                                    f"the tensor's shape {list(shape)} (dimension {d})")
            nbytes = math.prod(sizes) * esize
            segs = self.segments_of(piece["segments"], nbytes, _Path(ip, ".pieces", n), dtype,
                                    self.place_seed(fqn, offsets))
            pieces.append(StoredPiece(offsets, sizes, nbytes, segs))
        self.check_tiling(ip, shape, numel, pieces)
        return StoredTensor(fqn, dtype, shape, pieces, requires_grad, memory_format)

    def codec(self, value: Any, path: Any, dtype: str) -> CodecParams:
        # Exact types only in the key: True would hash and compare equal to 1.
        if type(value) is list and tuple(map(type, value)) == _CODEC_TYPES:
            cached = self.params.get((dtype, *value))
            if cached is not None:
                return cached
        params = self.lst(value, path)
        if len(params) != 4:
            raise self.fail(path, "must be [codec, level, elem_size, transform]")
        codec, level, elem_size, transform = params
        if codec == CODEC_NONE and type(codec) is str:
            if params != list(RAW_CODEC_PARAMS) or type(level) is not int or type(
                    elem_size) is not int:
                raise self.fail(path, f"codec 'none' is stored as {json.dumps(RAW_CODEC_PARAMS)}, "
                                      f"got {params}")
        elif codec == CODEC_ZSTD and type(codec) is str:
            self.int_(level, f"{path}[1]", *_ZSTD_LEVELS)
            if type(transform) is not str or transform not in _TRANSFORM_CODES:
                raise self.fail(f"{path}[3]", f"unknown transform {_describe(transform)}")
            expect = (1, "none") if transform == "none" else _GROUPING.get(dtype)
            if type(elem_size) is not int or (elem_size, transform) != expect:
                raise self.fail(path, f"elem_size {_describe(elem_size)} and transform "
                                      f"{transform!r} do not fit dtype {dtype}")
        else:
            raise self.fail(f"{path}[0]", f"unknown codec {_describe(codec)}")
        result = _C.CodecParams(codec, level, elem_size, transform)
        key = (dtype, *params)
        self.params[key] = result
        self.param_info[id(result)] = (result, codec, elem_size, transform)
        return result

    def segments_of(
        self, value: Any, nbytes: int, where: Any, dtype: str, seed: int | None = None
    ) -> list[tuple[str, int, CodecParams, list[tuple[Any, ...]]]]:
        """Validates the segments of a piece or bytes item. ``seed``: the piece's place seed
        (format version 3), used to unbind each chunk's checksum from its place."""
        raw_segments = value if type(value) is list else self.lst(value, f"{where}.segments")
        self.segments += len(raw_segments)
        if self.segments > MAX_SEGMENTS:
            raise self.too_many(MAX_SEGMENTS, "segments")
        out = []
        expect = 0
        for s, raw in enumerate(raw_segments):
            sp = _Path(where, ".segments", s)
            seg = raw if type(raw) is dict and raw.keys() == _SEGMENT_KEYS else self.obj(
                raw, str(sp), _SEGMENT_KEYS)
            name = seg["file"]
            if type(name) is not str or name not in self.files:
                raise self.fail(f"{sp}.file", f"{_describe(name)} is not a data file listed in "
                                              "'files'")
            raw_begin = seg["raw_begin"]
            if type(raw_begin) is not int or not 0 <= raw_begin <= MAX_ITEM_BYTES:
                self.int_(raw_begin, f"{sp}.raw_begin", 0, MAX_ITEM_BYTES)  # raises
            if raw_begin != expect:
                raise self.fail(f"{sp}.raw_begin", f"segments leave a gap or overlap: {raw_begin}"
                                                   f", expected {expect}")
            params = self.codec(seg["codec"], _Path(sp, ".codec"), dtype)
            chunks = seg["chunks"]
            if type(chunks) is not list:
                self.lst(chunks, f"{sp}.chunks")  # raises
            self.chunks += len(chunks)
            if self.chunks > MAX_CHUNKS:
                raise self.too_many(MAX_CHUNKS, "chunk records")
            expect += self.chunks_of(chunks, name, params, sp)
            if seed is not None:
                self.unbind(chunks, seed, raw_begin)
            out.append((self.paths[name], raw_begin, params, chunks))
        if expect != nbytes:
            raise self.fail(f"{where}.segments", f"hold {expect} raw bytes, expected {nbytes}")
        return out

    def chunks_of(self, chunks: list[Any], name: str, params: CodecParams, sp: Any) -> int:
        """Validates the (parser-compacted) chunk records of a segment; returns raw bytes."""
        size = self.files[name]
        ranges = self.ranges[name]
        info = self.param_info.get(id(params))
        if info is None:  # params not made by codec() (read through a native object's fields)
            info = self.param_info[id(params)] = (params, params.codec, params.elem_size,
                                                  params.transform)
        _, codec, E, transform = info
        group_code = _TRANSFORM_CODES[transform] if codec == CODEC_ZSTD and E > 1 else 0
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
                                                        f"{codec_params_json(params)} "
                                                        f"(expected {want})")
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
                    ok = codec == CODEC_ZSTD and 0 < length < n and n <= length * _ZSTD_MAX_RATIO
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

    @staticmethod
    def unbind(chunks: list[Any], seed: int, raw_begin: int) -> None:
        """Replaces each (validated) record's place-bound checksum with the XXH64 of its stored
        bytes, which the native reader verifies: a record that was moved to another tensor,
        piece or offset then fails that check."""
        pos = raw_begin
        for j, c in enumerate(chunks):
            chunks[j] = (c[0], c[1], c[2] ^ chunk_place_key(seed, pos), c[3], c[4])
            pos += c[1]

    # -- whole-checkpoint checks -------------------------------------------------------------

    def check_tiling(self, ip: str, shape: tuple[int, ...], numel: int,
                     pieces: list[StoredPiece]) -> None:
        """The pieces must tile the tensor: no gap, no overlap (empty pieces are allowed). A
        rank-local part holds some shards of a tensor: its pieces must not overlap."""
        if self.disjoint_pieces:
            self.check_disjoint(ip, shape, pieces)
            return
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

    def check_disjoint(self, ip: str, shape: tuple[int, ...], pieces: list[StoredPiece]) -> None:
        boxes = [(n, p) for n, p in enumerate(pieces) if p.nbytes]
        if len(boxes) > self.disjoint_pieces:
            raise self.fail(f"{ip}.pieces", f"{len(boxes)} pieces, more than the "
                                            f"{self.disjoint_pieces} a rank-local part may hold")
        for k, (n1, b) in enumerate(boxes):
            for n0, a in boxes[:k]:
                if all(a.offsets[d] < b.offsets[d] + b.sizes[d]
                       and b.offsets[d] < a.offsets[d] + a.sizes[d] for d in range(len(shape))):
                    raise self.fail(f"{ip}.pieces[{n1}]", f"overlaps {ip}.pieces[{n0}]")

    def check_irregular_tiling(self, ip: str, shape: tuple[int, ...],
                               boxes: list[tuple[int, StoredPiece]]) -> None:
        if len(boxes) > _MAX_IRREGULAR_PIECES:
            raise self.fail(f"{ip}.pieces", f"{len(boxes)} pieces that are not a product of "
                                            f"per-dimension cuts (at most "
                                            f"{_MAX_IRREGULAR_PIECES} supported)")
        try:
            _C.check_tiling(ip, list(shape), [_C.TileBlock(list(p.offsets), list(p.sizes),
                                                           f"pieces[{n}]") for n, p in boxes])
        except CheckpointFormatError as e:
            raise self.fail(f"{ip}.pieces", str(e)) from None

    def check_packing(self, index: CheckpointIndex) -> None:
        """Every data file is its chunks back to back: no overlap, no gap, nothing after."""
        for name, ranges in self.ranges.items():
            size = self.files[name]
            if len(ranges) <= _PACKING_IN_PYTHON:
                self.check_file_packing(index, name, size, ranges)
                continue
            import numpy as np

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

    def check_file_packing(self, index: CheckpointIndex, name: str, size: int,
                           ranges: array[int]) -> None:
        """:meth:`check_packing` for one file of few chunks, without numpy's per-call costs
        (the same order and the same messages: chunks sorted stably by offset)."""
        prev = 0
        for off, end in sorted(zip(ranges[0::2], ranges[1::2]), key=_first):
            if off != prev:
                where = self.chunk_path(index, name, off)
                if off < prev:
                    raise self.fail(where, f"stored bytes at offset {off} of {name} overlap "
                                           f"another chunk's (which end at {prev})")
                raise self.fail(where, f"bytes [{prev}, {off}) of {name} belong to no chunk")
            prev = end
        if not ranges:
            if size:
                raise self.fail(f"files[{name!r}]", f"{size} bytes but no chunk is stored in it")
        elif prev != size:
            raise self.fail(f"files[{name!r}]", f"records {size} bytes, its chunks end at {prev}")

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



def oracle_index(raw: bytes, meta: str, *, disjoint_pieces: int = 0, rank: int = -1,
                 limits: dict[str, int] | None = None) -> CheckpointIndex:
    """The index of the metadata bytes ``raw`` as the Python validator reads them (data file
    paths are their names), or its error; the arguments are those of
    ``_C.parse_pyckpt_index``."""
    saved = {name: globals()[name] for name in limits or {}}
    globals().update(limits or {})
    try:
        doc, version = _parse([raw], meta)
        return _Validator(meta, version, disjoint_pieces, rank).index(doc)
    finally:
        globals().update(saved)
