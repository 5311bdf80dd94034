"""Helpers for the consolidation tests: DCP-style shard writers and multi-rank worker bodies.

Lives in its own module (not a test file) so that processes started with ``spawn`` can import the
worker functions by name.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

SHARDING_KEY = "DCP_SHARDING_INFO"


def progress_seen_during_stitch(items: list[Any], task_bytes: int, total: int,
                                enough: int = 1) -> set[int]:
    """Runs ``_C.stitch(items)`` (one thread, pread) in a thread while this one polls its byte
    counter; returns the counter values seen strictly between 0 and ``total``.

    Up to 3 runs until ``enough`` values are seen (the stitch is idempotent): a poller that is
    descheduled for most of one ~30 ms stitch on a loaded machine sees too little, while a
    stitch that holds the GIL shows nothing in any run."""
    from pyckpt import _C

    seen: set[int] = set()
    for _ in range(3):
        prog = _C.ProgressCounter()

        def run(prog: Any = prog) -> None:
            _C.set_progress_counter(prog)  # the stitch adds its output bytes to it
            try:
                _C.stitch(items, 1, task_bytes, "pread", False)
            finally:
                _C.set_progress_counter(None)

        t = threading.Thread(target=run)
        t.start()
        observed = set()
        while t.is_alive():
            observed.add(prog.bytes)
            time.sleep(0.0005)
        t.join()
        assert prog.bytes == total
        seen = {b for b in observed if 0 < b < total}
        if len(seen) >= enough:
            break
    return seen


def split_points(n: int, parts: int, uneven: bool) -> list[int]:
    """Boundaries of `parts` pieces of [0, n); uneven pieces grow with their index."""
    if not uneven:
        base, extra = divmod(n, parts)
        sizes = [base + (1 if i < extra else 0) for i in range(parts)]
    else:
        weights = list(range(1, parts + 1))
        sizes = [n * w // sum(weights) for w in weights]
        sizes[-1] += n - sum(sizes)
    pts = [0]
    for s in sizes:
        pts.append(pts[-1] + s)
    return pts


def grid_blocks(
    shape: Sequence[int], parts: Sequence[int], uneven: bool = False
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """All blocks of a grid cutting dim d into parts[d] pieces -> [(offsets, sizes)]."""
    axes = [split_points(n, p, uneven) for n, p in zip(shape, parts)]
    blocks: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    for pts in axes:
        blocks = [
            (o + (pts[i],), s + (pts[i + 1] - pts[i],))
            for o, s in blocks
            for i in range(len(pts) - 1)
        ]
    return blocks


def write_dcp_shards(
    src: str,
    full: dict[str, torch.Tensor],
    blocks_of: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]],
    nfiles: int,
) -> list[str]:
    """Writes shard files exactly as DCP's HuggingFaceStorageWriter(save_distributed=True) does.

    Block k of every tensor goes to file ``k % nfiles`` (like rank k's file), with its
    ``saved_offsets`` in ``DCP_SHARDING_INFO``.
    """
    from safetensors.torch import save_file

    os.makedirs(src, exist_ok=True)
    per_file: list[tuple[dict[str, torch.Tensor], dict[str, dict]]] = [
        ({}, {}) for _ in range(nfiles)
    ]
    for name, t in full.items():
        for k, (offs, sizes) in enumerate(blocks_of[name]):
            if any(s == 0 for s in sizes) and t.numel() > 0:
                continue
            view = t
            for d, (o, s) in enumerate(zip(offs, sizes)):
                view = view.narrow(d, o, s)
            tensors, info = per_file[k % nfiles]
            key = name if name not in tensors else None
            assert key is not None, "one block of a tensor per file"
            tensors[name] = view.contiguous()
            info[name] = {"saved_offsets": list(offs)}
    paths = []
    for i, (tensors, info) in enumerate(per_file):
        if not tensors:
            continue
        path = os.path.join(src, f"shard-{i + 1:05d}-model-00001-of-00001.safetensors")
        save_file(
            tensors,
            path,
            metadata={SHARDING_KEY: json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"},
        )
        paths.append(path)
    return paths


def sample_tensor(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic values of any dtype (random bytes, reinterpreted; bools are 0/1)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(tuple(shape)) if n else torch.empty(tuple(shape), dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), also for dtypes without comparison kernels."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    flat_a, flat_b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))


def load_outputs(index_path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    with open(index_path) as fh:
        index = json.load(fh)
    out: dict[str, torch.Tensor] = {}
    base = os.path.dirname(index_path)
    for fname in sorted(set(index["weight_map"].values())):
        out.update(load_file(os.path.join(base, fname)))
    return out


# ----------------------------------------------------------------------------- multi-rank bodies


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def _finish(result_dir: str, rank: int, payload: dict, tag: str = "") -> None:
    with open(os.path.join(result_dir, f"{tag}rank{rank}.json"), "w") as fh:
        json.dump(payload, fh)


def worker_consolidate(rank: int, world: int, port: int, jobs: list, result_dir: str) -> None:
    """Runs consolidate(src, dst, **kwargs) for each (tag, src, dst, kwargs) job in one group."""
    import torch.distributed as dist

    from pyckpt._consolidate import consolidate

    _init(rank, world, port)
    try:
        for tag, src, dst, kwargs in jobs:
            try:
                res = consolidate(src, dst, **kwargs)
                payload = {"rank_bytes": res.rank_bytes, "total": res.total_bytes, "error": None}
            except Exception as e:  # recorded for the parent to assert on
                payload = {"error": type(e).__name__, "message": str(e)}
            _finish(result_dir, rank, payload, tag)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def worker_subgroup(rank: int, world: int, port: int, src: str, dst: str, result_dir: str) -> None:
    import torch.distributed as dist

    from pyckpt._consolidate import consolidate

    _init(rank, world, port)
    try:
        members = [0, world - 1]
        group = dist.new_group(members)
        if rank in members:
            res = consolidate(src, dst, process_group=group, fsync=False)
            _finish(result_dir, rank, {"rank_bytes": res.rank_bytes, "total": res.total_bytes})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def dcp_state(world_seed: int) -> dict[str, torch.Tensor]:
    """The full tensors saved by worker_dcp_save: dim-0, dim-1 and 3-D shards, several dtypes."""
    return {
        "rows.weight": sample_tensor((13, 6), torch.float32, world_seed),
        "cols.weight": sample_tensor((5, 11), torch.bfloat16, world_seed + 1),
        "cube": sample_tensor((3, 4, 7), torch.int16, world_seed + 2),
        "flags": sample_tensor((9,), torch.bool, world_seed + 3),
        "scale": sample_tensor((), torch.float64, world_seed + 4),
    }


def worker_dcp_save(rank: int, world: int, port: int, root: str, use_async: bool) -> None:
    """Saves DTensor shards with DCP's HuggingFaceStorageWriter, then consolidates them."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from pyckpt._consolidate import consolidate

    _init(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = dcp_state(7)
        placements = {
            "rows.weight": [Shard(0)],
            "cols.weight": [Shard(1)],
            "cube": [Shard(2)],
            "flags": [Shard(0)],
            "scale": [Replicate()],
        }
        sd = {  # every rank holds the full tensors: slice locally, no scatter
            k: distribute_tensor(v, mesh, placements[k], src_data_rank=None)
            for k, v in full.items()
        }
        writer = HuggingFaceStorageWriter(os.path.join(root, "src"), save_distributed=True)
        if use_async:
            fut = dcp.async_save(sd, storage_writer=writer)
            fut.result()
        else:
            dcp.save(sd, storage_writer=writer)
        dist.barrier()
        res = consolidate(os.path.join(root, "src"), os.path.join(root, "dst"), fsync=False)
        _finish(root, rank, {"rank_bytes": res.rank_bytes, "total": res.total_bytes})
    finally:
        dist.destroy_process_group()
    if use_async:
        # dcp.async_save redistributes the DTensors on its background thread, and torch's
        # process-wide DTensor caches (transform infos, redistribute planners, sharding
        # propagation) then keep the DeviceMesh -- and through it the ProcessGroupGloo and its
        # native worker threads -- alive after destroy_process_group(). That group is then torn
        # down during interpreter finalization, where gloo's threads abort the rank with
        # "terminate called without an active exception" in a share of runs. The result is
        # already on disk (written and closed by _finish): leave without finalization.
        os._exit(0)


def worker_failures_free_the_group(rank: int, world: int, port: int, src: str, root: str,
                                   result_dir: str) -> None:
    """A failed consolidate on the default group, then destroy_process_group: the group must be
    freed then (without a collection), not kept alive by the failure's frames into the
    interpreter's finalization, where gloo's threads can abort the process."""
    import weakref

    import torch.distributed as dist

    from pyckpt._consolidate import consolidate

    _init(rank, world, port)
    world_group = weakref.ref(dist.group.WORLD)
    error = None
    try:
        consolidate(src, os.path.join(root, "dst"), fsync=False)
    except Exception as e:  # the failure this test is about
        error = type(e).__name__
    dist.destroy_process_group()
    _finish(result_dir, rank, {"error": error, "alive": world_group() is not None})
