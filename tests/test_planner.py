"""Global save planning on synthetic DCP plans: byte ranges, balance, metadata, determinism."""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import time
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from pyckpt import _C, _replicas
from pyckpt.errors import ReplicaMismatchError
from pyckpt.planner import (
    SPLIT_ALIGNMENT,
    ByteRanges,
    SavePlanner,
    balance_save_plans,
    check_replica_digests,
    replica_digests,
)

MiB = 1 << 20


def tensor_item(
    fqn: str,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    offset: tuple[int, ...] | None = None,
    full: tuple[int, ...] | None = None,
) -> WriteItem:
    """A WriteItem like DCP makes for a plain tensor (or, with offset/full, a DTensor shard)."""
    off = torch.Size(offset if offset is not None else (0,) * len(shape))
    kind = WriteItemType.TENSOR if full is None else WriteItemType.SHARD
    return WriteItem(
        index=MetadataIndex(fqn, off),
        type=kind,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(off, torch.Size(shape)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(full if full is not None else shape),
        ),
    )


def bytes_item(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def nbytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def spans(plans: list[SavePlan]) -> dict[MetadataIndex, list[tuple[int, int, int]]]:
    """Per index: (start, end, rank) of every rank that writes part of it."""
    out: dict[MetadataIndex, list[tuple[int, int, int]]] = {}
    for rank, plan in enumerate(plans):
        assert isinstance(plan.storage_data, ByteRanges)
        for item in plan.items:
            size = nbytes(item) if item.tensor_data is not None else 0
            start, end = plan.storage_data.ranges.get(item.index, (0, size))
            out.setdefault(item.index, []).append((start, end, rank))
        # Ranges only name items the rank writes.
        assert set(plan.storage_data.ranges) <= {i.index for i in plan.items}
    return out


def loads(plans: list[SavePlan]) -> list[int]:
    out = [0] * len(plans)
    for parts in spans(plans).values():
        for start, end, rank in parts:
            out[rank] += end - start
    return out


def check_tiling(
    before: list[SavePlan], after: list[SavePlan], alignment: int = SPLIT_ALIGNMENT
) -> None:
    """Every input item is written exactly once, by holders, with aligned tiling ranges."""
    holders: dict[MetadataIndex, set[int]] = {}
    items: dict[MetadataIndex, WriteItem] = {}
    for rank, plan in enumerate(before):
        for item in plan.items:
            holders.setdefault(item.index, set()).add(rank)
            items[item.index] = item
    got = spans(after)
    assert set(got) == set(holders)
    for index, parts in got.items():
        item = items[index]
        assert {rank for _, _, rank in parts} <= holders[index]
        assert len({rank for _, _, rank in parts}) == len(parts)  # one range per (rank, item)
        if item.type == WriteItemType.BYTE_IO:
            assert len(parts) == 1
            continue
        parts.sort()
        size = nbytes(item)
        assert parts[0][0] == 0 and parts[-1][1] == size
        for (_, end, _), (start, _, _) in zip(parts, parts[1:]):
            assert end == start
        for start, end, _ in parts:
            assert start < end or size == 0
            assert start % alignment == 0
            assert end % alignment == 0 or end == size


def replicated(items: list[WriteItem], world: int) -> list[SavePlan]:
    return [SavePlan(list(items)) for _ in range(world)]


# --- balance on the acceptance layouts ------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_single_replicated_tensor_is_split_evenly(world: int) -> None:
    before = replicated([tensor_item("w", (64 * MiB,), torch.float32)], world)
    after = balance_save_plans(before)
    check_tiling(before, after)
    got = loads(after)
    assert sum(got) == 256 * MiB
    assert max(got) / (sum(got) / world) <= 1.01
    assert all(len(p.items) == 1 for p in after)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("count,shape", [(64, (MiB,)), (256, (256, 256)), (7, (3, 1 << 20))])
def test_many_equal_tensors(world: int, count: int, shape: tuple[int, ...]) -> None:
    items = [tensor_item(f"layer{i}.weight", shape) for i in range(count)]
    before = replicated(items, world)
    after = balance_save_plans(before)
    check_tiling(before, after)
    got = loads(after)
    assert max(got) / (sum(got) / world) <= 1.05
    # At most world - 1 items are split: the packing cuts one stream once per rank boundary.
    assert sum(len(p.storage_data.ranges) for p in after) <= 2 * (world - 1)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_huge_plus_small_in_adversarial_order(world: int) -> None:
    # Small items first: DCP's greedy dedup would spread them evenly and then hand the huge
    # tensor whole to one rank.
    small = [tensor_item(f"s{i}", (64, 1024), torch.bfloat16) for i in range(512)]  # 128 KiB
    huge = tensor_item("huge", (192 * MiB // 4,), torch.float32)
    before = replicated([*small, huge], world)
    after = balance_save_plans(before)
    check_tiling(before, after)
    got = loads(after)
    assert max(got) / (sum(got) / world) <= 1.05


def test_byte_io_is_written_once_by_least_loaded_holder() -> None:
    before = [
        SavePlan([tensor_item("a", (4 * MiB,)), bytes_item("step"), bytes_item("lr")]),
        SavePlan([tensor_item("b", (2 * MiB,)), bytes_item("step"), bytes_item("lr")]),
    ]
    after = balance_save_plans(before)
    check_tiling(before, after)
    # Rank 1 carries less sharded data: it writes both non-tensor values.
    assert [i.index.fqn for i in after[1].items] == ["b", "step", "lr"]
    assert [i.index.fqn for i in after[0].items] == ["a"]


def test_sharded_items_stay_and_count_as_load() -> None:
    # Rank 0 already writes 20 MiB of its own; a replicated 40 MiB tensor goes 10 MiB to rank 0
    # and 30 MiB to rank 1 so that both end at 30 MiB.
    own = tensor_item("own", (5 * MiB,), offset=(0,), full=(5 * MiB,))
    rep = tensor_item("rep", (10 * MiB,))
    before = [SavePlan([own, rep]), SavePlan([rep])]
    after = balance_save_plans(before)
    check_tiling(before, after)
    assert loads(after) == [30 * MiB, 30 * MiB]
    assert [i.index.fqn for i in after[0].items] == ["own", "rep"]
    assert after[0].storage_data.ranges == {MetadataIndex("rep", (0,)): (0, 10 * MiB)}
    assert after[1].storage_data.ranges == {MetadataIndex("rep", (0,)): (10 * MiB, 40 * MiB)}


def test_overloaded_owner_gets_no_replicated_bytes() -> None:
    own = tensor_item("own", (20 * MiB,), offset=(0,), full=(20 * MiB,))
    rep = tensor_item("rep", (5 * MiB,))
    before = [SavePlan([own, rep]), SavePlan([rep])]
    after = balance_save_plans(before)
    assert [i.index.fqn for i in after[0].items] == ["own"]
    assert [i.index.fqn for i in after[1].items] == ["rep"]
    assert after[1].storage_data.ranges == {}  # written whole


def test_hsdp_replica_groups_share_their_shard() -> None:
    # 2x2 mesh (replicate, shard): ranks {0, 2} hold rows [0, 8), ranks {1, 3} rows [8, 16).
    full = (16, 4 * MiB)
    top = tensor_item("w", (8, 4 * MiB), offset=(0, 0), full=full)
    bottom = tensor_item("w", (8, 4 * MiB), offset=(8, 0), full=full)
    before = [SavePlan([top]), SavePlan([bottom]), SavePlan([top]), SavePlan([bottom])]
    after = balance_save_plans(before)
    check_tiling(before, after)
    assert loads(after) == [64 * MiB] * 4


def test_non_tensor_copies_must_agree() -> None:
    before = [SavePlan([tensor_item("w", (4, 4))]), SavePlan([tensor_item("w", (4, 5))])]
    with pytest.raises(ValueError, match="'w'"):
        balance_save_plans(before)
    with pytest.raises(ValueError, match="twice"):
        balance_save_plans([SavePlan([tensor_item("w", (4,)), tensor_item("w", (4,))])])
    with pytest.raises(ValueError, match="multiple of 16"):
        balance_save_plans([], split_alignment=24)


def test_zero_size_and_scalar_items() -> None:
    items = [tensor_item("empty", (0, 3)), tensor_item("scalar", ()), tensor_item("x", (5,))]
    before = replicated(items, 3)
    after = balance_save_plans(before)
    check_tiling(before, after)
    assert sum(len(p.items) for p in after) == 3


# --- properties ---------------------------------------------------------------------------

ALIGN = 64  # small alignment so that small synthetic tensors are split too

_dtypes = st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.float64])


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[SavePlan], list[int]]:
    """Random plans: each item held by a random non-empty subset of ranks."""
    world = draw(st.integers(1, 6))
    n = draw(st.integers(0, 40))
    plans: list[list[WriteItem]] = [[] for _ in range(world)]
    for i in range(n):
        holders = draw(st.sets(st.integers(0, world - 1), min_size=1))
        if draw(st.integers(0, 9)) == 0:
            item = bytes_item(f"obj{i}")
        else:
            numel = draw(st.integers(0, 5000))
            item = tensor_item(f"t{i}", (numel,), draw(_dtypes))
        for r in holders:
            plans[r].append(item)
    order = draw(st.randoms())
    for items in plans:
        order.shuffle(items)
    return [SavePlan(items) for items in plans], list(range(world))


