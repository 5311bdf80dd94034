"""pyckpt.LoadPlanner: the same read items as DCP's planner, found through the per-tensor index
of stored chunks (pyckpt._chunkindex) in O(log N + k) instead of DCP's O(N log N) per tensor."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_distributed
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import pyckpt
from pyckpt import _format, _loadplan
from pyckpt._chunkindex import ChunkIndex, sweep_dim, sweep_order
from pyckpt._loadplan import (
    IndexedTensorStorageMetadata,
    indexed_tensor_metadata,
    read_items_for_chunks,
)

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _key(it: ReadItem) -> tuple[Any, ...]:
    """Everything a read item says (``MetadataIndex.index`` does not take part in equality)."""
    return (it.type, it.dest_index.fqn, tuple(it.dest_index.offset or ()), it.dest_index.index,
            tuple(it.dest_offsets), it.storage_index.fqn, tuple(it.storage_index.offset or ()),
            it.storage_index.index, tuple(it.storage_offsets), tuple(it.lengths))


def _items(items: Sequence[ReadItem]) -> Counter[tuple[Any, ...]]:
    return Counter(map(_key, items))


def _chunks(boxes: Sequence[Box]) -> list[ChunkStorageMetadata]:
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes]


def _metadata(shape: Sequence[int], boxes: Sequence[Box]) -> IndexedTensorStorageMetadata:
    return indexed_tensor_metadata(TensorProperties(dtype=torch.float32), torch.Size(shape),
                                   _chunks(boxes))


@contextlib.contextmanager
def _no_dcp_planning() -> Iterator[None]:
    """Fails any planning that goes through DCP's code instead of the index."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("DCP's load planning ran instead of the chunk index")

    saved = (_loadplan.create_read_items_for_chunk_list,
             default_planner.create_default_local_load_plan)
    _loadplan.create_read_items_for_chunk_list = refuse
    default_planner.create_default_local_load_plan = refuse
    try:
        yield
    finally:
        (_loadplan.create_read_items_for_chunk_list,
         default_planner.create_default_local_load_plan) = saved


# ------------------------------------------------------------ layouts: random partitions, boxes


@st.composite
def _grid(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """A grid partition of ``shape``: per dimension, sorted cut points (repeats make empty
    pieces)."""
    axes = []
    for n in shape:
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
        bounds = [0, *cuts, n]
        axes.append(list(zip(bounds, bounds[1:])))
    boxes: list[Box] = [((), ())]
    for spans in axes:
        boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in spans]
    return boxes


@st.composite
def _guillotine(draw: st.DrawFn, offsets: tuple[int, ...], sizes: tuple[int, ...],
                depth: int = 0) -> list[Box]:
    """A partition of the box by recursive cuts (not a grid: neighbours need not line up)."""
    if not sizes or depth >= 4 or not draw(st.booleans()):
        return [(offsets, sizes)]
    d = draw(st.integers(0, len(sizes) - 1))
    cut = draw(st.integers(0, sizes[d]))
    a = (offsets, sizes[:d] + (cut,) + sizes[d + 1:])
    b = (offsets[:d] + (offsets[d] + cut,) + offsets[d + 1:],
         sizes[:d] + (sizes[d] - cut,) + sizes[d + 1:])
    return draw(_guillotine(*a, depth + 1)) + draw(_guillotine(*b, depth + 1))


@st.composite
def _box(draw: st.DrawFn, shape: tuple[int, ...]) -> Box:
    offsets = tuple(draw(st.integers(0, n)) for n in shape)
    sizes = tuple(draw(st.integers(0, n - o)) for n, o in zip(shape, offsets))
    return offsets, sizes


@st.composite
def _layout(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box], list[Box]]:
    """(shape, stored pieces in document order, wanted local chunks)."""
    shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
    ndim = len(shape)
    partition = st.one_of(_grid(shape), _guillotine((0,) * ndim, shape))
    stored = draw(st.permutations(draw(partition)))  # any document order
    wanted = draw(st.one_of(st.lists(_box(shape), max_size=4), partition))
    return shape, list(stored), wanted


@given(_layout())
def test_read_items_match_dcps_for_random_layouts(
    layout: tuple[tuple[int, ...], list[Box], list[Box]],
) -> None:
    shape, stored, wanted = layout
    md = _metadata(shape, stored)
    assert md.index() is not None
    local = _chunks(wanted)
    ours = read_items_for_chunks("t", md, local)
    assert _items(ours) == _items(create_read_items_for_chunk_list("t", md, local))


