"""On-disk format version 4: a small global document and one sealed metadata shard per rank.

A version-3 ``pyckpt.json`` holds every chunk record of every rank, so the coordinator gathers
and rewrites all of them on every save and every loading rank reads all of them. In version 4
(``docs/FORMAT.md``, "Version 4"):

* each rank appends its **shard** to its own data file, after its chunks: the chunk records of
  what it wrote (compact JSON, sealed like ``pyckpt.json``), and reports to the coordinator only
  where the shard lies and its XXH64 (a few numbers per rank), with the few records of the items
  ``pyckpt.json`` keeps itself (:attr:`Layout.inline`: bytes items, replicated tensors split
  between ranks, which every loading rank needs whole);
* ``pyckpt.json`` names the shards with their digests and describes each tensor's pieces as a
  **grid** (run-length encoded cell sizes per dimension: an FSDP dim-0 split over N ranks is one
  run) and the ranks holding each cell (runs again: rank ``i`` holds cell ``i`` is one run). Its
  size grows with the tensors and the ranks, not with their product; the coordinator builds its
  items part once per plan (:class:`Layout`, cached with the plan) and splices it into every save;
* a loading rank reads the global document, then only the shards holding the cells it loads
  (:class:`ShardedIndex`), each verified against its digest before a byte of it is parsed.

This module holds the format's grids and holders and builds both documents (:class:`Layout`,
:func:`append_shard`, :func:`global_document`); :mod:`pyckpt._format_shards_read` reads them
(:func:`~pyckpt._format_shards_read.parse_global`, :class:`~pyckpt._format_shards_read.ShardedIndex`),
with the same strictness as the version-3 reader: exact keys and types, every chunk record one the writer can produce, every
shard's chunks packed back to back before it, every cell covered exactly by its holders'
segments. Errors are :class:`~pyckpt.errors.CheckpointFormatError` naming the file (for a shard:
the data file and the rank) and the key path.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyckpt import _C
from pyckpt._format_spec import (
    _MAX_FILE_BYTES,
    _SEAL_HEAD,
    _SEAL_LEN,
    FORMAT_NAME,
    MAX_NUMEL,
    MAX_PIECES,
    chunk_place_key,
    chunk_place_seed,
    codec_params_json,
    data_file_name,
    data_file_rank,
)
from pyckpt._format_write import tensor_header
from pyckpt._grid import Axis, Grid, Pieces
from pyckpt.errors import CheckpointFormatError

__all__ = ["SHARDED_VERSION", "SHARD_FORMAT", "Axis", "Grid", "Holders", "Layout", "ShardWritten",
           "append_shard", "build_shard", "build_global", "global_document", "is_sharded",
           "parse_grid"]

SHARDED_VERSION = 4
SHARD_FORMAT = "pyckpt-shard"
SHARD_ZSTD_LEVEL = 3
"""zstd level of a stored shard (one frame of its JSON text, see docs/FORMAT.md)."""
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# A version-4 document begins with exactly these bytes (readers dispatch on them).
PREFIX = b'{"format":"pyckpt","version":4,'
MAX_SHARD_TEXT = 64 << 20
"""A shard's JSON text, at most (stored as a zstd frame, or as itself). It bounds what a shard
costs to parse (about 10x its text in Python objects): a rank's 64 MiB are a million chunk
records, 4 TiB of its state in 4 MiB chunks. A save that needs more writes version 3."""
MAX_SHARD_RATIO = 32
"""A shard stored as a zstd frame holds at most this many times its stored bytes of text (plus
1 MiB): its records' checksums do not compress, so a writer's shards hold about 4x. Checked
from the frame header, before anything is decoded."""


def shard_text_limit(stored: int) -> int:
    """The most text a shard stored as a zstd frame of ``stored`` bytes may hold."""
    return min(MAX_SHARD_TEXT, MAX_SHARD_RATIO * stored + (1 << 20))


MIN_CONTAINER_BYTES = 6
"""A shard's text holds at most one JSON array or object per this many bytes: the densest a
writer makes are the segments of empty pieces, about one per 8 bytes. A denser text (``[]``
over and over: a few KiB as a zstd frame, gigabytes of Python objects) is refused unparsed."""
_MAX_RANK = (1 << 31) - 1
_GLOBAL_KEYS = frozenset(("format", "version", "created_by", "save_id", "dcp_version",
                          "storage_meta", "planner_data", "shards", "items",
                          "checksum"))
_TENSOR_KEYS = frozenset(("type", "dtype", "shape", "requires_grad", "memory_format", "grid",
                          "holders"))
_BYTES_KEYS = frozenset(("type", "nbytes", "segments"))
_HEX16 = re.compile(rb"[0-9a-f]{16}")
_SHARD_KEYS = frozenset(("format", "version", "save_id", "rank", "items", "checksum"))


def is_sharded(raw: bytes | memoryview) -> bool:
    """True when ``raw`` is a version-4 ``pyckpt.json`` (by its first bytes)."""
    return bytes(raw[: len(PREFIX)]) == PREFIX


# ---------------------------------------------------------------------------------- helpers


def _fail(origin: str, path: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{origin}: {path}: {what}" if path else f"{origin}: {what}")


def _describe(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (int, str, float, bool, type(None))) else type(
        v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _int(v: Any, origin: str, path: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _fail(origin, path, f"must be an integer in [{lo}, {hi}], got {_describe(v)}")
    return v


def _list(v: Any, origin: str, path: str) -> list[Any]:
    if type(v) is not list:
        raise _fail(origin, path, f"must be a list, got {_describe(v)}")
    return v


def _obj(v: Any, origin: str, path: str, keys: frozenset[str]) -> dict[str, Any]:
    if type(v) is not dict:
        raise _fail(origin, path, f"must be an object, got {_describe(v)}")
    if v.keys() != keys:
        missing, unknown = sorted(keys - v.keys()), sorted(v.keys() - keys)
        raise _fail(origin, path, f"keys differ from the format's: missing {missing}, unknown "
                                  f"{unknown}")
    return v


def _pairs_hook(duplicates: list[str]) -> Callable[[list[tuple[str, Any]]], Any]:
    """An ``object_pairs_hook`` that records the first repeated key of any object."""

    def hook(pairs: list[tuple[str, Any]]) -> Any:
        d = dict(pairs)
        if len(d) != len(pairs) and not duplicates:
            seen: set[str] = set()
            for k, _ in pairs:
                if k in seen:
                    duplicates.append(k)
                    break
                seen.add(k)
        return d

    return hook


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _parse_sealed(raw: bytes, origin: str) -> dict[str, Any]:
    """Checks the checksum member that ends ``raw`` and its density (:func:`check_density`),
    then parses it as strict UTF-8 JSON."""
    if len(raw) <= _SEAL_LEN or raw[len(raw) - _SEAL_LEN:len(raw) - 18] != _SEAL_HEAD or \
            raw[-2:] != b'"}':
        raise _fail(origin, "", "does not end with its checksum member")
    digits = raw[-18:-2]
    if _HEX16.fullmatch(digits) is None:
        raise _fail(origin, "", "does not end with its checksum member")
    recorded = int(digits, 16)
    actual = _C.xxh64(memoryview(raw)[: len(raw) - _SEAL_LEN])
    if actual != recorded:
        raise _fail(origin, "", f"metadata checksum mismatch (recorded xxh64:{recorded:016x}, "
                                f"computed xxh64:{actual:016x}): the file is damaged")
    check_density(raw, origin)
    duplicates: list[str] = []
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text, object_pairs_hook=_pairs_hook(duplicates),
                         parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _fail(origin, "", f"not valid JSON: {e}") from None
    if duplicates:
        raise _fail(origin, "", f"repeats the key {duplicates[0]!r} in an object")
    if type(doc) is not dict:
        raise _fail(origin, "", "must be a JSON object")
    return doc


def check_density(raw: bytes, origin: str) -> None:
    """Refuses JSON text ``raw`` (a shard, a version-4 ``pyckpt.json``) holding more than one
    array or object per :data:`MIN_CONTAINER_BYTES` bytes, before it is parsed: a writer's
    documents hold far fewer, and each costs tens of bytes of Python objects once parsed."""
    containers = raw.count(b"[") + raw.count(b"{")
    if containers * MIN_CONTAINER_BYTES > len(raw) + 64:
        raise _fail(origin, "", f"{containers} JSON arrays and objects in {len(raw)} bytes of "
                                "text: denser than pyckpt writes them (at most one per "
                                f"{MIN_CONTAINER_BYTES} bytes)")


def _seal(body: bytes) -> bytes:
    head = body[:-1]
    return head + _SEAL_HEAD + b"%016x" % _C.xxh64(head) + b'"}'


def _dumps(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# ------------------------------------------------------------------------------------ grids


def parse_grid(shape: tuple[int, ...], value: Any, origin: str, path: str) -> Grid:
    """The grid of a tensor of ``shape`` from its JSON form (:meth:`Grid.runs`), checked."""
    dims = _list(value, origin, path)
    if len(dims) != len(shape):
        raise _fail(origin, path, f"must list {len(shape)} dimensions, got {len(dims)}")
    axes = []
    cells = 1
    for d, (runs, n) in enumerate(zip(dims, shape)):
        dp = f"{path}[{d}]"
        runs = _list(runs, origin, dp)
        if not runs:
            raise _fail(origin, dp, "lists no cell")
        total = length = 0
        checked = []
        for k, run in enumerate(runs):
            rp = f"{dp}[{k}]"
            if type(run) is not list or len(run) != 2:
                raise _fail(origin, rp, "must be [cell size, count]")
            size = _int(run[0], origin, f"{rp}[0]", 0, MAX_NUMEL)
            count = _int(run[1], origin, f"{rp}[1]", 1, MAX_PIECES)
            if size == 0 and not (n == 0 and len(runs) == 1 and count == 1):
                raise _fail(origin, rp, "an empty cell is allowed only as the one cell of "
                                        "a dimension of size 0")
            total += count
            length += size * count
            if total > MAX_PIECES or length > MAX_NUMEL:
                raise _fail(origin, dp, f"more than {MAX_PIECES} cells or {MAX_NUMEL} "
                                        "elements")
            checked.append((size, count))
        if length != n:
            raise _fail(origin, dp, f"cells add up to {length}, the dimension is {n}")
        cells *= total
        if cells > MAX_PIECES:
            raise _fail(origin, path, f"more than {MAX_PIECES} cells")
        axes.append(Axis.of_runs(checked))
    return Grid(shape, tuple(axes))


@dataclass(frozen=True, slots=True)
class Holders:
    """The ranks holding each cell of an item, in the order of their segments: runs of cells
    held by one rank each (``[first, step, count]``: cell k of the run by ``first + k*step``)
    and single cells held by several ranks, or by none (``[[r0, r1, ...]]``)."""

    starts: tuple[int, ...]  # first cell of each run
    runs: tuple[tuple[int, ...] | tuple[tuple[int, ...]], ...]

    def of(self, cell: int) -> tuple[int, ...]:
        i = bisect.bisect_right(self.starts, cell) - 1
        run = self.runs[i]
        if len(run) == 1:
            return run[0]  # type: ignore[return-value]
        first, step, _ = run
        return (first + (cell - self.starts[i]) * step,)

    @staticmethod
    def encode(per_cell: Sequence[Sequence[int]]) -> list[Any]:
        out: list[Any] = []
        i, n = 0, len(per_cell)
        while i < n:
            h = per_cell[i]
            if len(h) != 1:
                out.append([list(h)])
                i += 1
                continue
            first, j = h[0], i + 1
            step = per_cell[j][0] - first if j < n and len(per_cell[j]) == 1 else 0
            while j < n and len(per_cell[j]) == 1 and per_cell[j][0] == first + (j - i) * step:
                j += 1
            out.append([first, step if j - i > 1 else 0, j - i])
            i = j
        return out

    @classmethod
    def parse(cls, value: Any, ncells: int, ranks: Mapping[int, Any], origin: str,
              path: str) -> Holders:
        runs = _list(value, origin, path)
        starts: list[int] = []
        out: list[Any] = []
        cell = 0
        for k, run in enumerate(runs):
            rp = f"{path}[{k}]"
            if type(run) is list and len(run) == 1:
                many = _list(run[0], origin, f"{rp}[0]")
                for j, r in enumerate(many):
                    _int(r, origin, f"{rp}[0][{j}]", 0, _MAX_RANK)
                    if r not in ranks:
                        raise _fail(origin, f"{rp}[0][{j}]", f"rank {r} has no shard")
                if len(set(many)) != len(many):
                    raise _fail(origin, f"{rp}[0]", "names a rank twice")
                starts.append(cell)
                out.append((tuple(many),))
                cell += 1
            elif type(run) is list and len(run) == 3:
                first = _int(run[0], origin, f"{rp}[0]", 0, _MAX_RANK)
                step = _int(run[1], origin, f"{rp}[1]", -_MAX_RANK, _MAX_RANK)
                count = _int(run[2], origin, f"{rp}[2]", 1, MAX_PIECES)
                last = first + (count - 1) * step
                if not 0 <= last <= _MAX_RANK:
                    raise _fail(origin, rp, f"names rank {last}")
                if cell + count > ncells:  # refused below, before its ranks are looked up
                    cell += count
                    break
                missing = _missing_in_run(first, step, count, ranks)
                if missing is not None:
                    raise _fail(origin, rp, f"rank {missing} has no shard")
                starts.append(cell)
                out.append((first, step, count))
                cell += count
            else:
                raise _fail(origin, rp, "must be [first rank, step, count] or [[ranks]]")
            if cell > ncells:
                break
        if cell != ncells:
            raise _fail(origin, path, f"name holders of {cell} cells, the item has {ncells}")
        return cls(tuple(starts), tuple(out))


def _missing_in_run(first: int, step: int, count: int, ranks: Mapping[int, Any]) -> int | None:
    """A rank of the holders run ``[first, step, count]`` without a shard in ``ranks``, else
    None. Every rank of the run is named a holder (not only its first and last): a reader looks
    up the shard of each. ``ranks`` may answer for the run itself (``missing_in_run``: the
    reader's shard table does it in O(1) for the usual step of 1, and once per distinct run)."""
    if count == 1 or step == 0:
        return None if first in ranks else first
    fast = getattr(ranks, "missing_in_run", None)
    if fast is not None:
        return fast(first, step, count)
    # more distinct ranks than shards: one is missing, found within len(ranks) + 1 steps
    for k in range(count):
        r = first + k * step
        if r not in ranks:
            return r
    return None


# ------------------------------------------------------------- the global list of shards


@dataclass(frozen=True, slots=True)
class ShardRef:
    rank: int
    file: str
    offset: int
    length: int
    xxh64: int


class _ShardTable(Mapping[int, ShardRef]):
    """Rank -> :class:`ShardRef` of a checked ``shards`` list, each made when asked for (a
    rank's load of a 4096-rank checkpoint asks for one or two)."""

    def __init__(self, save_id: str, ranks: tuple[int, ...], offsets: tuple[int, ...],
                 lengths: tuple[int, ...], digests: tuple[int, ...]) -> None:
        self._at = dict(zip(ranks, range(len(ranks))))
        self._save_id = save_id
        self._cols = offsets, lengths, digests
        self._runs: dict[tuple[int, int, int], int | None] = {}

    def missing_in_run(self, first: int, step: int, count: int) -> int | None:
        """A rank of the holders run ``[first, step, count]`` (``count`` > 1, ``step`` != 0)
        without a shard, else None (for :meth:`Holders.parse`): O(1) for a step of 1 or -1 (the
        ranks are sorted and unique, so those in a span are counted by position), else once per
        distinct run (every tensor of an FSDP save has the same one)."""
        key = (first, step, count)
        if key in self._runs:
            return self._runs[key]
        at = self._at
        last = first + (count - 1) * step
        lo, hi = min(first, last), max(first, last)
        missing: int | None = None
        if lo not in at or hi not in at:
            missing = first if first not in at else last
        elif abs(step) != 1 or at[hi] - at[lo] != hi - lo:
            # more distinct ranks than shards: one is missing, found within len(self) + 1 steps
            missing = next((r for r in range(first, last + step, step) if r not in at), None)
        self._runs[key] = missing
        return missing

    def __getitem__(self, rank: int) -> ShardRef:
        k = self._at[rank]
        offsets, lengths, digests = self._cols
        return ShardRef(rank, data_file_name(rank, 0, self._save_id), offsets[k], lengths[k],
                        digests[k])

    def __iter__(self) -> Iterator[int]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)

    def files(self) -> Mapping[str, int]:
        """Data file name -> size (each file ends with its shard), made when asked for."""
        return _FileSizes(self)