@given(layouts())
def test_ranges_tile_every_item(layout: tuple[list[SavePlan], list[int]]) -> None:
    before, _ = layout
    after = balance_save_plans(before, split_alignment=ALIGN)
    check_tiling(before, after, ALIGN)


@given(layouts(), st.randoms())
def test_result_ignores_item_arrival_order(
    layout: tuple[list[SavePlan], list[int]], rnd: random.Random
) -> None:
    before, _ = layout
    shuffled = []
    for plan in before:
        items = list(plan.items)
        rnd.shuffle(items)
        shuffled.append(SavePlan(items))
    a = spans(balance_save_plans(before, split_alignment=ALIGN))
    b = spans(balance_save_plans(shuffled, split_alignment=ALIGN))
    assert {k: sorted(v) for k, v in a.items()} == {k: sorted(v) for k, v in b.items()}


@given(
    world=st.integers(2, 6),
    sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=40),
    shard_sizes=st.lists(st.integers(0, 50_000), min_size=6, max_size=6),
)
def test_balance_is_optimal_up_to_alignment(
    world: int, sizes: list[int], shard_sizes: list[int]
) -> None:
    """Fully replicated items on top of per-rank shards: max load <= optimum + alignment."""
    shared = [tensor_item(f"r{i}", (n,), torch.uint8) for i, n in enumerate(sizes)]
    before = [
        SavePlan([*shared, tensor_item(f"own{r}", (shard_sizes[r],), torch.uint8)])
        for r in range(world)
    ]
    after = balance_save_plans(before, split_alignment=ALIGN)
    check_tiling(before, after, ALIGN)
    got = loads(after)
    fixed = shard_sizes[:world]
    # The fractional optimum: the water level over the shards, or the largest shard.
    optimum = max(max(fixed), math.ceil((sum(sizes) + sum(fixed)) / world))
    assert max(got) <= optimum + ALIGN
    # Shards never move.
    for r in range(world):
        assert MetadataIndex(f"own{r}", (0,)) in {i.index for i in after[r].items}


