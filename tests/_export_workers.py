"""Multi-rank bodies for tests/test_export_aim.py (an importable module, so that processes
started by tests/dist_utils.py can run them from a fresh clone)."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

import pyckpt


def dtensor_state() -> tuple[dict[str, torch.Tensor], dict[str, int | None]]:
    """Full tensors and their shard dimension over the ranks (None: replicated)."""
    g = torch.Generator().manual_seed(11)
    full = {
        "model.rows": torch.randn(13, 6, generator=g),  # Shard(0): 7 + 6 rows
        "model.cols": torch.randn(40, 4097, generator=g),  # Shard(1): rows cut in two, 2 KiB runs
        "model.half": torch.randn(9, 31, generator=g).to(torch.float16),  # Shard(1)
        "model.ids": torch.arange(12, dtype=torch.int64),  # Shard(0), never cast
        "optim.state.exp_avg": torch.randn(13, 6, generator=g),  # Replicate, not exported
    }
    full["model.cols"][0, :8] = torch.tensor(
        [float("inf"), -float("inf"), float("nan"), 1e-40, -3e-45, 65520.0, 1 + 2**-8, 0.0]
    )
    dims: dict[str, int | None] = {
        "model.rows": 0, "model.cols": 1, "model.half": 1, "model.ids": 0,
        "optim.state.exp_avg": None,
    }
    return full, dims


def save_and_export_cast(rank: int, world: int, root: str) -> tuple[int, int]:
    """Saves DTensor shards (one data file per rank) and exports them cast to bf16 on all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full, dims = dtensor_state()
    sd = {
        k: distribute_tensor(v, mesh, [Replicate() if dims[k] is None else Shard(dims[k])],
                             src_data_rank=None)
        for k, v in full.items()
    }
    src = os.path.join(root, "src")
    # 4 KiB chunks: each chunk of a column shard decodes into scattered row runs.
    dcp.save(sd, storage_writer=pyckpt.Writer(src, compression="zstd", chunk_bytes=4096,
                                              fsync=False))
    res = pyckpt.consolidate(src, os.path.join(root, "dst"), fsync=False, threads=2,
                             dtype="bf16")
    return res.rank_bytes, res.total_bytes