class _FileSizes(Mapping[str, int]):
    """The data files of a :class:`_ShardTable` and their sizes: ``<rank>-0.<save_id>.pyckpt``
    of every rank with a shard, ending where its shard ends."""

    def __init__(self, table: _ShardTable) -> None:
        self._table = table

    def __getitem__(self, name: str) -> int:
        t = self._table
        try:
            rank = data_file_rank(name)
        except ValueError:
            raise KeyError(name) from None
        k = t._at.get(rank)
        if k is None or name != data_file_name(rank, 0, t._save_id):
            raise KeyError(name)
        offsets, lengths, _ = t._cols
        return offsets[k] + lengths[k]

    def __iter__(self) -> Iterator[str]:
        save_id = self._table._save_id
        return (data_file_name(rank, 0, save_id) for rank in self._table._at)

    def __len__(self) -> int:
        return len(self._table)


def _shards_at_once(entries: list[Any], save_id: str) -> _ShardTable | None:
    """The shards of a well-formed ``shards`` list, checked a column at a time, in C loops (a
    rank's read of a 4096-rank checkpoint's global document); None when any check fails
    (:func:`_shards_one_by_one` then names the entry)."""
    if set(map(type, entries)) - {list} or set(map(len, entries)) - {4}:
        return None
    if not entries:
        return _ShardTable(save_id, (), (), (), ())
    ranks, offsets, lengths, digests = cols = tuple(zip(*entries))
    if set().union(*(map(type, col) for col in cols)) != {int}:
        return None
    if (min(ranks) < 0 or max(ranks) > _MAX_RANK or min(offsets) < 0 or min(lengths) < 1
            or max(lengths) > MAX_SHARD_TEXT or min(digests) < 0 or max(digests) >= 1 << 64
            or max(map(int.__add__, offsets, lengths)) > _MAX_FILE_BYTES
            or not all(map(int.__lt__, ranks, ranks[1:]))):
        return None
    return _ShardTable(save_id, ranks, offsets, lengths, digests)


