"""Random save -> load round trips on real gloo ranks, bit-exact: a state dict of random dtypes,
shapes (empty ones, fewer rows than ranks) and DTensor placements on 1-D and 2-D meshes (HSDP)
beside plain tensors and objects, saved by one world size and loaded by another with other
placements, through ``pyckpt.load`` (cooperative or not) and through ``dcp.load`` with DCP's
``DefaultLoadPlanner``, in format versions 3 and 4, raw and zstd. Then, in one group, the same
place saved again with new values (cached save and load plans), then with one tensor's dtype or
shape changed, then back: every load must return what the last save wrote.

Each case is drawn from its seed (:func:`case`); the seeds below were picked to cover the
combinations :func:`test_the_seeds_cover_the_matrix` lists."""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest
import torch
from dist_utils import run_distributed

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool]
SEEDS = [29, 48, 75, 106]


def case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ws, wl = rng.choice([2, 3, 4]), rng.choice([1, 2, 3, 4])
    tensors = []
    for i in range(rng.randint(3, 7)):
        shape = [rng.choice([0, 1, 2, 3, 5, 7, 9, 16, 33, 64, 129, 300])
                 for _ in range(rng.choice([0, 1, 1, 2, 2, 2, 3]))]
        if shape and rng.random() < 0.15:
            shape[0] = rng.choice([1, 2, 3])  # fewer rows than ranks
        tensors.append((f"m{i % 3}.t{i}", rng.choice(DTYPES), tuple(shape)))
    return {
        "ws": ws, "wl": wl, "tensors": tensors,
        "mesh_s": (2, 2) if ws == 4 and rng.random() < 0.5 else (ws,),
        "mesh_l": (2, 2) if wl == 4 and rng.random() < 0.5 else (wl,),
        "opts": {k: v for k, v in (("compression", rng.choice([None, "zstd"])),
                                   ("chunk_bytes", rng.choice([4096, 65536, None])),
                                   ("metadata_shards", rng.choice([True, False, None])))
                 if v is not None},
        "coop": rng.choice([None, True, False]),
        "via": rng.choice(["pyckpt", "dcp"]),
    }


def _full(seed: int, name: str, dtype: torch.dtype, shape: tuple[int, ...], version: int
          ) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}-{name}-{version}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0 if dtype == torch.uint8 else -100, 100, shape, generator=g).to(dtype)


def _placements(seed: int, side: str, c: dict[str, Any]) -> dict[str, Any]:
    """name -> DTensor placements on the side's mesh, or None for a plain tensor."""
    from torch.distributed.tensor import Replicate, Shard

    rng = random.Random(f"{seed}-{side}")
    out: dict[str, Any] = {}
    for name, _, shape in c["tensors"]:
        if rng.random() < 0.2:
            out[name] = None
        else:
            options = [Replicate()] + [Shard(d) for d in range(len(shape))]
            out[name] = [rng.choice(options) for _ in c[f"mesh_{side}"]]
    return out


def _state(c: dict[str, Any], seed: int, side: str, mesh: Any, version: int, zero: bool
           ) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    pls = _placements(seed, side, c)
    sd: dict[str, Any] = {}
    for name, dtype, shape in c["tensors"]:
        t = _full(seed, name, dtype, shape, version)
        t = torch.zeros_like(t) if zero else t
        sd[name] = t if pls[name] is None else distribute_tensor(t, mesh, pls[name])
    sd["step"] = -1 if zero else 7 + version
    sd["cfg"] = {"lr": -1.0 if zero else 0.5 * (version + 1)}
    return sd


