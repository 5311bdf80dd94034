"""Cross-node consolidation over gloo vs shared-filesystem consolidation, on one machine.

Usage:
    PYCKPT_BENCH_SCALE=1 python benchmarks/compare_nodelocal.py [--repeats 3] [--world 2]
        [--dim 0|1] [--compression zstd|none] [--batch-mib 64] [--dir DIR]

A pyckpt checkpoint of the same bf16 state as benchmarks/compare_consolidate.py is saved by
``--world`` gloo ranks (DTensor ``Shard(dim)``). It is then consolidated by ``--world`` gloo
workers into one safetensors file per rank's share (~``world`` files) two ways, alternating:

* **shared**: every worker reads the one directory holding every data file (today's default);
* **node-local**: each worker is given its own directory holding ``pyckpt.json`` and only the
  data files its rank wrote (``consolidate(..., shared_filesystem=False)``); chunks of the
  other ranks' files travel over gloo (TCP on 127.0.0.1) in rounds of ``--batch-mib``.

Warm page cache, no fsync. Prints median [min-max] wall time (slowest worker) and throughput
in output GB/s. On one machine the two modes share the CPUs and the loopback "network" is a
memory copy through the kernel: the difference is the cost of the transfer path (owner read
and verify, gloo send/receive, staging of each received batch), not of a real network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _consolidate_data import nbytes, scale, state_dict, write_pyckpt

from pyckpt._format import CODECS


def _worker(rank: int, world: int, port: int, srcs: list[str], dsts: list[str], local: bool,
            batch: int, mfb: int, out: str) -> None:
    import torch.distributed as dist

    import pyckpt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        dist.barrier()
        kwargs = {"shared_filesystem": False, "batch_bytes": batch} if local else {}
        res = pyckpt.consolidate(srcs[rank], dsts[rank], threads=1, fsync=False,
                                 max_file_bytes=mfb, **kwargs)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump({"secs": res.seconds, "bytes": res.rank_bytes, "total": res.total_bytes},
                      fh)
    finally:
        dist.destroy_process_group()


def _run(world: int, srcs: list[str], dsts: list[str], local: bool, batch: int, mfb: int,
         work: str) -> tuple[float, int]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(dir=work)
    for d in set(dsts):
        shutil.rmtree(d, ignore_errors=True)
    mp.spawn(_worker, args=(world, port, srcs, dsts, local, batch, mfb, out), nprocs=world,
             join=True)
    res = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            res.append(json.load(fh))
    shutil.rmtree(out)
    return max(r["secs"] for r in res), res[0]["total"]


def _split_by_node(shared: str, nodes: str, world: int) -> list[str]:
    """Node k's directory: pyckpt.json plus the data files rank k wrote."""
    from pyckpt._format import METADATA_FILE, is_data_file

    dirs = []
    for k in range(world):
        d = os.path.join(nodes, f"n{k}")
        os.makedirs(d)
        shutil.copy(os.path.join(shared, METADATA_FILE), d)
        for n in os.listdir(shared):
            if is_data_file(n) and int(n.split("-")[0]) == k:
                os.link(os.path.join(shared, n), os.path.join(d, n))
        dirs.append(d)
    return dirs


def _check_same(shared: str, nodes: list[str]) -> None:
    """The node-local export (spread over the nodes' dst) equals the shared one, bit for bit."""
    import torch
    from safetensors.torch import load_file

    def tensors(dirs: list[str]) -> dict:
        out: dict = {}
        for d in dirs:
            for n in os.listdir(d):
                if n.endswith(".safetensors"):
                    out.update(load_file(os.path.join(d, n)))
        return out

    a, b = tensors([shared]), tensors(nodes)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dim", type=int, default=0)
    ap.add_argument("--compression", default="zstd", choices=CODECS)
    ap.add_argument("--batch-mib", type=float, default=64)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="pyckpt-nodelocal-", dir=args.dir)
    try:
        target = int(scale() * (1 << 30))
        size = nbytes(state_dict(target))
        comp = None if args.compression == "none" else args.compression
        shared = os.path.join(work, "shared")
        write_pyckpt(shared, target, args.world, args.dim, comp)
        stored = sum(os.path.getsize(os.path.join(shared, n)) for n in os.listdir(shared)
                     if n.endswith(".pyckpt"))
        nodes = _split_by_node(shared, os.path.join(work, "nodes"), args.world)
        mfb = max(1, size // args.world)
        batch = max(1, int(args.batch_mib * (1 << 20)))
        load = os.getloadavg()
        print(f"# {size / 2**20:.0f} MiB bf16, saved by {args.world} ranks (Shard({args.dim}), "
              f"{args.compression}, {stored / 2**20:.0f} MiB stored); {args.world} gloo workers, "
              f"1 thread each; {os.cpu_count()} CPUs; load average {load[0]:.1f}; "
              f"repeats={args.repeats}; warm cache, no fsync; batch {args.batch_mib} MiB")
        cases = {
            "shared filesystem": ([shared] * args.world,
                                  [os.path.join(work, "dst-shared")] * args.world, False),
            "node-local over gloo": (nodes, [os.path.join(work, f"dst-n{k}")
                                             for k in range(args.world)], True),
        }
        times: dict[str, list[float]] = {c: [] for c in cases}
        for rep in range(args.repeats + 1):  # the first round warms the cache, not recorded
            for name, (srcs, dsts, local) in cases.items():
                secs, total = _run(args.world, srcs, dsts, local, batch, mfb, work)
                assert total == size, (total, size)
                if rep:
                    times[name].append(secs)
        _check_same(os.path.join(work, "dst-shared"),
                    [os.path.join(work, f"dst-n{k}") for k in range(args.world)])
        print("\n| mode | wall (slowest worker) | output GB/s |")
        print("|---|---|---|")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name} | {med:.3f} [{min(ts):.3f}-{max(ts):.3f}] s | "
                  f"{size / med / 1e9:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