def _shards_one_by_one(entries: list[Any], save_id: str, origin: str) -> _ShardTable:
    """:func:`_shards_at_once`, entry by entry: raises naming the first wrong value."""
    last = -1
    for k, entry in enumerate(entries):
        sp = f"shards[{k}]"
        if type(entry) is not list or len(entry) != 4:
            raise _fail(origin, sp, "must be [rank, file offset, length, xxh64]")
        rank = _int(entry[0], origin, f"{sp}[0]", 0, _MAX_RANK)
        if rank <= last:
            raise _fail(origin, f"{sp}[0]", "shards must be listed by increasing rank")
        last = rank
        offset = _int(entry[1], origin, f"{sp}[1]", 0, _MAX_FILE_BYTES)
        length = _int(entry[2], origin, f"{sp}[2]", 1, MAX_SHARD_TEXT)
        if offset + length > _MAX_FILE_BYTES:
            raise _fail(origin, sp, f"the shard ends at {offset + length}, beyond the "
                                    f"{_MAX_FILE_BYTES} bytes a data file may hold")
        _int(entry[3], origin, f"{sp}[3]", 0, (1 << 64) - 1)
    ranks, offsets, lengths, digests = (tuple(col) for col in zip(*entries))
    return _ShardTable(save_id, ranks, offsets, lengths, digests)


