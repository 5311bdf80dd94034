"""Rank functions of the object-store tests (tests/test_s3.py), run by dist_utils.run_distributed.

They live here, not in the test module, so that forkserver children can import them from a
fresh checkout.
"""

from __future__ import annotations

import os
from typing import Any

import torch

ROWS, COLS = 96, 2048  # bf16 "w": 384 KiB; chunk_bytes 16 KiB in these saves


def full_state(rows: int = ROWS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(rows, COLS, generator=g).to(torch.bfloat16),
        "v": torch.randn(rows * 8, generator=g),
        "r": torch.arange(1000, dtype=torch.int64),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (dtype, shape and every byte)."""
    return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _sharded(world: int, template: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``w`` and ``v`` sharded on dim 0 over all ranks, ``r`` replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh(world)
    src = template
    return {
        "w": distribute_tensor(src["w"], mesh, [Shard(0)], src_data_rank=None),
        "v": distribute_tensor(src["v"], mesh, [Shard(0)], src_data_rank=None),
        "r": distribute_tensor(src["r"], mesh, [Replicate()], src_data_rank=None),
    }


def worker_save(rank: int, world: int, url: str, env: dict[str, str], compression: Any,
                chunk_bytes: int | None = 16 << 10, rows: int = ROWS) -> int:
    """Saves the sharded state to ``url`` (``chunk_bytes`` None: the object-store default)."""
    os.environ.update(env)
    import torch.distributed.checkpoint as dcp

    import pyckpt

    sd = _sharded(world, full_state(rows))
    writer = pyckpt.Writer(url, compression=compression, chunk_bytes=chunk_bytes)
    dcp.save(sd, storage_writer=writer, planner=pyckpt.SavePlanner())
    return 0


def worker_load(rank: int, world: int, url: str, env: dict[str, str],
                rows: int = ROWS) -> dict[str, Any]:
    """Loads ``url`` into a ``world``-way sharding; returns what matched and the bytes fetched
    against the stored bytes this rank's shards need."""
    os.environ.update(env)
    import torch.distributed.checkpoint as dcp

    import pyckpt
    from pyckpt.api import load_planner

    zeros = {k: torch.zeros_like(v) for k, v in full_state(rows).items()}
    sd = _sharded(world, zeros)
    reader = pyckpt.Reader(url)
    dcp.load(sd, storage_reader=reader, planner=load_planner())
    full = full_state(rows)
    ok = {}
    needed = 0
    for k, d in sd.items():
        local = d.to_local()
        offsets = d.__create_chunk_list__()[0].offsets if local.numel() else None
        if offsets is None:
            ok[k] = True
            continue
        idx = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
        ok[k] = same_bits(local, full[k][idx])
        needed += local.numel() * local.element_size()
    return {"ok": ok, "fetched": reader.bytes_fetched, "needed": needed}


def worker_consolidate(rank: int, world: int, src: str, dst: str, env: dict[str, str],
                       max_file_bytes: int,
                       rank_env: dict[int, dict[str, str]] | None = None,
                       options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``pyckpt.consolidate(src, dst, **options)`` over the group; returns the result (or the
    error) and the data objects this rank downloaded (from the INFO record of the staging
    step). ``rank_env[rank]`` overrides ``env`` on that rank; ``{rank}`` in ``dst`` is replaced
    by the rank (a private local destination per rank)."""
    import logging

    os.environ.update(env)
    os.environ.update((rank_env or {}).get(rank, {}))
    import torch.distributed as dist

    import pyckpt

    staged: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            staged.extend(getattr(record, "pyckpt_staged", []))

    log = logging.getLogger("pyckpt.consolidate")
    log.setLevel(logging.INFO)
    log.addHandler(Grab())
    try:
        res = pyckpt.consolidate(src, dst.replace("{rank}", str(rank)),
                                 process_group=dist.group.WORLD, max_file_bytes=max_file_bytes,
                                 **(options or {}))
    except Exception as e:
        import traceback
        return {"staged": staged, "error": type(e).__name__, "message": str(e), "tb": traceback.format_exc()}
    return {"staged": staged, "files": res.files, "index": res.index_path,
            "rank_bytes": res.rank_bytes, "total_bytes": res.total_bytes}