@given(
    groups=st.integers(1, 4),
    replicas=st.integers(2, 4),
    sizes=st.lists(st.integers(1, 30_000), min_size=1, max_size=20),
)
def test_disjoint_replica_groups_are_balanced(groups: int, replicas: int, sizes: list[int]) -> None:
    """HSDP shape: rank g + groups * k holds shard g; each group balances its own bytes."""
    world = groups * replicas
    plans: list[list[WriteItem]] = [[] for _ in range(world)]
    for g in range(groups):
        for i, n in enumerate(sizes):
            item = tensor_item(f"p{i}", (n,), torch.uint8, offset=(g * n,), full=(groups * n,))
            for k in range(replicas):
                plans[g + groups * k].append(item)
    before = [SavePlan(p) for p in plans]
    after = balance_save_plans(before, split_alignment=ALIGN)
    check_tiling(before, after, ALIGN)
    got = loads(after)
    target = math.ceil(sum(sizes) / replicas)
    assert max(got) <= target + ALIGN


# --- SavePlanner.create_global_plan: metadata ------------------------------------------------


def test_global_plan_metadata_names_each_chunk_once() -> None:
    full = (4, 3 * MiB)
    w0 = tensor_item("w", (2, 3 * MiB), offset=(0, 0), full=full)
    w1 = tensor_item("w", (2, 3 * MiB), offset=(2, 0), full=full)
    rep = tensor_item("rep", (10 * MiB,), torch.uint8)
    before = [
        SavePlan([rep, w0, bytes_item("step")], planner_data={"rep": ("rep",), "w": ("w",)}),
        SavePlan([w1, rep, bytes_item("step")], planner_data={"step": ("step",)}),
        SavePlan([w0, bytes_item("step"), rep], planner_data={}),
        SavePlan([rep, w1, bytes_item("step")], planner_data={}),
    ]
    planner = SavePlanner()
    plans, metadata = planner.create_global_plan(before)
    check_tiling(before, plans)
    md = metadata.state_dict_metadata
    assert isinstance(md["step"], BytesStorageMetadata)
    assert isinstance(md["rep"], TensorStorageMetadata) and len(md["rep"].chunks) == 1
    assert isinstance(md["w"], TensorStorageMetadata)
    assert sorted(tuple(c.offsets) for c in md["w"].chunks) == [(0, 0), (2, 0)]
    assert metadata.planner_data == {"rep": ("rep",), "w": ("w",), "step": ("step",)}
    # Every written item and byte range names a chunk of the metadata, and every writer of an
    # index holds the same item.
    finals: dict[tuple[str, tuple[int, ...]], WriteItem] = {}
    for plan in plans:
        for item in plan.items:
            key = (item.index.fqn, tuple(item.index.offset or ()))
            assert finals.setdefault(key, item) is item
            if item.type == WriteItemType.BYTE_IO:
                continue
            assert item.index.offset in [c.offsets for c in md[item.index.fqn].chunks]
        for index in plan.storage_data.ranges:
            assert index.offset in [c.offsets for c in md[index.fqn].chunks]
    got = loads(plans)
    assert max(got) / (sum(got) / len(got)) <= 1.1


def test_global_plan_rejects_missing_shards() -> None:
    full = (4, 8)
    before = [
        SavePlan([tensor_item("w", (2, 8), offset=(0, 0), full=full)]),
        SavePlan([tensor_item("v", (1,))]),
    ]
    with pytest.raises(ValueError, match="'?w'?: chunks cover 16 elements of 32"):
        SavePlanner().create_global_plan(before)


def test_planner_rejects_bad_alignment() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        SavePlanner(split_alignment=1000)


def test_planner_refuses_a_writer_other_than_pyckpts(tmp_path: Any) -> None:
    """DCP's FileSystemWriter ignores the byte ranges of split items; a save through it failed
    with ``AttributeError: 'ByteRanges' object has no attribute 'prefix'`` from DCP's code."""
    import torch.distributed.checkpoint as dcp

    from pyckpt.errors import find_error

    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.ones(4)}, storage_writer=dcp.FileSystemWriter(tmp_path / "ck"),
                 planner=SavePlanner(), no_dist=True)
    error = find_error(info.value)
    assert isinstance(error, ValueError), info.value
    assert "pyckpt.Writer" in str(error) and "DefaultSavePlanner" in str(error), error
    assert not (tmp_path / "ck" / ".metadata").exists()


def _replicated_plans(n: int, world: int) -> list[SavePlan]:
    items = [tensor_item(f"layers.{i}.weight", (256, 64 + i % 7)) for i in range(n)]
    mapping = {f"layers.{i}.weight": ("layers", str(i), "weight") for i in range(n)}
    return [SavePlan(list(items), planner_data=dict(mapping)) for _ in range(world)]