# ---------------------------------------------------------------------------------- writing


@dataclass
class Layout:
    """What a version-4 ``pyckpt.json`` says of a save's items, from the global plan: each
    tensor's grid and the ranks holding its cells. The JSON text of the tensors stored in
    shards is built once (:meth:`items_json`) and reused by every save of the plan; the items
    stored in ``pyckpt.json`` itself (:attr:`inline`) are written with each save's records."""

    tensors: dict[str, tuple[Any, Grid, list[list[int]]]] = field(default_factory=dict)
    bytes_items: dict[str, list[int]] = field(default_factory=dict)
    # Items whose chunk records go into pyckpt.json: every bytes item, and every tensor stored
    # as one piece split between several ranks (replicated state spread by bytes), which every
    # loading rank needs: it then reads no shard for them.
    inline: set[str] = field(default_factory=set)
    _items_json: str | None = None

    @classmethod
    def of_pieces(cls, pieces: Pieces) -> Layout:
        """The layout of a save whose global plan has these pieces."""
        layout = cls(dict(pieces.tensors), dict(pieces.bytes_items))
        layout.inline = {fqn for fqn, (_, grid, per_cell) in pieces.tensors.items()
                         if grid.ncells == 1 and len(per_cell[0]) > 1}
        layout.inline.update(pieces.bytes_items)
        return layout

    @classmethod
    def of_plans(cls, plans: Sequence[Any]) -> Layout | None:
        """The layout of DCP's final save plans: the pieces that :class:`pyckpt.SavePlanner`
        handed over with them (rank 0's ``storage_data.pieces``), else found in the plans
        (:meth:`Pieces.of_plans`); None when some tensor's pieces are not a grid."""
        pieces = getattr(plans[0].storage_data, "pieces", None) if plans else None
        if not isinstance(pieces, Pieces) or not pieces.describes(plans):
            pieces = Pieces.of_plans(plans)
        if pieces is None:
            return None
        # A reader refuses a tensor of more non-empty pieces than there are shards (a few
        # bytes of grid must not make a loading rank plan millions of reads): such a save (a
        # rank writing several pieces of one tensor, never DTensor's) is written as version 3.
        writers = max(1, sum(1 for p in plans if p.items))
        if any(grid.nonempty > writers for _, grid, _ in pieces.tensors.values()):
            return None
        return cls.of_pieces(pieces)

    def inline_by_rank(self) -> dict[int, frozenset[str]]:
        """rank -> the items of :attr:`inline` it writes (part of)."""
        out: dict[int, set[str]] = {}
        for fqn in self.inline:
            writers = self.bytes_items[fqn] if fqn in self.bytes_items else \
                self.tensors[fqn][2][0]
            for r in writers:
                out.setdefault(r, set()).add(fqn)
        return {r: frozenset(fqns) for r, fqns in out.items()}

    def _tensor(self, fqn: str) -> dict[str, Any]:
        p, grid, per_cell = self.tensors[fqn]
        return {**tensor_header(p, grid.shape), "grid": grid.runs(),
                "holders": Holders.encode(per_cell)}

    def items_json(self, inline: Mapping[str, list[Any]]) -> str:
        """The JSON text of ``items``: the tensors stored in shards built once, the inline
        items with this save's ``inline`` records (fqn -> ``[rank, raw_begin, codec,
        chunks]`` of every rank, any order)."""
        if self._items_json is None:
            self._items_json = _dumps({fqn: self._tensor(fqn) for fqn in self.tensors
                                       if fqn not in self.inline})
        extra: dict[str, Any] = {}
        for fqn in self.inline:
            segments = sorted(inline.get(fqn, []), key=lambda s: s[1])
            if fqn in self.bytes_items:
                extra[fqn] = {"type": "bytes", "nbytes": sum(c[1] for s in segments for c in s[3]),
                              "segments": segments}
            else:
                extra[fqn] = {**self._tensor(fqn), "segments": segments}
        if not extra:
            return self._items_json
        text = _dumps(extra)
        return text if self._items_json == "{}" else self._items_json[:-1] + "," + text[1:]