def test_layouts_cover_the_edge_cases() -> None:
    # Explicit cases beside the random ones: 0-d, empty tensors, empty pieces and boxes, a
    # reversed document, boxes straddling pieces along the non-sweep dimension.
    cases: list[tuple[tuple[int, ...], list[Box], list[Box]]] = [
        ((), [((), ())], [((), ())]),
        ((0,), [((0,), (0,))], [((0,), (0,))]),
        ((0, 3), [((0, 0), (0, 3))], [((0, 0), (0, 3)), ((0, 1), (0, 1))]),
        ((6,), [((4,), (2,)), ((2,), (2,)), ((2,), (0,)), ((0,), (2,))],
         [((3,), (0,)), ((2,), (0,)), ((0,), (6,)), ((1,), (4,))]),
        ((4, 6), [((2, 3), (2, 3)), ((2, 0), (2, 3)), ((0, 3), (2, 3)), ((0, 0), (2, 3))],
         [((1, 2), (2, 2)), ((0, 0), (4, 6)), ((3, 5), (1, 1)), ((0, 3), (4, 0))]),
    ]
    for shape, stored, wanted in cases:
        md = _metadata(shape, stored)
        local = _chunks(wanted)
        ours = read_items_for_chunks("t", md, local)
        assert _items(ours) == _items(create_read_items_for_chunk_list("t", md, local)), shape
        assert ours or shape in ((0,), (0, 3)), shape


def test_without_an_index_dcps_function_plans() -> None:
    md = _metadata((4,), [((0,), (2,)), ((2,), (2,))])
    md.chunks = list(md.chunks)  # replaced since the index was built: the index is not used
    assert md.index() is None
    with pytest.raises(AssertionError, match="DCP's load planning ran"), _no_dcp_planning():
        read_items_for_chunks("t", md, _chunks([((1,), (2,))]))
    ours = read_items_for_chunks("t", md, _chunks([((1,), (2,))]))
    assert [(tuple(i.storage_offsets), tuple(i.lengths)) for i in ours] == [((1,), (1,)),
                                                                           ((0,), (1,))]


def test_indexed_metadata_compares_like_dcps() -> None:
    md = _metadata((4,), [((0,), (4,))])
    plain = TensorStorageMetadata(md.properties, md.size, list(md.chunks))
    assert md == plain and plain == md
    assert md != BytesStorageMetadata()


# ------------------------------------------------------------------- planning cost, counted


class _CountingChunks(list):  # type: ignore[type-arg]
    """A tensor's stored chunk list that counts how many chunks planning looks at."""

    looked_at = 0

    def __getitem__(self, i: Any) -> Any:
        item = super().__getitem__(i)
        self.looked_at += len(item) if isinstance(i, slice) else 1
        return item

    def __iter__(self) -> Iterator[Any]:
        for item in super().__iter__():
            self.looked_at += 1
            yield item


class _Shard(int):
    """A destination that holds one chunk of a tensor, as a DTensor tells DCP
    (``__create_chunk_list__``), without storage. An ``int`` because DCP's state-dict walk keeps
    ints (and tensors) and replaces other leaves."""

    _size: torch.Size
    _chunk: ChunkStorageMetadata

    def __new__(cls, size: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> _Shard:
        self = super().__new__(cls, 0)
        self._size = torch.Size(size)
        self._chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        return self

    def size(self) -> torch.Size:
        return self._size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk]


N = 4096


@pytest.mark.parametrize(
    ("shape", "rows"),
    [((2 * N, 8), 2),                # sweep dimension 0 for DCP as well
     ((N, 1 << 20), 1)],             # wider than long: DCP sweeps along dim 1, the index dim 0
    ids=["tall", "wide"],
)
def test_planning_looks_at_the_overlapping_pieces_only(
    shape: tuple[int, int], rows: int,
) -> None:
    # N pieces of `rows` rows each (FSDP's dim-0 sharding over N ranks); one rank of a load at
    # N/2 ranks wants 2 consecutive pieces, another a slice inside one piece.
    cols = shape[1]
    chunks = _CountingChunks(_chunks([((r * rows, 0), (rows, cols)) for r in range(N)]))
    md = indexed_tensor_metadata(TensorProperties(dtype=torch.bfloat16), torch.Size(shape),
                                 chunks)
    metadata = Metadata(state_dict_metadata={"w": md})
    wanted = {
        "pair": ((1000 * rows, 0), (2 * rows, cols)),                # 2 pieces
        "inside": ((77 * rows, 1), (1, cols - 2)),                   # 1 piece
        "straddle": ((3 * rows - 1, 0), (2, cols)),                  # 2 pieces
    }
    for name, (offsets, sizes) in wanted.items():
        planner = pyckpt.LoadPlanner()
        planner.set_up_planner({"w": _Shard(shape, offsets, sizes)}, metadata, False)
        chunks.looked_at = 0
        with _no_dcp_planning():
            plan = planner.create_local_plan()
        k = len(plan.items)
        assert k == (1 if name == "inside" else 2), name
        # O(log N + k): the candidates the bisects leave, each looked at once (and once more to
        # build its read item); nothing proportional to N.
        assert chunks.looked_at <= 2 * k + 2, (name, chunks.looked_at)

        dcp_planner = DefaultLoadPlanner()
        dcp_planner.set_up_planner({"w": _Shard(shape, offsets, sizes)}, metadata, False)
        chunks.looked_at = 0
        expect = dcp_planner.create_local_plan()
        assert chunks.looked_at >= N  # the counter sees DCP's O(N) pass over the pieces
        assert _items(plan.items) == _items(expect.items), name


