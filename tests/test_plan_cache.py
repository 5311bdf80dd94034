"""Cached save plans (pyckpt._savedrive) on 3 real gloo ranks: an unchanged structure reuses
its plans, every change on any rank plans again on every rank, and every save loads back
bit-exactly. Also the gather / scatter collectives the driver uses."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from dist_utils import run_distributed

WORLD = 3


def _state(rank: int, world: int, seed: int, *, extra: bool = False,
           dtype: torch.dtype = torch.float32, rows: int = 12) -> dict[str, Any]:
    """A sharded DTensor (dim-0 over every rank), replicated plain tensors and a step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(rows * world, 8, generator=g).to(dtype)
    sd: dict[str, Any] = {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "norm": torch.randn(64, generator=g).to(dtype),  # the same on every rank (replicated)
        "emb": torch.randn(300, 16, generator=g),
        "step": seed,
    }
    if extra:
        sd[f"only_rank{rank}"] = torch.full((5,), float(rank))
    return sd


def _fresh_like(sd: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh,
                                        v.placements, shape=v.shape, stride=v.stride())
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = -1
    return out


def _check_load(sd: dict[str, Any], path: str) -> None:
    from torch.distributed.tensor import DTensor

    import pyckpt

    dest = _fresh_like(sd)
    pyckpt.load(dest, path)
    for k, v in sd.items():
        got = dest[k]
        if isinstance(v, DTensor):
            assert torch.equal(got.to_local(), v.to_local()), k
        elif isinstance(v, torch.Tensor):
            assert got.dtype == v.dtype and torch.equal(got, v), k
        else:
            assert got == v, k


def _save_counting(sd: dict[str, Any], path: str, **kw: Any) -> str:
    """Saves; returns "planned" or "cached" (what this rank's driver did)."""
    import pyckpt
    from pyckpt import _savedrive

    before = dict(_savedrive.stats)
    pyckpt.save(sd, path, **kw)
    done = [k for k in ("planned", "cached") if _savedrive.stats[k] != before[k]]
    assert len(done) == 1, (before, _savedrive.stats)
    return done[0]


def _sequence_worker(rank: int, world: int, root: str) -> list[tuple[str, str]]:
    """Saves a sequence of states; records what each save did on this rank."""
    seen: list[tuple[str, str]] = []

    def step(name: str, sd: dict[str, Any], **kw: Any) -> None:
        path = os.path.join(root, name)
        seen.append((name, _save_counting(sd, path, **kw)))
        _check_load(sd, path)

    step("first", _state(rank, world, 1))
    step("same", _state(rank, world, 2))
    step("same_again", _state(rank, world, 3))
    # one rank alone adds a key: every rank plans again
    step("one_rank_changes", _state(rank, world, 4, extra=rank == 1))
    step("back", _state(rank, world, 5))
    step("back_cached", _state(rank, world, 6))
    step("dtype", _state(rank, world, 7, dtype=torch.bfloat16))
    step("shape", _state(rank, world, 8, dtype=torch.bfloat16, rows=13))
    step("shape_cached", _state(rank, world, 9, dtype=torch.bfloat16, rows=13))
    step("zstd", _state(rank, world, 10, dtype=torch.bfloat16, rows=13), compression="zstd")
    step("zstd_cached", _state(rank, world, 11, dtype=torch.bfloat16, rows=13),
         compression="zstd")
    return seen


def test_unchanged_structure_reuses_plans_and_every_change_replans_everywhere(
        tmp_path: Any) -> None:
    results = run_distributed(_sequence_worker, WORLD, str(tmp_path))
    expected = [("first", "planned"), ("same", "cached"), ("same_again", "cached"),
                ("one_rank_changes", "planned"), ("back", "planned"),
                ("back_cached", "cached"), ("dtype", "planned"), ("shape", "planned"),
                ("shape_cached", "cached"), ("zstd", "planned"), ("zstd_cached", "cached")]
    for rank, seen in enumerate(results):
        assert seen == expected, f"rank {rank}: {seen}"