def _bound(fqn: str, offsets: Sequence[int], raw_begin: int, chunks: Sequence[Any]
           ) -> list[list[Any]]:
    """Chunk records in their JSON form, each checksum bound to its place (FORMAT.md, "Chunk
    checksums")."""
    seed = chunk_place_seed(fqn, offsets)
    records = []
    pos = raw_begin
    for c in chunks:
        records.append([c[0], c[1], c[2] ^ chunk_place_key(seed, pos), c[3], list(c[4])])
        pos += c[1]
    return records


def build_shard(rank: int, save_id: str,
                segments: Sequence[tuple[str, tuple[int, ...], int, Any, Sequence[Any]]]
                ) -> bytes:
    """One rank's shard: ``segments`` are (fqn, piece offsets, raw_begin, params, chunk
    records with plain XXH64s), in the order written."""
    items: dict[str, list[Any]] = {}
    for fqn, offsets, raw_begin, params, chunks in segments:
        items.setdefault(fqn, []).append(
            [list(offsets), raw_begin, codec_params_json(params),
             _bound(fqn, offsets, raw_begin, chunks)])
    doc = {"format": SHARD_FORMAT, "version": SHARDED_VERSION, "save_id": save_id,
           "rank": rank, "items": items}
    return _seal(_dumps(doc).encode("utf-8"))