def test_sweep_dimension_counts_the_cuts() -> None:
    rows = _chunks([((r, 0), (1, 1 << 20)) for r in range(8)])
    assert sweep_dim((8, 1 << 20), rows) == 0  # DCP would sweep along dim 1
    cols = _chunks([((0, c), (1 << 20, 1)) for c in range(8)])
    assert sweep_dim((1 << 20, 8), cols) == 1
    grid = _chunks([((r * 4, c * 2), (4, 2)) for r in range(2) for c in range(4)])
    assert sweep_dim((8, 8), grid) == 1  # 4 distinct column starts against 2 row starts
    assert sweep_dim((8, 8), _chunks([((0, 0), (8, 8))])) == 0
    assert sweep_dim((), _chunks([((), ())])) == -1


def test_index_sorts_a_document_in_any_order() -> None:
    boxes = [((r * 3, 0), (3, 5)) for r in range(50)]
    random.Random(3).shuffle(boxes)
    chunks = _chunks(boxes)
    index = ChunkIndex((150, 5), chunks)
    hits = list(index.overlapping((30, 0), (7, 5)))  # rows 30..36: pieces at 30, 33, 36
    assert sorted(chunks[i].offsets[0] for i in hits) == [30, 33, 36]
    assert [chunks[i].offsets[0] for i in hits] == [30, 33, 36]  # in sweep order
    ordered = sweep_order((150, 5), chunks)
    assert [c.offsets[0] for c in ordered] == list(range(0, 150, 3))
    assert sweep_order((150, 5), ordered) is ordered  # already sorted: returned as is


def test_writer_emits_pieces_in_sweep_order() -> None:
    # Pieces arrive in DCP's order (rank order); the document lists them along the sweep
    # dimension (here dim 1, the only one cut), whatever the order of the ranks.
    chunks = _chunks([((0, c * 4), (6, 4)) for c in (3, 1, 0, 2)])
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                              torch.Size((6, 16)), chunks)
    encoded = _format.build_metadata(Metadata(state_dict_metadata={"w": md}), {}, {},
                                     save_id="0" * 12, created_by="test")
    doc = json.loads(encoded)
    assert [p["offsets"] for p in doc["items"]["w"]["pieces"]] == [[0, 0], [0, 4], [0, 8],
                                                                  [0, 12]]
    assert [c.offsets[1] for c in md.chunks] == [12, 4, 0, 8]  # DCP's metadata untouched


# ------------------------------------------------------ a real checkpoint through the Reader

ROWS, COLS = 64, 1024  # float32 rows of exactly one 4 KiB chunk


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(ROWS, COLS, generator=g),
        "b": torch.randn(COLS, generator=g).to(torch.bfloat16),
        "s": torch.tensor(2.5),
        "e": torch.zeros(0, 3),
        "step": 7,
        "nested": {"m": torch.arange(8), "lr": 0.5},
    }


def _zeros() -> dict[str, Any]:
    return {
        "w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS, dtype=torch.bfloat16),
        "s": torch.tensor(0.0), "e": torch.zeros(0, 3), "step": 0,
        "nested": {"m": torch.zeros(8, dtype=torch.int64), "lr": 0.0},
    }


def _split_rows_shuffled(doc: dict[str, Any]) -> None:
    """Splits 'w' (one chunk per row) into row pieces of 1-9 rows, listed in a shuffled order."""
    item = doc["items"]["w"]
    (piece,) = item["pieces"]
    (seg,) = piece["segments"]
    rng = random.Random(11)
    bounds = [0]
    while bounds[-1] < ROWS:
        bounds.append(min(ROWS, bounds[-1] + rng.randint(1, 9)))
    pieces = [{"offsets": [r0, 0], "sizes": [r1 - r0, COLS],
               "segments": [{**seg, "raw_begin": 0, "chunks": seg["chunks"][r0:r1]}]}
              for r0, r1 in zip(bounds, bounds[1:])]
    rng.shuffle(pieces)
    item["pieces"] = pieces


