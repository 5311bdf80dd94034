"""Loads into CUDA tensors on a real GPU (``@pytest.mark.gpu``; skipped without CUDA).

What a trainer restoring on GPUs relies on: ``pyckpt.load`` / ``dcp.load`` fill CUDA destination
tensors bit for bit (raw and zstd, contiguous or not), cast a stored dtype to the destination's
as DCP does (fp32 checkpoint into bf16 parameters), reshard a checkpoint written by 2 ranks into
one process's CUDA tensors, and a cooperative load of replicated state (read from storage once
over the ranks) lands in CUDA tensors on every rank. All pass on an NVIDIA H200 (torch
2.11+cu130, 2026-11-26; ``scripts/gpu_check.sh``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_distributed

import pyckpt
from pyckpt.api import load_planner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(257, 129, generator=g),
        "bf": torch.randn(1000, 33, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(1 << 40), 1 << 40, (4097,), generator=g),
        "h": torch.randn(64, 3, 5, generator=g).to(torch.float16),
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_load_into_cuda_tensors_bit_exact(tmp_path: Path, compression: str | None) -> None:
    want = _state()
    pyckpt.save(want, tmp_path / "c", compression=compression, chunk_bytes=64 << 10)
    got = {k: torch.zeros_like(v, device="cuda") for k, v in want.items()}
    got["w"] = torch.zeros(129, 257, device="cuda").t()  # a non-contiguous destination
    pyckpt.load(got, tmp_path / "c")
    for k, v in want.items():
        assert got[k].is_cuda and got[k].dtype == v.dtype, k
        assert _bits(got[k]) == _bits(v), k


def test_fp32_checkpoint_casts_into_bf16_cuda_parameters(tmp_path: Path) -> None:
    want = {"w": torch.randn(300, 70), "v": torch.randn(5000)}
    pyckpt.save(want, tmp_path / "c", compression="zstd")
    got = {k: torch.zeros(v.shape, dtype=torch.bfloat16, device="cuda") for k, v in want.items()}
    pyckpt.load(got, tmp_path / "c")
    for k, v in want.items():
        assert got[k].dtype == torch.bfloat16 and got[k].is_cuda
        assert torch.equal(got[k].cpu(), v.to(torch.bfloat16)), k


def _save_sharded(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _state()
    sd: dict[str, Any] = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)], src_data_rank=None),
        "bf": distribute_tensor(full["bf"], mesh, [Shard(1)], src_data_rank=None),
        "i": full["i"],
    }
    pyckpt.save(sd, path, compression="zstd", chunk_bytes=16 << 10)


def test_two_rank_checkpoint_resharded_into_one_process_cuda_tensors(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    run_distributed(_save_sharded, 2, path)
    want = _state()
    got = {k: torch.zeros_like(want[k], device="cuda") for k in ("w", "bf", "i")}
    pyckpt.load(got, path)
    for k, v in got.items():
        assert v.is_cuda and _bits(v) == _bits(want[k]), k


def _coop_load_cuda(rank: int, world: int, path: str) -> dict[str, Any]:
    from _coop_workers import mismatches, replicated_state

    torch.cuda.set_device(0)  # every rank shares the one GPU
    want = replicated_state()
    sd = {k: torch.zeros_like(v, device="cuda") if isinstance(v, torch.Tensor) else 0
          for k, v in want.items()}
    reader = pyckpt.Reader(path, cooperative=True)
    with reader:
        dcp.load(sd, storage_reader=reader, planner=load_planner())
    on_gpu = all(v.is_cuda for v in sd.values() if isinstance(v, torch.Tensor))
    host = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    return {"bad": mismatches(host, want), "on_gpu": on_gpu, "bytes_read": reader.bytes_read}


@pytest.mark.distributed
def test_cooperative_load_of_replicated_state_into_cuda_tensors(tmp_path: Path) -> None:
    from _coop_workers import data_bytes, save_replicated

    path = str(tmp_path / "c")
    run_distributed(save_replicated, 2, path, "zstd")
    results = run_distributed(_coop_load_cuda, 2, path)
    stored = data_bytes(path)
    for r in results:
        assert r["bad"] == [] and r["on_gpu"], r
    per_rank = [r["bytes_read"] for r in results]
    assert stored <= sum(per_rank) <= 1.05 * stored, (per_rank, stored)  # read once over ranks