def build_global(metadata: Any, layout: Layout, shards: Mapping[int, tuple[int, int, int, int]],
                 inline: Mapping[str, list[Any]], *, save_id: str, created_by: str,
                 planner_data: Any) -> bytes:
    """The version-4 ``pyckpt.json``: ``shards`` maps rank -> (file size, shard offset, shard
    length, shard XXH64); ``inline``: see :meth:`Layout.items_json`."""
    storage_meta = metadata.storage_meta
    head = {
        "format": FORMAT_NAME,
        "version": SHARDED_VERSION,
        "created_by": created_by,
        "save_id": save_id,
        "dcp_version": metadata.version,
        "storage_meta": {"modules": list(storage_meta.modules) if storage_meta else []},
        "planner_data": planner_data,
        "shards": [[r, s[1], s[2], s[3]] for r, s in sorted(shards.items())],
    }
    body = _dumps(head)[:-1] + ',"items":' + layout.items_json(inline) + "}"
    return _seal(body.encode("utf-8"))


# A rank's one write result in a version-4 save (pyckpt.Writer), and the coordinator's document.


@dataclass(frozen=True)
class ShardWritten:
    """What a rank of a version-4 save reports to the coordinator: its data file's size, where
    its metadata shard lies in it and the shard's XXH64, and its records of the items stored
    in ``pyckpt.json`` (:attr:`Layout.inline`: bytes items, split replicated tensors), as
    ``(fqn, raw_begin, codec, chunks)`` in JSON form: a few numbers, whatever the number of
    items it wrote."""

    rank: int
    file_size: int
    shard_offset: int
    shard_length: int
    shard_xxh64: int
    inline: list[tuple[str, int, list[Any], list[list[Any]]]]