def test_planning_time_grows_about_linearly() -> None:
    small, large = _replicated_plans(2_000, 4), _replicated_plans(8_000, 4)
    times: dict[int, list[float]] = {2_000: [], 8_000: []}
    gc.collect()
    gc.freeze()  # keep collector pauses over the (large) inputs out of the measurement
    try:
        for _ in range(4):  # interleaved, so a burst of machine noise hits both sizes
            for n, plans in ((2_000, small), (8_000, large)):
                start = time.process_time()  # CPU time: steadier on a shared machine
                SavePlanner().create_global_plan(plans)
                times[n].append(time.process_time() - start)
    finally:
        gc.unfreeze()
    ratio = min(times[8_000]) / min(times[2_000])
    # 4x the items: O(n log n) predicts ~4.5x; a quadratic step would give ~16x.
    assert ratio < 10, times


def test_metadata_matches_dcp_default_planner() -> None:
    """Oracle: DCP's own planner on the same plans describes the same tensors and chunks."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    full = (6, 2 * MiB)
    shards = [tensor_item("w", (2, 2 * MiB), offset=(2 * k, 0), full=full) for k in range(3)]
    common = [
        tensor_item("rep", (3 * MiB + 5,), torch.bfloat16),
        bytes_item("epoch"),
        tensor_item("scalar", ()),
    ]
    before = [SavePlan([*common, shards[r % 3]], planner_data={"rep": ("rep",)}) for r in range(6)]
    ours = SavePlanner().create_global_plan(before)[1]
    dcp = DefaultSavePlanner().create_global_plan(before)[1]
    assert ours.planner_data == dcp.planner_data
    assert ours.state_dict_metadata.keys() == dcp.state_dict_metadata.keys()
    for fqn, md in dcp.state_dict_metadata.items():
        mine = ours.state_dict_metadata[fqn]
        assert type(mine) is type(md)
        if isinstance(md, TensorStorageMetadata):
            assert (mine.size, mine.properties) == (md.size, md.properties)
            key = lambda c: tuple(c.offsets)  # noqa: E731
            assert sorted(mine.chunks, key=key) == sorted(md.chunks, key=key)


# --- replica check -----------------------------------------------------------------------


def checked_plan(items: list[WriteItem], digests: dict[str, tuple[str, int]]) -> SavePlan:
    """A local plan carrying digests, as SavePlanner.create_local_plan makes it."""
    keyed = {}
    for item in items:
        if item.index.fqn in digests:
            keyed[_replicas._key(item.index)] = digests[item.index.fqn]
    return _replicas._CheckedPlan(items=items, replica_digests=keyed)


def test_replica_digest_sees_any_single_byte() -> None:
    # Three host blocks and a tail: flip one byte at the edges and at the block boundaries.
    block = _replicas._HASH_BLOCK_BYTES
    base = torch.arange(3 * block + 100, dtype=torch.uint8)
    (reference,) = replica_digests([base])
    assert reference[0] == "xxh64"
    for pos in (0, 1, block - 1, block, 2 * block + 7, base.numel() - 1):
        changed = base.clone()
        changed[pos] ^= 1
        assert replica_digests([changed])[0] != reference, pos
    # Values, not layout: a transposed view and its contiguous copy agree; the thread count
    # and batching with other tensors do not change a digest.
    m = torch.randn(300, 77)
    assert replica_digests([m.t()]) == replica_digests([m.t().contiguous()])
    many = [base, m, torch.zeros(0), torch.tensor(3.5)]
    assert replica_digests(many, threads=1) == replica_digests(many, threads=4)
    assert replica_digests(many, threads=3)[0] == reference
    # Same bytes, different dtype view: the same bytes (shape/dtype are checked separately).
    assert replica_digests([torch.zeros(4)]) == replica_digests(
        [torch.zeros(16, dtype=torch.uint8)]
    )
    assert replica_digests([torch.zeros(4)]) != replica_digests([torch.zeros(3)])


def test_device_checksum_sees_one_or_two_changed_words() -> None:
    # The device path is plain torch: on CPU tensors it computes what it computes on a GPU.
    row = 4 * _replicas._DEVICE_ROW_WORDS
    rows = _replicas._DEVICE_CHUNK_ROWS + 3  # two chunks: column sums add up across them
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 256, (rows * row + 1001,), dtype=torch.uint8, generator=g)
    reference = _replicas._rowcol_checksum(base)
    assert reference.dtype == torch.int64
    assert reference.numel() == rows + _replicas._DEVICE_ROW_WORDS + 1001
    assert torch.equal(_replicas._rowcol_checksum(base.clone()), reference)
    for positions in (
        [0],
        [row - 1],
        [rows * row - 1],  # last byte of the last whole row
        [rows * row + 1000],  # in the tail
        [5, 6],  # two bytes of one word
        [8, 8 + row],  # one column, two rows
        [3 * row + 12, 3 * row + 40],  # one row, two columns
    ):
        changed = base.clone()
        for pos in positions:
            changed[pos] ^= 0x41
        assert not torch.equal(_replicas._rowcol_checksum(changed), reference), positions
    # Exact at the extremes: all words -1 / INT32_MIN sum without wrapping.
    ones = torch.full((2 * row,), 0xFF, dtype=torch.uint8)
    assert _replicas._rowcol_checksum(ones)[:2].tolist() == [-_replicas._DEVICE_ROW_WORDS] * 2
    # A view that starts off a 4-byte boundary (a bf16 parameter inside a flat buffer).
    buffer = torch.randint(0, 256, (3 * row + 2,), dtype=torch.uint8, generator=g)
    view = buffer[2:]
    assert view.storage_offset() % 4 == 2
    assert torch.equal(
        _replicas._rowcol_checksum(view), _replicas._rowcol_checksum(view.clone())
    )


def test_device_digests_batch_small_tensors_and_sum_large_ones() -> None:
    small = torch.arange(1000, dtype=torch.int16).view(torch.uint8)
    large = torch.randint(0, 256, (_replicas._DEVICE_SMALL_BYTES + 4096,), dtype=torch.uint8)
    arrays, checksums = _replicas._device_digests([small, large, small[:0]])
    # Small ones come back as bytes, hashed like a host copy: the same digest kind and value.
    assert arrays[0].tobytes() == small.numpy().tobytes() and checksums[0] == 0
    assert arrays[2].nbytes == 0
    assert replica_digests([small])[0][0] == "xxh64"
    assert arrays[1].nbytes == 0 and checksums[1] != 0
    changed = large.clone()
    changed[-5000] += 1
    assert _replicas._device_digests([changed])[1][0] != checksums[1]
    assert _replicas._device_digests([large.clone()])[1][0] == checksums[1]


def test_mismatching_replicas_are_refused_by_rank_groups() -> None:
    items = [tensor_item("w", (4 * MiB,)), tensor_item("b", (16,)), bytes_item("meta")]
    same = {"w": ("xxh64", 1), "b": ("xxh64", 2)}
    odd = {"w": ("xxh64", 9), "b": ("xxh64", 2)}
    plans = [checked_plan(items, d) for d in (same, odd, same, odd)]
    with pytest.raises(ReplicaMismatchError) as info:
        SavePlanner().create_global_plan(plans)
    assert info.value.mismatches == {"w": [[0, 2], [1, 3]]}
    assert "'w': ranks [0, 2] vs [1, 3]" in str(info.value)
    assert "'b'" not in str(info.value)
    assert isinstance(info.value, ValueError)
    # DCP pickles the error to send it to every rank: the groups survive.
    import pickle

    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is ReplicaMismatchError
    assert again.mismatches == info.value.mismatches and str(again) == str(info.value)
    # Opting out: the same plans are balanced as before.
    global_plan, _ = SavePlanner(check_replicas=False).create_global_plan(plans)
    assert sum(len(p.items) for p in global_plan) >= 3
    assert all(type(p) is SavePlan for p in global_plan)  # the digests do not travel back


def test_replica_check_names_shards_and_limits_the_message() -> None:
    # HSDP: ranks 0/2 hold rows [0, 2) of 'h', ranks 1/3 rows [2, 4); rank 3 disagrees.
    def shard(offset: int) -> WriteItem:
        return tensor_item("h", (2, 8), offset=(offset, 0), full=(4, 8))

    plans = [
        checked_plan([shard(0)], {"h": ("xxh64", 1)}),
        checked_plan([shard(2)], {"h": ("xxh64", 2)}),
        checked_plan([shard(0)], {"h": ("xxh64", 1)}),
        checked_plan([shard(2)], {"h": ("xxh64", 3)}),
    ]
    with pytest.raises(ReplicaMismatchError) as info:
        check_replica_digests(plans)
    assert info.value.mismatches == {"h at offset [2, 0]": [[1], [3]]}
    # Many differing items: every one in the attribute, the message stays short.
    items = [tensor_item(f"t{i:02d}", (4,)) for i in range(20)]
    plans = [checked_plan(items, {f"t{i:02d}": ("xxh64", r) for i in range(20)}) for r in range(2)]
    with pytest.raises(ReplicaMismatchError) as info:
        check_replica_digests(plans)
    assert len(info.value.mismatches) == 20
    assert "and 12 more" in str(info.value) and len(str(info.value)) < 1000


def test_replica_digests_of_different_kinds_are_not_compared() -> None:
    # One copy in host memory, one on a device: the digests are of different kinds.
    items = [tensor_item("w", (8,))]
    plans = [checked_plan(items, {"w": ("xxh64", 1)}), checked_plan(items, {"w": ("rowcol", 2)})]
    check_replica_digests(plans)
    plans.append(checked_plan(items, {"w": ("rowcol", 3)}))
    with pytest.raises(ReplicaMismatchError) as info:
        check_replica_digests(plans)
    assert info.value.mismatches == {"w": [[0], [1], [2]]}
    # Plans without digests (DCP's planner, check_replicas=False) are not checked.
    check_replica_digests([SavePlan(items), SavePlan(items)])


def test_local_plan_has_no_digests_in_one_process() -> None:
    planner = SavePlanner()
    planner.set_up_planner({"w": torch.ones(4)}, is_coordinator=True)
    plan = planner.create_local_plan()
    assert not getattr(plan, "replica_digests", None)


# --- sampled replica check (the default) -----------------------------------------------------

BLOCK = _replicas._SAMPLE_BLOCK_BYTES
COUNT = _replicas._SAMPLE_BLOCKS


def sampled(t: torch.Tensor) -> tuple[str, int]:
    (digest,) = replica_digests([t], mode="sample")
    return digest


def sample_of(flat: torch.Tensor) -> list[int]:
    """The blocks a sampled digest of the byte tensor ``flat`` reads."""
    data = flat.numpy()
    m = max(1, -(-data.nbytes // BLOCK))
    first, last = _C.xxh64(data[:BLOCK]), _C.xxh64(data[(m - 1) * BLOCK :])
    return _C.sampled_blocks(data.nbytes, BLOCK, COUNT, first, last)


def test_sampled_blocks_are_the_ends_and_one_per_stratum() -> None:
    assert BLOCK * COUNT == MiB  # the documented bound of a sampled digest's reading
    for n in (0, 1, BLOCK, BLOCK * COUNT, BLOCK * COUNT + 1, 10 * MiB + 5, 1 << 40):
        blocks = _C.sampled_blocks(n, BLOCK, COUNT, 1, 2)
        m = max(1, -(-n // BLOCK))
        if m <= COUNT:
            assert blocks == list(range(m)), n
            continue
        assert len(blocks) == COUNT and blocks[0] == 0 and blocks[-1] == m - 1, n
        inner, strata = m - 2, COUNT - 2
        for j, b in enumerate(blocks[1:-1]):
            assert 1 + j * inner // strata <= b < 1 + (j + 1) * inner // strata, (n, j)
    # The choice follows the content of the first and last blocks, and nothing else.
    n = 64 * MiB
    blocks = _C.sampled_blocks(n, BLOCK, COUNT, 1, 2)
    assert blocks == _C.sampled_blocks(n, BLOCK, COUNT, 1, 2)
    assert blocks != _C.sampled_blocks(n, BLOCK, COUNT, 1, 3)
    assert blocks != _C.sampled_blocks(n, BLOCK, COUNT, 4, 2)
    with pytest.raises(ValueError, match="block size"):
        _C.sampled_blocks(n, 0, COUNT, 1, 2)
    with pytest.raises(ValueError, match="count"):
        _C.sampled_digests([b"abc"], BLOCK, 2)


def test_sampled_digest_sees_changes_in_its_sample_and_not_elsewhere() -> None:
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, 256, (8 * MiB + 1001,), dtype=torch.uint8, generator=g)
    n = base.numel()
    reference = sampled(base)
    assert reference[0] == "sampled"
    assert sampled(base.clone()) == reference
    blocks = sample_of(base)
    assert len(blocks) == COUNT
    # Any change inside a sampled block is found (the last one is the 1001-byte tail).
    for b in blocks:
        for pos in (b * BLOCK, b * BLOCK + 5000 % (n - b * BLOCK), min(n, (b + 1) * BLOCK) - 1):
            base[pos] ^= 0x10
            assert sampled(base) != reference, (b, pos)
            base[pos] ^= 0x10
    # The documented limit: a change confined to blocks outside the sample is not seen by the
    # default check (the full check sees it).
    full = replica_digests([base])[0]
    unsampled = sorted(set(range(-(-n // BLOCK))) - set(blocks))
    for b in unsampled[:: len(unsampled) // 8]:
        base[b * BLOCK + 100] ^= 0x10
        assert sampled(base) == reference, b
        assert replica_digests([base])[0] != full, b
        base[b * BLOCK + 100] ^= 0x10
    # A desynchronised replica (every element slightly off) is always found.
    assert sampled(base ^ 1) != reference


def test_sampled_digest_finds_every_long_enough_differing_run() -> None:
    # Strata hold at most s = ceil((m - 2) / 62) blocks, so the gap between two sampled blocks
    # is at most 2 s - 2 blocks and any differing run of 2 s blocks' bytes meets the sample.
    g = torch.Generator().manual_seed(11)
    base = torch.randint(0, 256, (8 * MiB + 1001,), dtype=torch.uint8, generator=g)
    n = base.numel()
    m = -(-n // BLOCK)
    s = -(-(m - 2) // (COUNT - 2))
    run = 2 * s * BLOCK
    rng = random.Random(3)
    for _ in range(200):
        blocks = _C.sampled_blocks(n, BLOCK, COUNT, rng.getrandbits(64), rng.getrandbits(64))
        assert max(b - a - 1 for a, b in zip(blocks, blocks[1:])) <= 2 * s - 2
    reference = sampled(base)
    # Just after the sampled block before the widest gap of this content's sample, and spread.
    blocks = sample_of(base)
    a = max(zip(blocks, blocks[1:]), key=lambda ab: ab[1] - ab[0])[0]
    for start in [(a + 1) * BLOCK, *range(0, n - run, 49999), n - run]:
        base[start : start + run] ^= 0x01
        assert sampled(base) != reference, start
        base[start : start + run] ^= 0x01


def test_sampled_digests_match_between_host_and_device_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The device path is plain torch: on CPU tensors it gathers what it gathers on a GPU.
    g = torch.Generator().manual_seed(9)
    buffer = torch.randint(0, 256, (5 * MiB + 3,), dtype=torch.uint8, generator=g)
    tensors = [
        buffer[:0],
        buffer[:5],
        buffer[: BLOCK * COUNT],  # read whole
        buffer[: BLOCK * COUNT + 1],  # the smallest sampled tensor: the tail is one byte
        buffer[2:],  # starts off a 4-byte boundary
        buffer[3 : 3 + 3 * MiB].view(torch.int8),
        torch.randn(1000, 700, generator=g).t(),  # values, not layout
    ]
    host = replica_digests(tensors, mode="sample")
    assert all(kind == "sampled" for kind, _ in host)
    flats = [_replicas._flat_bytes(t) for t in tensors]
    sizes = [f.numel() for f in flats]
    for batch in (_replicas._DEVICE_BATCH_BYTES, 100_000):  # one transfer; several
        monkeypatch.setattr(_replicas, "_DEVICE_BATCH_BYTES", batch)
        samples = _replicas._device_samples(flats)
        for flat, got in zip(flats, samples):
            want = b"".join(
                flat[b * BLOCK : (b + 1) * BLOCK].numpy().tobytes() for b in sample_of(flat)
            )
            assert got.tobytes() == want and got.nbytes <= BLOCK * COUNT
        values = _C.block_digests(samples, BLOCK, sizes)
        assert [("sampled", v) for v in values] == host
    # Neither the thread count nor the company of other tensors changes a digest.
    assert replica_digests(tensors, mode="sample", threads=1) == host
    assert replica_digests(tensors[::-1], mode="sample", threads=3) == host[::-1]


def test_check_replicas_modes() -> None:
    assert SavePlanner().check_replicas == "sample"
    assert SavePlanner(check_replicas=True).check_replicas == "sample"
    assert SavePlanner(check_replicas="sample").check_replicas == "sample"
    assert SavePlanner(check_replicas="full").check_replicas == "full"
    assert SavePlanner(check_replicas=False).check_replicas is False
    assert SavePlanner(check_replicas=" Full").check_replicas == "full"  # any case
    for bad in ("off", 1, 0, None):
        with pytest.raises(ValueError, match="check_replicas must be"):
            SavePlanner(check_replicas=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'full' or 'sample'"):
        replica_digests([torch.ones(2)], mode="fast")  # type: ignore[arg-type]


# --- stored-size weights (compressing writers) -------------------------------------------


def sized_plan(items: list[WriteItem], stored: dict[str, int]) -> SavePlan:
    """A local plan carrying stored-size estimates, as SavePlanner makes it for a zstd writer."""
    from pyckpt.planner import _LocalPlan

    keyed = {_replicas._key(i.index): stored[i.index.fqn] for i in items if i.index.fqn in stored}
    return _LocalPlan(items=items, stored_sizes=keyed)


def test_replicated_items_are_balanced_by_stored_size() -> None:
    # Two 8 MiB tensors that store in almost nothing and two 4 MiB ones that do not, replicated
    # on two ranks. By raw bytes each rank takes 12 MiB and one of them both small, dense
    # tensors; by stored size, each rank stores half of the dense bytes.
    items = [tensor_item(f"zeros.{i}", (2 * MiB,)) for i in range(2)]
    items += [tensor_item(f"dense.{i}", (MiB,)) for i in range(2)]
    stored = {"zeros.0": 1000, "zeros.1": 1000, "dense.0": 3 * MiB, "dense.1": 3 * MiB}
    plans = balance_save_plans([sized_plan(items, stored), sized_plan(items, stored)])
    load = [0.0, 0.0]
    for index, parts in spans(plans).items():
        weight = stored[index.fqn] / (4 * (2 * MiB if "zeros" in index.fqn else MiB))
        for start, end, rank in parts:
            load[rank] += (end - start) * weight
    assert max(load) / (sum(load) / 2) <= 1.02, load
    # Without estimates: raw bytes, as before (one rank stores both dense tensors).
    raw = balance_save_plans([SavePlan(items), SavePlan(items)])
    dense = [sum(e - s for s, e, r in spans(raw)[i.index] if r == 0) for i in items[2:]]
    assert sum(dense) in (0, 8 * MiB)


def test_stored_size_estimates_follow_the_codec() -> None:
    from pyckpt._format import RAW_THRESHOLD
    from pyckpt._stored_size import Encoding, stored_sizes

    zstd = Encoding("zstd", 1, True, RAW_THRESHOLD)
    g = torch.Generator().manual_seed(5)
    dense = torch.randn(3 * MiB + 7, generator=g)
    tensors = [torch.zeros(MiB), dense, dense.clone(), torch.ones(3), torch.empty(0)]
    sizes = stored_sizes(tensors, zstd)
    assert sizes[0] < 16 * 1024  # zeros: almost nothing
    assert 0.8 * dense.nbytes < sizes[1] <= dense.nbytes  # random fp32: most of it
    assert sizes[1] == sizes[2] == stored_sizes([dense], zstd, threads=1)[0]  # deterministic
    assert sizes[3] >= 1 and sizes[4] == 0
    raw = Encoding(None, 1, True, RAW_THRESHOLD)
    assert stored_sizes(tensors, raw) == [t.nbytes for t in tensors]


# --- the pieces handed to the storage writer -----------------------------------------------


@given(layouts(), st.integers(1, 4), st.integers(1, 3))
def test_planner_pieces_are_those_of_its_final_plans(
    layout: tuple[list[SavePlan], list[int]], rows: int, cols: int
) -> None:
    """The grids and writers the planner hands over with rank 0's plan are what the writer
    would find in the final plans itself; a pickled plan leaves them behind."""
    import pickle

    from pyckpt._grid import Pieces

    before, _ = layout
    world = len(before)
    # a tensor split into a rows x cols grid of uneven tiles, tile k held by rank k % world
    row_bounds, col_bounds = [0, 1, 3, 4, 7][: rows + 1], [0, 2, 3, 5][: cols + 1]
    full = (row_bounds[-1], col_bounds[-1])
    k = 0
    for r0, r1 in zip(row_bounds, row_bounds[1:]):
        for c0, c1 in zip(col_bounds, col_bounds[1:]):
            before[k % world].items.append(
                tensor_item("tp", (r1 - r0, c1 - c0), offset=(r0, c0), full=full))
            k += 1
    plans, metadata = SavePlanner(split_alignment=ALIGN).create_global_plan(before)
    pieces = plans[0].storage_data.pieces
    assert pieces is not None and pieces.describes(plans)
    assert pieces == Pieces.of_plans(plans)
    assert pieces.tensors["tp"][1].counts == (rows, cols)
    for fqn, (_, grid, _) in pieces.tensors.items():
        md = metadata.state_dict_metadata[fqn]
        assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks) == sorted(
            grid.cell(i) for i in range(grid.ncells))
    again = pickle.loads(pickle.dumps(plans[0].storage_data))
    assert again.pieces is None and again.ranges == plans[0].storage_data.ranges
    assert all(p.storage_data.pieces is None for p in plans[1:])


def test_no_pieces_when_a_tensor_is_not_a_grid() -> None:
    full = (4, 4)
    before = [SavePlan([tensor_item("w", (2, 4), offset=(0, 0), full=full)]),
              SavePlan([tensor_item("w", (2, 2), offset=(2, 0), full=full),
                        tensor_item("w", (2, 2), offset=(2, 2), full=full)])]
    plans, _ = SavePlanner().create_global_plan(before)
    assert plans[0].storage_data.pieces is None


def test_the_writer_finds_the_pieces_again_when_the_plans_changed() -> None:
    from pyckpt import _format_shards

    full = (4, 4)
    before = [SavePlan([tensor_item("w", (2, 4), offset=(0, 0), full=full)]),
              SavePlan([tensor_item("w", (2, 4), offset=(2, 0), full=full), bytes_item("s")])]
    plans, _ = SavePlanner().create_global_plan(before)
    assert plans[0].storage_data.pieces is not None
    # a planner subclass dropping an item after the balancing: the handed-over pieces are stale
    plans[1] = SavePlan(plans[1].items[:1], storage_data=plans[1].storage_data)
    layout = _format_shards.Layout.of_plans(plans)
    assert layout is not None and layout.bytes_items == {}
    assert layout.tensors["w"][2] == [[0], [1]]


# --- plans collected once per digest ---------------------------------------------------------


def _digested(plans: list[SavePlan]) -> list[SavePlan]:
    """The plans as pyckpt.SavePlanner's local step makes them: each with its digest."""
    from pyckpt._balance import plan_digest
    from pyckpt.planner import _LocalPlan

    return [_LocalPlan(items=p.items, replica_digests=getattr(p, "replica_digests", {}),
                       digest=plan_digest(p.items, getattr(p, "replica_digests", {})))
            for p in plans]