@pytest.fixture
def shuffled(tmp_path: Path) -> Path:
    """A checkpoint whose 'w' is stored as row pieces in no particular order (an edited or older
    document: pyckpt's writer emits them sorted)."""
    path = tmp_path / "ck"
    pyckpt.save(_state(), path, compression=None, chunk_bytes=4 * COLS)
    _format.rewrite_metadata(path, _split_rows_shuffled, rebind=True)
    offsets = [p.offsets[0] for p in _format.read_index(path).tensors["w"].pieces]
    assert len(offsets) > 8 and offsets != sorted(offsets)
    return path


def test_pyckpt_load_plans_through_the_index(shuffled: Path) -> None:
    out = _zeros()
    with _no_dcp_planning():
        pyckpt.load(out, shuffled)
        expect = _state()
        for k in ("w", "b", "s", "e"):
            assert torch.equal(out[k], expect[k]), k
        assert out["step"] == 7 and out["nested"]["lr"] == 0.5
        assert torch.equal(out["nested"]["m"], expect["nested"]["m"])

        out = _zeros()
        dcp.load(out, storage_reader=pyckpt.Reader(shuffled), planner=pyckpt.LoadPlanner())
        assert torch.equal(out["w"], expect["w"])


def test_reader_metadata_is_indexed_and_plans_like_dcp(shuffled: Path) -> None:
    md = pyckpt.Reader(shuffled).read_metadata()
    w = md.state_dict_metadata["w"]
    assert isinstance(w, IndexedTensorStorageMetadata) and w.index() is not None
    # Row ranges of every kind against the unsorted pieces: read items as DCP's.
    for r0, r1 in ((0, ROWS), (5, 6), (9, 40), (63, 64), (10, 10)):
        local = _chunks([((r0, 0), (r1 - r0, COLS)), ((r0, 3), (r1 - r0, 1))])
        assert _items(read_items_for_chunks("w", w, local)) == _items(
            create_read_items_for_chunk_list("w", w, local))
    # Whole plans, nested keys and non-tensor values included.
    ours, theirs = pyckpt.LoadPlanner(), DefaultLoadPlanner()
    ours.set_up_planner(_zeros(), md, True)
    theirs.set_up_planner(_zeros(), md, True)
    with _no_dcp_planning():
        plan = ours.create_local_plan()
    assert _items(plan.items) == _items(theirs.create_local_plan().items)
    assert len(plan.items) > 10


def _plan_error(planner: DefaultLoadPlanner, state: dict[str, Any], md: Metadata) -> Exception:
    planner.set_up_planner(state, md, False)
    with pytest.raises(Exception) as info:
        planner.create_local_plan()
    return info.value


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda s: s.__setitem__("missing", torch.zeros(2)), RuntimeError),   # not stored
        (lambda s: s.__setitem__("w", torch.zeros(ROWS, COLS + 1)), ValueError),  # size
        (lambda s: s.__setitem__("w", 3), ValueError),   # a tensor loaded into an int
    ],
    ids=["missing-key", "size-mismatch", "not-a-tensor"],
)
def test_errors_are_dcps(shuffled: Path, change: Any, error: type[Exception]) -> None:
    md = pyckpt.Reader(shuffled).read_metadata()
    ours, theirs = _zeros(), _zeros()
    change(ours)
    change(theirs)
    mine = _plan_error(pyckpt.LoadPlanner(), ours, md)
    expect = _plan_error(DefaultLoadPlanner(), theirs, md)
    assert type(mine) is type(expect) is error
    assert str(mine) == str(expect)


def test_partial_loads_skip_missing_keys_as_dcp(shuffled: Path) -> None:
    md = pyckpt.Reader(shuffled).read_metadata()
    plans = []
    for planner in (pyckpt.LoadPlanner(allow_partial_load=True),
                    DefaultLoadPlanner(allow_partial_load=True)):
        state = {"w": torch.zeros(ROWS, COLS), "absent": torch.zeros(3), "step": 0}
        planner.set_up_planner(state, md, False)
        plans.append(_items(planner.create_local_plan().items))
    assert plans[0] == plans[1]
    assert {k[1] for k in plans[0]} == {"w", "step"}