def _load_sequence_worker(rank: int, world: int, root: str) -> list[tuple[str, str]]:
    """Loads (bit-exact, pyckpt._loaddrive) in a sequence; records what each load did."""
    import torch.distributed.checkpoint as dcp

    import pyckpt
    from pyckpt import _loaddrive

    seen: list[tuple[str, str]] = []

    def load(label: str, name: str, sd: dict[str, Any], dest: dict[str, Any] | None = None
             ) -> None:
        before = dict(_loaddrive.stats)
        if dest is None:
            _check_load(sd, os.path.join(root, name))
        else:
            pyckpt.load(dest, os.path.join(root, name))
            for k in dest:
                got = dest[k].to_local() if hasattr(dest[k], "to_local") else dest[k]
                want = sd[k].to_local() if hasattr(sd[k], "to_local") else sd[k]
                assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want
        done = [k for k in ("planned", "cached", "dcp") if _loaddrive.stats[k] != before[k]]
        assert len(done) == 1, (before, _loaddrive.stats)
        seen.append((label, done[0]))

    a, b, c = _state(rank, world, 1), _state(rank, world, 2), _state(rank, world, 3, rows=13)
    for name, sd in (("a", a), ("b", b), ("c", c)):
        pyckpt.save(sd, os.path.join(root, name))
    load("first", "a", a)
    load("again", "a", a)
    load("another save, same layout", "b", b)
    load("another layout", "c", c)
    load("back", "a", a)
    load("back again", "a", a)
    # one rank alone loads less (rank 1 leaves out 'emb', which the others load)
    part = {k: v for k, v in _fresh_like(a).items() if not (rank == 1 and k == "emb")}
    load("one rank's plan changes", "a", a, part)
    load("all again", "a", a)
    load("all again, cached", "a", a)
    # a rank-local checkpoint has no pyckpt.json: DCP's own path (its rank-local fallback)
    local = {"t": torch.full((4,), float(rank))}
    dcp.save(local, storage_writer=pyckpt.Writer(os.path.join(root, "local")),
             no_dist=False, use_collectives=False)
    load("rank-local", "local", local, {"t": torch.zeros(4)})
    return seen


def test_loads_reuse_the_global_plan_until_the_layout_or_a_plan_changes(tmp_path: Any) -> None:
    results = run_distributed(_load_sequence_worker, WORLD, str(tmp_path))
    expected = [("first", "planned"), ("again", "cached"),
                ("another save, same layout", "cached"), ("another layout", "planned"),
                ("back", "planned"), ("back again", "cached"),
                ("one rank's plan changes", "planned"), ("all again", "planned"),
                ("all again, cached", "cached"), ("rank-local", "dcp")]
    for rank, seen in enumerate(results):
        assert seen == expected, f"rank {rank}: {seen}"


def _world_change_worker(rank: int, world: int, root: str) -> list[str]:
    """The same structure saved by the whole group, then by a 2-rank subgroup: another world
    size plans again (and loads back), then caches in its turn."""
    import torch.distributed as dist

    out = [_save_counting({"t": torch.arange(10.0)}, os.path.join(root, "all"))]
    out.append(_save_counting({"t": torch.arange(10.0)}, os.path.join(root, "all2")))
    sub = dist.new_group([0, 1])
    if rank < 2:
        for name in ("sub", "sub2"):
            sd = {"t": torch.arange(10.0) + 1}
            out.append(_save_counting(sd, os.path.join(root, name), process_group=sub))
            import pyckpt

            dest = {"t": torch.zeros(10)}
            pyckpt.load(dest, os.path.join(root, name), process_group=sub)
            assert torch.equal(dest["t"], sd["t"])
    dist.barrier()
    return out


def test_another_world_size_plans_again(tmp_path: Any) -> None:
    results = run_distributed(_world_change_worker, WORLD, str(tmp_path))
    assert results[0] == results[1] == ["planned", "cached", "planned", "cached"]
    assert results[2] == ["planned", "cached"]


def _replica_worker(rank: int, world: int, root: str) -> str:
    import pyckpt
    from pyckpt.errors import ReplicaMismatchError

    sd = _state(rank, world, 1)
    _save_counting(sd, os.path.join(root, "a"))
    assert _save_counting(sd, os.path.join(root, "b")) == "cached"
    if rank == 2:  # this rank's replica drifts: the cached plan must not hide it
        sd["norm"] = sd["norm"] + 1
    with pytest.raises(ReplicaMismatchError) as info:
        pyckpt.save(sd, os.path.join(root, "c"))
    assert "'norm'" in str(info.value)
    return "raised"