def _outcome(plans: list[SavePlan], metadata: Metadata) -> tuple[Any, ...]:
    per_rank = [([(i.index.fqn, tuple(i.index.offset or ())) for i in p.items],
                 sorted((k.fqn, tuple(k.offset or ()), v)
                        for k, v in p.storage_data.ranges.items())) for p in plans]
    return per_rank, metadata.state_dict_metadata


@given(layouts(), st.lists(st.integers(0, 5), min_size=2, max_size=12))
def test_plans_with_equal_digests_are_planned_as_without_them(
    layout: tuple[list[SavePlan], list[int]], pattern: list[int]
) -> None:
    """Ranks whose plans hold the same items (DDP, HSDP replica groups, interleaved or not) are
    collected once per digest; the global plan and metadata are those of a per-item pass."""
    import copy

    kinds, _ = layout
    # rank r holds the items of plan pattern[r] (copies, as unpickled plans are)
    before = [SavePlan(copy.deepcopy(kinds[k % len(kinds)].items)) for k in pattern]
    plain = SavePlanner(split_alignment=ALIGN).create_global_plan(before)
    digested = SavePlanner(split_alignment=ALIGN).create_global_plan(_digested(before))
    assert _outcome(*digested) == _outcome(*plain)
    check_tiling(before, digested[0], ALIGN)


