"""Rank bodies for tests/test_coop_load.py: cooperative loads of replicated state."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import pyckpt
from pyckpt.api import load_planner

CHUNK = 32 << 10  # many chunks per rank, so byte balance is not limited by chunk granularity


def replicated_state(seed: int = 5) -> dict[str, Any]:
    """The same values on every rank (as after DDP's broadcast): 6 MiB in 14 tensors."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {}
    for i in range(12):
        rows = 64 + 16 * i
        sd[f"layer{i}.weight"] = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
        sd[f"layer{i}.bias"] = torch.randn(rows, generator=g)
    sd["embed"] = torch.randn(2048, 1024, generator=g).to(torch.bfloat16)
    sd["scale"] = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    sd["step"] = 11
    return sd


def zeros_like_state(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


def mismatches(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    bad = []
    for k, v in want.items():
        g = got[k]
        if isinstance(v, torch.Tensor):
            if hasattr(g, "to_local"):
                g = g.full_tensor()
            if g.dtype != v.dtype or not torch.equal(g.view(torch.uint8), v.view(torch.uint8)):
                bad.append(k)
        elif g != v:
            bad.append(k)
    return bad


def save_replicated(rank: int, world: int, path: str, compression: str | None,
                    env: dict[str, str] | None = None) -> None:
    os.environ.update(env or {})
    pyckpt.save(replicated_state(), path, compression=compression, chunk_bytes=CHUNK)


def load_counted(rank: int, world: int, path: str, cooperative: bool | None,
                 options: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """``dcp.load`` with a ``pyckpt.Reader``; returns what this rank read from storage."""
    os.environ.update(env or {})
    want = replicated_state()
    sd = zeros_like_state(want)
    reader = pyckpt.Reader(path, cooperative=cooperative, **(options or {}))
    with reader:
        dcp.load(sd, storage_reader=reader, planner=load_planner())
    return {"bad": mismatches(sd, want), "bytes_read": reader.bytes_read,
            "bytes_fetched": reader.bytes_fetched}


def load_api(rank: int, world: int, path: str, cooperative: bool | None) -> list[str]:
    """``pyckpt.load``; returns the keys loaded wrong."""
    want = replicated_state()
    sd = zeros_like_state(want)
    pyckpt.load(sd, path, cooperative=cooperative)
    return mismatches(sd, want)


def load_failing(rank: int, world: int, path: str) -> tuple[str, str]:
    """A load of a damaged checkpoint: (error type, message) as every rank sees it."""
    sd = zeros_like_state(replicated_state())
    try:
        pyckpt.load(sd, path)
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


# -- mixed: FSDP-style sharded DTensors + replicated tensors in one state dict --------------

def _mixed_full(seed: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "sharded.w1": torch.randn(512, 384, generator=g),
        "sharded.w2": torch.randn(768, 128, generator=g).to(torch.bfloat16),
        "replicated.a": torch.randn(640, 256, generator=g),
        "replicated.b": torch.randn(300, 50, generator=g).to(torch.bfloat16),
    }


def _mixed(world: int, zeros: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd: dict[str, Any] = {}
    for k, v in _mixed_full().items():
        src = torch.zeros_like(v) if zeros else v
        sd[k] = distribute_tensor(src, mesh, [Shard(0)], src_data_rank=None) \
            if k.startswith("sharded") else src
    return sd


def save_mixed(rank: int, world: int, path: str) -> None:
    pyckpt.save(_mixed(world, zeros=False), path, compression="zstd", chunk_bytes=CHUNK)


def load_mixed(rank: int, world: int, path: str, cooperative: bool,
               prefix: str = "") -> dict[str, Any]:
    """Loads the mixed state (the keys beginning with ``prefix``)."""
    sd = {k: v for k, v in _mixed(world, zeros=True).items() if k.startswith(prefix)}
    reader = pyckpt.Reader(path, cooperative=cooperative, allow_partial=bool(prefix))
    with reader:
        dcp.load(sd, storage_reader=reader, planner=load_planner())
    want = {k: v for k, v in _mixed(world, zeros=False).items() if k.startswith(prefix)}
    bad = [k for k in want if not torch.equal(
        (sd[k].to_local() if hasattr(sd[k], "to_local") else sd[k]).view(torch.uint8),
        (want[k].to_local() if hasattr(want[k], "to_local") else want[k]).view(torch.uint8))]
    return {"bad": bad, "bytes_read": reader.bytes_read,
            "shards_read": reader._storage.sharded.shards_read}


# -- node-local -----------------------------------------------------------------------------

def save_nodelocal(rank: int, world: int, root: str) -> str:
    from _nodelocal_workers import isolate

    paths, mode = isolate(root, rank)
    pyckpt.save(replicated_state(), paths["ckpt"], shared_filesystem=False,
                compression="zstd", chunk_bytes=CHUNK)
    return mode


def load_nodelocal(rank: int, world: int, root: str, cooperative: bool) -> dict[str, Any]:
    from _nodelocal_workers import foreign_opens, isolate

    paths, mode = isolate(root, rank)
    out = load_counted(rank, world, paths["ckpt"], cooperative,
                       {"shared_filesystem": False})
    out["foreign"] = foreign_opens(root, rank)
    out["mode"] = mode
    return out


def world_info() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def data_bytes(path: str) -> int:
    """Stored bytes of the checkpoint's chunks: its data files less their metadata shards
    (format version 4)."""
    import json

    total = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                if n.endswith(".pyckpt"))
    with open(os.path.join(path, "pyckpt.json"), "rb") as f:
        doc = json.loads(f.read())
    return total - sum(s[2] for s in doc.get("shards", []))