def append_shard(sink: Any, items: Sequence[Any], rank: int, save_id: str,
                 segments: Mapping[int, list[Any]], inline: Collection[str]
                 ) -> tuple[int, int, int, list[Any]]:
    """Appends the shard of ``rank`` to its data file ``sink`` (a ``DataSink``): ``items`` are
    the rank's DCP write items, ``segments[i]`` the ``segment`` tuples written for item ``i``;
    the segments of items in ``inline`` are returned instead (for ``pyckpt.json``).
    Returns (offset, length, XXH64, the inline records)."""
    records = []
    kept: list[Any] = []
    for idx, item in enumerate(items):
        fqn = item.index.fqn
        td = item.tensor_data
        offsets = tuple(td.chunk.offsets) if td is not None else ()
        for _, raw_begin, params, chunks in segments[idx]:
            if fqn in inline:
                kept.append((fqn, raw_begin, codec_params_json(params),
                             _bound(fqn, offsets, raw_begin, chunks)))
            else:
                records.append((fqn, offsets, raw_begin, params, chunks))
    shard = build_shard(rank, save_id, records)
    if len(shard) > MAX_SHARD_TEXT:
        raise ValueError(f"rank {rank}: its metadata shard would be {len(shard)} bytes, more "
                         f"than {MAX_SHARD_TEXT}; save with "
                         "pyckpt.Writer(metadata_shards=False)")
    packed = _C.zstd_frame(shard, SHARD_ZSTD_LEVEL)  # about 4x smaller: the digests stay
    if len(packed) < len(shard) <= shard_text_limit(len(packed)):
        shard = packed  # (a reader refuses a frame of more text than that)
    offset = sink.size
    sink.append(shard)
    return offset, len(shard), _C.xxh64(shard), kept


def global_document(metadata: Any, layout: Layout, results: Sequence[Sequence[Any]], *,
                    save_id: str, created_by: str, planner_data: Any) -> tuple[dict[str, int],
                                                                               bytes]:
    """The data files (name -> size) and ``pyckpt.json`` of a version-4 save, from DCP's
    metadata, the plan's layout and each rank's write results (one :class:`ShardWritten`)."""
    shards: dict[int, tuple[int, int, int, int]] = {}
    inline: dict[str, list[Any]] = {}
    for rank_results in results:
        for wr in rank_results:
            w = wr.storage_data
            if not isinstance(w, ShardWritten):
                raise RuntimeError("pyckpt.Writer.finish: a rank wrote no metadata shard in a "
                                   "sharded save")
            if w.file_size != w.shard_offset + w.shard_length:  # readers take it as the size
                raise RuntimeError(f"pyckpt.Writer.finish: rank {w.rank}'s metadata shard does "
                                   "not end its data file")
            shards[w.rank] = (w.file_size, w.shard_offset, w.shard_length, w.shard_xxh64)
            for fqn, raw_begin, codec, chunks in w.inline:
                inline.setdefault(fqn, []).append([w.rank, raw_begin, codec, chunks])
    encoded = build_global(metadata, layout, shards, inline, save_id=save_id,
                           created_by=created_by, planner_data=planner_data)
    return {data_file_name(r, 0, save_id): s[0] for r, s in shards.items()}, encoded