def test_metadata_of_other_readers_is_planned_by_dcp(tmp_path: Path) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path))
    out = _zeros()
    reader = dcp.FileSystemReader(tmp_path)
    md = reader.read_metadata()
    assert not any(isinstance(m, IndexedTensorStorageMetadata)
                   for m in md.state_dict_metadata.values())
    dcp.load(out, storage_reader=reader, planner=pyckpt.LoadPlanner())
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 7


# ------------------------------------------------------- resharding over gloo ranks, bit-exact

R, C = 97, 41  # uneven over 2 and 3 ranks


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "h":
        return torch.randn(R, C, generator=g).to(torch.bfloat16)
    if name == "v":
        return torch.randn(10, generator=g)
    if name == "e":
        return torch.zeros(0, 3)
    return torch.randn(R, C, generator=g)


def _sharded(mesh: Any, placements: dict[str, Any], zero: bool) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    sd: dict[str, Any] = {}
    for name, placement in placements.items():
        full = _full(name)
        sd[name] = distribute_tensor(torch.zeros_like(full) if zero else full, mesh, [placement])
    sd["s"] = torch.tensor(0.0 if zero else 2.5)
    sd["step"] = 0 if zero else 11
    sd["opt"] = {"lr": 0.0 if zero else 0.1}
    return sd


def _save_worker(rank: int, world: int, path: str, shards: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    sd = _sharded(mesh, {"w": Shard(0), "h": Shard(1), "v": Shard(0), "e": Shard(0)}, False)
    # shards=False: one document (format version 3), whose pieces a test lists in reverse order
    pyckpt.save(sd, path, compression="zstd", chunk_bytes=4096, metadata_shards=shards)


def _load_worker(rank: int, world: int, path: str, reversed_path: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    placements = {"w": Shard(1), "h": Shard(0), "v": Replicate(), "e": Shard(0)}

    def check(sd: dict[str, Any]) -> None:
        for name, placement in placements.items():
            expect = distribute_tensor(_full(name), mesh, [placement]).to_local()
            assert torch.equal(sd[name].to_local(), expect), name
        assert sd["s"].item() == 2.5 and sd["step"] == 11 and sd["opt"]["lr"] == 0.1

    with _no_dcp_planning():
        sd = _sharded(mesh, placements, True)
        pyckpt.load(sd, path)
        check(sd)
        sd = _sharded(mesh, placements, True)  # pieces listed in reverse order
        dcp.load(sd, storage_reader=pyckpt.Reader(reversed_path), planner=pyckpt.LoadPlanner())
        check(sd)
    if reversed_path == path:  # a sharded checkpoint: DCP's planner through the grids too
        sd = _sharded(mesh, placements, True)
        dcp.load(sd, storage_reader=pyckpt.Reader(path), planner=DefaultLoadPlanner())
        check(sd)

    # This rank's plan, against DCP's on the same metadata and DTensors.
    md = pyckpt.Reader(reversed_path).read_metadata()
    plans = []
    for planner in (pyckpt.LoadPlanner(), DefaultLoadPlanner()):
        planner.set_up_planner(_sharded(mesh, placements, True), md, rank == 0)
        plans.append(_items(planner.create_local_plan().items))
    assert plans[0] == plans[1]
    return sum(plans[0].values())


@pytest.mark.slow
@pytest.mark.distributed
def test_resharded_round_trip_over_gloo_ranks(tmp_path: Path) -> None:
    path, rev = tmp_path / "ck", tmp_path / "rev"
    run_distributed(_save_worker, 2, str(path))
    shutil.copytree(path, rev)

    def reverse(doc: dict[str, Any]) -> None:
        for item in doc["items"].values():
            if item["type"] == "tensor":
                item["pieces"].reverse()

    _format.rewrite_metadata(rev, reverse)
    assert [p.offsets for p in _format.read_index(rev).tensors["w"].pieces] == [(49, 0), (0, 0)]
    counts = run_distributed(_load_worker, 3, str(path), str(rev))
    assert all(n >= 8 for n in counts)


@pytest.mark.distributed
def test_resharded_round_trip_of_a_sharded_checkpoint(tmp_path: Path) -> None:
    """The same over format version 4 (the pieces as grids, pyckpt._format_shards): 2 ranks
    save, 3 load with other placements; pyckpt's plan equals DCP's on the grid metadata."""
    path = tmp_path / "ck"
    run_distributed(_save_worker, 2, str(path), True)
    assert _format.read_index(path).version == 4
    counts = run_distributed(_load_worker, 3, str(path), str(path))
    assert all(n >= 8 for n in counts)