def _check(c: dict[str, Any], seed: int, sd: dict[str, Any], mesh: Any, version: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    pls = _placements(seed, "l", c)
    for name, dtype, shape in c["tensors"]:
        t = _full(seed, name, dtype, shape, version)
        if pls[name] is None:
            assert not isinstance(sd[name], DTensor)
            assert sd[name].dtype == dtype and torch.equal(sd[name], t), (seed, name)
        else:
            expect = distribute_tensor(t, mesh, pls[name]).to_local()
            assert torch.equal(sd[name].to_local(), expect), (seed, name, pls[name])
    assert sd["step"] == 7 + version and sd["cfg"]["lr"] == 0.5 * (version + 1), seed


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _save_worker(rank: int, world: int, root: str, seed: int) -> None:
    import pyckpt

    c = case(seed)
    mesh = _mesh(c["mesh_s"])
    for version in (0, 1):
        pyckpt.save(_state(c, seed, "s", mesh, version, False), f"{root}/v{version}", **c["opts"])


def _load_worker(rank: int, world: int, root: str, seed: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    import pyckpt

    c = case(seed)
    mesh = _mesh(c["mesh_l"])
    for version in (1, 0, 1):
        sd = _state(c, seed, "l", mesh, version, True)
        if c["via"] == "pyckpt":
            pyckpt.load(sd, f"{root}/v{version}", cooperative=c["coop"], trusted=True)
        else:
            dcp.load(sd, storage_reader=pyckpt.Reader(f"{root}/v{version}"),
                     planner=DefaultLoadPlanner())
        _check(c, seed, sd, mesh, version)


def _changed(c: dict[str, Any], seed: int) -> dict[str, Any]:
    """The case with one tensor's dtype or its first dimension changed."""
    rng = random.Random(f"{seed}-change")
    tensors = list(c["tensors"])
    i = rng.randrange(len(tensors))
    name, dtype, shape = tensors[i]
    if not shape or rng.random() < 0.5:
        dtype = rng.choice([d for d in DTYPES if d != dtype])
    else:
        shape = (shape[0] + rng.choice([1, 2, 5]),) + shape[1:]
    tensors[i] = (name, dtype, shape)
    return {**c, "tensors": tensors}


def _cycle_worker(rank: int, world: int, root: str, seed: int) -> dict[str, int]:
    import pyckpt
    from pyckpt import _savedrive

    c = case(seed)
    c["mesh_l"] = c["mesh_s"]
    mesh = _mesh(c["mesh_s"])
    _savedrive.clear_cache()
    before = dict(_savedrive.stats)
    for version, cc in ((0, c), (1, c), (2, c), (3, _changed(c, seed)), (4, c)):
        pyckpt.save(_state(cc, seed, "s", mesh, version, False), f"{root}/ck", **c["opts"])
        sd = _state(cc, seed, "l", mesh, version, True)
        pyckpt.load(sd, f"{root}/ck", cooperative=c["coop"], trusted=True)
        _check(cc, seed, sd, mesh, version)
    return {k: _savedrive.stats[k] - before[k] for k in before}


def test_the_seeds_cover_the_matrix() -> None:
    from torch.distributed.tensor import Replicate

    cases = [case(s) for s in SEEDS]

    def has(pred: Any) -> bool:
        return any(pred(c) for c in cases)

    assert has(lambda c: c["mesh_s"] == (2, 2)) and has(lambda c: c["mesh_l"] == (2, 2))
    assert has(lambda c: c["wl"] > c["ws"]) and has(lambda c: c["wl"] < c["ws"])
    assert has(lambda c: c["opts"].get("metadata_shards") is False)  # version 3
    assert has(lambda c: c["opts"].get("metadata_shards") is not False)  # version 4
    assert has(lambda c: "compression" in c["opts"]) and has(lambda c: "compression" not in c["opts"])
    assert {c["coop"] for c in cases} == {None, True, False}
    assert {c["via"] for c in cases} == {"pyckpt", "dcp"}
    # HSDP as FSDP2 saves it: replica pairs holding parameters, every rank holding plain tensors
    # (ranks whose replicated items overlap, which the save check compares per class of items)
    assert any(c["mesh_s"] == (2, 2) and None in _placements(s, "s", c).values()
               and any(p and p[0] == Replicate() and p[1] != Replicate()
                       for p in _placements(s, "s", c).values())
               for s, c in zip(SEEDS, cases))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("seed", SEEDS)
def test_random_round_trip(tmp_path: Any, seed: int) -> None:
    c = case(seed)
    run_distributed(_save_worker, c["ws"], str(tmp_path), seed)
    run_distributed(_load_worker, c["wl"], str(tmp_path), seed)
    counts = run_distributed(_cycle_worker, c["ws"], str(tmp_path), seed)
    # saves 1 and 2 reuse the plans of save 0; the changed structure and the way back plan again
    assert counts == [{"planned": 3, "cached": 2}] * c["ws"], counts