@pytest.mark.slow
def test_a_replica_that_drifts_after_plans_were_cached_is_refused(tmp_path: Any) -> None:
    assert run_distributed(_replica_worker, WORLD, str(tmp_path)) == ["raised"] * WORLD
    assert not (tmp_path / "c" / "pyckpt.json").exists()


def _failure_worker(rank: int, world: int, root: str) -> str:
    import pyckpt
    from pyckpt.errors import UnsupportedDtypeError

    sd = _state(rank, world, 1)
    _save_counting(sd, os.path.join(root, "a"))
    if rank == 1:
        sd[f"bad{rank}"] = torch.eye(3).to_sparse()
    with pytest.raises(UnsupportedDtypeError, match="'bad1'") as info:
        pyckpt.save(sd, os.path.join(root, "b"))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if rank != 1:
        assert "rank 1" in notes, notes
    return "raised"


@pytest.mark.slow
def test_a_write_failure_on_one_rank_reaches_every_rank_typed(tmp_path: Any) -> None:
    assert run_distributed(_failure_worker, WORLD, str(tmp_path)) == ["raised"] * WORLD
    assert not (tmp_path / "b" / "pyckpt.json").exists()
    assert (tmp_path / "a" / "pyckpt.json").exists()


def _transport_worker(rank: int, world: int) -> Any:
    from pyckpt._collective import group_info
    from pyckpt._collective.transport import gather, scatter

    g = group_info(None)
    # rank r's object: r * 300 bytes (rank 0's fits the inline frame, the others do not)
    mine = bytes([rank]) * (rank * 300)
    got = gather(mine, g, root=1, inline=100)
    if rank == 1:
        assert got == [bytes([r]) * (r * 300) for r in range(world)]
    else:
        assert got is None
    objs = [("for", r, b"x" * (r * 500)) for r in range(world)] if rank == 2 else None
    back = scatter(objs, g, root=2, inline=64)
    assert back == ("for", rank, b"x" * (rank * 500))
    return "ok"


def test_gather_and_scatter_carry_objects_longer_than_the_inline_frame() -> None:
    assert run_distributed(_transport_worker, WORLD) == ["ok"] * WORLD


def _setup_failure_worker(rank: int, world: int, root: str) -> str:
    """A failure of the coordinator's set-up (overwrite=False into a complete checkpoint)
    reaches every rank, on a planned and on a cached save."""
    import pyckpt

    sd = _state(rank, world, 1)
    path = os.path.join(root, "a")
    pyckpt.save(sd, path, overwrite=False)
    for _ in range(2):
        with pytest.raises(FileExistsError):
            pyckpt.save(sd, path, overwrite=False)
    assert _save_counting(sd, os.path.join(root, "b")) in ("planned", "cached")
    return "raised"


@pytest.mark.slow
def test_a_set_up_failure_on_the_coordinator_reaches_every_rank(tmp_path: Any) -> None:
    assert run_distributed(_setup_failure_worker, WORLD, str(tmp_path)) == ["raised"] * WORLD