def test_a_plan_changed_after_its_digest_is_collected_item_by_item() -> None:
    """A writer's prepare_local_plan that drops items after the digest was taken: that rank
    is collected on its own (its plan's length differs), never from another rank's items."""
    items = [tensor_item("w", (4 * MiB,)), tensor_item("b", (16,))]
    before = _digested([SavePlan(list(items)), SavePlan(list(items)), SavePlan(list(items))])
    before[2] = dataclasses.replace(before[2], items=items[:1])
    plans, metadata = SavePlanner(check_replicas=False).create_global_plan(before)
    writers_of_b = [r for r, p in enumerate(plans) if any(i.index.fqn == "b" for i in p.items)]
    assert writers_of_b and 2 not in writers_of_b
    assert set(metadata.state_dict_metadata) == {"w", "b"}


def test_replica_mismatch_with_digests_names_every_rank() -> None:
    items = [tensor_item("w", (4 * MiB,)), tensor_item("b", (16,))]
    same = {"w": ("xxh64", 1), "b": ("xxh64", 2)}
    odd = {"w": ("xxh64", 9), "b": ("xxh64", 2)}
    plans = _digested([checked_plan(items, d) for d in (same, odd, same, odd, odd)])
    assert len({p.digest for p in plans}) == 2
    with pytest.raises(ReplicaMismatchError) as info:
        SavePlanner().create_global_plan(plans)
    assert info.value.mismatches == {"w": [[0, 2], [1, 3, 4]]}
    SavePlanner().create_global_plan(_digested([checked_plan(items, same)] * 3))
