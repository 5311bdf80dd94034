"""Recovery after losing one of 2 nodes: restore from the fast tier's replicas vs from durable.

Starts ``--nodes x --per-node`` CPU ranks (gloo) as separate processes with torchrun's
variables. Each node's fast tier is its own directory (``<work>/nodes/n<k>``, tmpfs by default
under /dev/shm); the durable tier is ``<work>/durable`` or ``--durable s3://...``. Steps, in one
run on one machine:

1. every rank saves ``--size-mib`` MiB of bf16 state (its shard) with ``dcp.async_save`` and
   pyckpt's Writer (the baseline blocking time), then with a CheckpointManager (replicas=1,
   persisted to durable); the save's blocking time and the replication time and bytes are
   reported;
2. node 1 is lost (its fast-tier directory is deleted; its ranks restart with nothing);
3. every rank restores from the fast tier (node 0's files + replicas) -- timed;
4. every rank restores the same step from the durable tier alone -- timed.

Bytes read from durable storage are counted for both restores (expected: 0 for the first).

    python benchmarks/bench_recovery.py --size-mib 1024            # the issue's target size
    python benchmarks/bench_recovery.py --size-mib 4 --durable s3://bucket/prefix
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import pyckpt

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["GROUP_RANK"])
    local = os.path.join(args.work, "nodes", f"n{node}")
    durable = args.durable or os.path.join(args.work, "durable")
    mesh = init_device_mesh("cpu", (world,))
    rows = max(1, args.size_mib * world * (1 << 20) // (2 * 4096))
    g = torch.Generator().manual_seed(7)
    full = (torch.randn(rows, 4096, generator=g) * 0.02).to(torch.bfloat16)

    def state(zeros: bool) -> dict[str, Any]:
        src = torch.zeros_like(full) if zeros else full
        return {"w": distribute_tensor(src, mesh, [Shard(0)], src_data_rank=None)}

    out: dict[str, Any] = {"rank": rank, "node": node}
    # Baseline for the save's blocking time: pyckpt's own dcp.async_save of the same state,
    # node-local, into the same fast-tier directory's parent.
    import torch.distributed.checkpoint as dcp

    with pyckpt.Writer(os.path.join(local, "baseline"), args.compression,
                       shared_filesystem=False) as writer:
        sd0 = state(False)
        dist.barrier()
        t0 = time.perf_counter()
        pending = dcp.async_save(sd0, storage_writer=writer)
        out["async_save_blocking_s"] = time.perf_counter() - t0
        pending.result()
    dist.barrier()
    if rank % args.per_node == 0:
        shutil.rmtree(os.path.join(local, "baseline"))
    dist.barrier()
    mgr = pyckpt.CheckpointManager(durable, local=local, replicas=1, save_every=1,
                                   persist_every=1, compression=args.compression)
    sd = state(False)
    t0 = time.perf_counter()
    fut = mgr.save(1, sd)
    out["save_blocking_s"] = time.perf_counter() - t0
    assert fut is not None
    fut.result()
    mgr.wait()
    assert mgr.last_save is not None
    out["save_write_s"] = mgr.last_save.write_s
    out["replication_s"] = mgr.last_save.replication_s
    out["replica_bytes_sent"] = mgr.last_save.bytes_sent
    mgr.close()

    # Lose node 1: its fast tier is gone (its ranks come back with nothing).
    dist.barrier()
    if node == 1 and rank % args.per_node == 0:
        shutil.rmtree(local)
    dist.barrier()

    mgr = pyckpt.CheckpointManager(durable, local=local, replicas=1, save_every=1,
                                   persist_every=1, compression=args.compression)
    target = state(True)
    dist.barrier()
    t0 = time.perf_counter()
    step = mgr.restore(target)
    dist.barrier()
    out["restore_fast_s"] = time.perf_counter() - t0
    assert step == 1 and mgr.last_restore is not None
    out["restore_fast_tier"] = mgr.last_restore.tier
    out["restore_fast_bytes_durable"] = mgr.last_restore.bytes_durable
    out["restore_fast_bytes_peer"] = mgr.last_restore.bytes_peer
    out["restore_fast_exact"] = bool(torch.equal(target["w"].to_local().view(torch.int16),
                                                 sd["w"].to_local().view(torch.int16)))
    mgr.close()

    mgr = pyckpt.CheckpointManager(durable, compression=args.compression)  # durable only
    target = state(True)
    dist.barrier()
    t0 = time.perf_counter()
    step = mgr.restore(target)
    dist.barrier()
    out["restore_durable_s"] = time.perf_counter() - t0
    assert step == 1 and mgr.last_restore is not None
    out["restore_durable_bytes_durable"] = mgr.last_restore.bytes_durable
    out["restore_durable_exact"] = bool(torch.equal(target["w"].to_local().view(torch.int16),
                                                    sd["w"].to_local().view(torch.int16)))
    mgr.close()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        print(json.dumps(_summary(gathered, args), indent=1))
    dist.destroy_process_group()


def _summary(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    def mx(key: str) -> float:
        return max(float(r[key]) for r in ranks)

    def total(key: str) -> int:
        return sum(int(r[key]) for r in ranks)

    return {
        "ranks": len(ranks), "nodes": args.nodes, "size_mib_per_rank": args.size_mib,
        "compression": args.compression, "durable": args.durable or "local directory",
        "async_save_blocking_s_max": mx("async_save_blocking_s"),
        "save_blocking_s_max": mx("save_blocking_s"),
        "save_write_s_max": mx("save_write_s"),
        "replication_s_max": mx("replication_s"),
        "replica_bytes_on_wire": total("replica_bytes_sent"),
        "restore_after_losing_node1_s": mx("restore_fast_s"),
        "restore_after_losing_node1_bytes_from_durable": total("restore_fast_bytes_durable"),
        "restore_after_losing_node1_bytes_from_peers": total("restore_fast_bytes_peer"),
        "restore_from_durable_s": mx("restore_durable_s"),
        "restore_from_durable_bytes": total("restore_durable_bytes_durable"),
        "bit_exact": all(r["restore_fast_exact"] and r["restore_durable_exact"] for r in ranks),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=64, help="state per rank (MiB of bf16)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--durable", default=None, help="durable tier (default: a local directory)")
    p.add_argument("--compression", default="zstd", choices=["zstd", "none"])
    p.add_argument("--work", default=None, help="work directory (default: under /dev/shm)")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.compression == "none":
        args.compression = None
    if args.rank_main:
        _rank_main(args)
        return
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = args.work or tempfile.mkdtemp(prefix="pyckpt-recovery-", dir=base)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from _ports import free_port

    port = free_port()
    world = args.nodes * args.per_node
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(rank % args.per_node), LOCAL_WORLD_SIZE=str(args.per_node),
                       GROUP_RANK=str(rank // args.per_node), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            cmd = [sys.executable, os.path.abspath(__file__), "--rank-main", "--work", work,
                   "--size-mib", str(args.size_mib), "--nodes", str(args.nodes),
                   "--per-node", str(args.per_node),
                   "--compression", args.compression or "none"]
            if args.durable:
                cmd += ["--durable", args.durable]
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"ranks failed: exit codes {codes}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