def _hsdp_state(seed: int, *, drift: str | None = None) -> dict[str, Any]:
    """An HSDP state on a (2 replicas, 2 shards) mesh of 4 ranks, as FSDP2 makes it: parameters
    ``[Replicate(), Shard(0)]`` (each shard held by its replica pair), a tensor sharded across
    the replicas and replicated within them, and the plain tensors every rank holds (an
    optimizer's step): ranks hold overlapping sets of replicated items. ``drift``: one key
    whose copy on rank 3 differs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {
        "w": distribute_tensor(torch.randn(8, 6, generator=g), mesh, [Replicate(), Shard(0)]),
        "v": distribute_tensor(torch.randn(4, 10, generator=g), mesh, [Shard(0), Replicate()]),
        "optim.step": torch.tensor(float(seed)),
        "norm": torch.randn(16, generator=g),
        "epoch": seed,
    }
    if drift is not None and dist.get_rank() == 3:
        v = sd[drift]
        if isinstance(v, DTensor):
            sd[drift] = DTensor.from_local(v.to_local() + 1, mesh, v.placements,
                                           shape=v.shape, stride=v.stride())
        else:
            sd[drift] = v + 1
    return sd


def _hsdp_worker(rank: int, world: int, root: str) -> list[str]:
    import pyckpt
    from pyckpt.errors import ReplicaMismatchError

    seen = []
    for i in range(3):
        sd = _hsdp_state(i)
        path = os.path.join(root, f"s{i}")
        seen.append(_save_counting(sd, path))
        _check_load(sd, path)
    # a replica drifts after the plans were cached: refused, naming the item
    for key in ("w", "optim.step"):
        seen.append(_save_counting(_hsdp_state(4), os.path.join(root, f"clean_{key}")))
        with pytest.raises(ReplicaMismatchError) as info:
            pyckpt.save(_hsdp_state(5, drift=key), os.path.join(root, f"drift_{key}"))
        assert f"'{key}" in str(info.value), str(info.value)
    return seen


def test_hsdp_state_reuses_plans_and_a_drifting_replica_is_refused(tmp_path: Any) -> None:
    """Ranks hold overlapping sets of replicated items (HSDP parameters shared by a replica
    pair, plain tensors shared by all): the plans are still cached, and the replica check of a
    cached save still compares every item's holders."""
    results = run_distributed(_hsdp_worker, 4, str(tmp_path))
    # after the first refusal the plans are made again (the refused save dropped them)
    assert results == [["planned", "cached", "cached", "cached", "planned"]] * 4
    assert not any((tmp_path / f"drift_{k}" / "pyckpt.json").exists() for k in ("w", "optim.step"))


def _metadata_shards_worker(rank: int, world: int, root: str) -> list[tuple[str, str, int]]:
    """Saves of one structure with different ``metadata_shards``: each writes the format it
    asks for (the setting is part of the cache key), and a save refused for a metadata shard
    over the limit succeeds when saved again with ``metadata_shards=False``, as its error
    says, although a plan of that structure is cached."""
    import json

    import pyckpt
    from pyckpt import _format_shards

    def version(path: str) -> int:
        with open(os.path.join(path, "pyckpt.json"), "rb") as f:
            return int(json.loads(f.read())["version"])

    seen: list[tuple[str, str, int]] = []

    def step(name: str, sd: dict[str, Any], shards: bool | None) -> None:
        path = os.path.join(root, name)
        seen.append((name, _save_counting(sd, path, metadata_shards=shards), version(path)))
        _check_load(sd, path)

    step("v4", _state(rank, world, 1), True)
    step("v3", _state(rank, world, 2), False)
    step("v3_again", _state(rank, world, 3), False)
    step("v4_again", _state(rank, world, 4), True)
    limit = _format_shards.MAX_SHARD_TEXT
    _format_shards.MAX_SHARD_TEXT = 64  # every rank's metadata shard is over the limit
    try:
        with pytest.raises(ValueError, match="metadata_shards=False"):
            pyckpt.save(_state(rank, world, 5), os.path.join(root, "too_big"))
        step("retry", _state(rank, world, 6), False)
    finally:
        _format_shards.MAX_SHARD_TEXT = limit
    return seen


def test_metadata_shards_is_part_of_the_cache_key(tmp_path: Any) -> None:
    results = run_distributed(_metadata_shards_worker, 2, str(tmp_path))
    expected = [("v4", "planned", 4), ("v3", "planned", 3), ("v3_again", "cached", 3),
                ("v4_again", "cached", 4), ("retry", "cached", 3)]
    assert results == [expected] * 2


def _returned_metadata_worker(rank: int, world: int, root: str) -> list[Any]:
    """Two node-local saves of one structure (the second from the cache): the first's returned
    metadata still names the first save's document after the second."""
    import pyckpt

    def save(name: str, seed: int) -> Any:
        return pyckpt.save(_state(rank, world, seed), os.path.join(root, name),
                           shared_filesystem=False)

    first = save("a", 1)
    kept = first.storage_data.save_id
    second = save("b", 2)
    return [first.storage_data.save_id == kept, second.storage_data.save_id != kept]


def test_a_cached_save_returns_its_own_metadata(tmp_path: Any) -> None:
    results = run_distributed(_returned_metadata_worker, 2, str(tmp_path))
    assert results == [[True, True]] * 2
