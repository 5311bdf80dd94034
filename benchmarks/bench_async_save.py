"""Asynchronous saves on real gloo ranks: ``pyckpt.async_save`` against ``dcp.async_save`` with
pyckpt's writer and planner (the README's pattern), same state, same run.

    PYTHONPATH=$PWD python benchmarks/bench_async_save.py [--ranks 4] [--tensors 400]
                                                          [--kib 64] [--saves 8]

Each rank holds ``--tensors`` bf16 tensors sharded over the ranks (FSDP-style DTensors,
``--kib`` KiB per rank and tensor). Every save: one training-like change of the tensors, then
the call (timed: ``blocking``) and its future's result (timed from the call: ``done``, the
whole save: staging, planning or the cached plan check, writes, commit), each into a new
directory. The two methods alternate, save after save, after one untimed save of each (DCP's
first plan, pyckpt's first plan: the figures are of later saves of the same structure, where
pyckpt reuses its plans and DCP plans again). Every checkpoint of the last round loads back
bit-exactly. Prints medians [min-max] in ms over the saves (rank 0's clock; every rank waits
for its future).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "tests"))

METHODS = ("pyckpt.async_save", "dcp.async_save")


def _state(world: int, tensors: int, kib: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    cols = 64
    rows = max(1, kib * 1024 // (2 * cols))
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    return {f"layers.{i}.weight": DTensor.from_local(
        torch.randn(rows, cols, generator=g).to(torch.bfloat16), mesh, [Shard(0)],
        shape=torch.Size([rows * world, cols]), stride=(cols, 1)) for i in range(tensors)}


def _save(method: str, sd: dict[str, Any], path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    import pyckpt

    if method == "pyckpt.async_save":
        return pyckpt.async_save(sd, path)
    return dcp.async_save(sd, storage_writer=pyckpt.Writer(path), planner=pyckpt.SavePlanner(),
                          process_group=_dcp_group())


_GROUP: list[Any] = []


def _dcp_group() -> Any:
    """dcp.async_save's own gloo group, made once, as torchtitan makes it (new_group)."""
    import torch.distributed as dist

    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def _worker(rank: int, world: int, root: str, tensors: int, kib: int,
            saves: int) -> dict[str, tuple[list[float], list[float]]]:
    import torch
    import torch.distributed as dist

    import pyckpt

    sd = _state(world, tensors, kib)
    _dcp_group()
    times: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in METHODS}
    last: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
    for i in range(saves + 1):
        for method in METHODS:
            for v in sd.values():
                v.to_local().add_(1.0)  # a training step's change
            path = os.path.join(root, f"{method}-{i}")
            dist.barrier()
            t0 = time.perf_counter()
            fut = _save(method, sd, path)
            t1 = time.perf_counter()
            fut.result()
            t2 = time.perf_counter()
            dist.barrier()
            if i:
                times[method][0].append(t1 - t0)
                times[method][1].append(t2 - t0)
            previous = last.get(method)
            last[method] = (path, {k: v.to_local().clone() for k, v in sd.items()})
            if previous is not None and rank == 0:
                shutil.rmtree(previous[0])
    for method, (path, want) in last.items():
        dest = {k: torch.distributed.tensor.DTensor.from_local(
            torch.zeros_like(v.to_local()), v.device_mesh, v.placements, shape=v.shape,
            stride=v.stride()) for k, v in sd.items()}
        pyckpt.load(dest, path)
        assert all(torch.equal(dest[k].to_local(), want[k]) for k in want), method
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tensors", type=int, default=400)
    parser.add_argument("--kib", type=int, default=64)
    parser.add_argument("--saves", type=int, default=8)
    args = parser.parse_args()
    from dist_utils import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_worker, args.ranks, tmp, args.tensors, args.kib, args.saves)
    mib = args.ranks * args.tensors * args.kib / 1024
    print(f"{args.ranks} gloo ranks, {args.tensors} sharded bf16 tensors, {mib:.1f} MiB in all, "
          f"{args.saves} saves each (after one untimed), every load bit-exact")
    print(f"{'method':<20}{'blocking ms':>26}{'done ms':>28}")

    def cell(xs: list[float]) -> str:
        ms = [1000 * x for x in xs]
        return f"{statistics.median(ms):.1f} [{min(ms):.1f}-{max(ms):.1f}]"

    for method, (blocking, done) in results[0].items():
        print(f"{method:<20}{cell(blocking):>26}{cell(done):>28}")


if __name__ == "__main__":
    main()
