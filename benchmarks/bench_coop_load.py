"""Cooperative loads of replicated state: bytes read from storage per rank, and load time.

Every rank of a gloo group holds the same bf16 LLM-shaped state dict (DDP / FSDP ``NO_SHARD``)
and loads it from one shared directory. Methods, same run, same machine, order alternating
between repeats:

* ``dcp``: DCP's ``FileSystemReader`` on a checkpoint saved by ``FileSystemWriter``;
* ``pyckpt-solo``: ``pyckpt.Reader(cooperative=False)`` (every rank reads everything);
* ``pyckpt-coop``: ``pyckpt.Reader(cooperative=True)`` (each stored chunk read by one rank,
  sent to the others still compressed);
* ``pyckpt-default``: ``pyckpt.Reader()`` (decided per load, docs/REPLICATED.md: on one machine
  the same as ``pyckpt-solo`` for a directory and ``pyckpt-coop`` for ``s3://``).

Reported per method: median load wall time (slowest rank, barrier to barrier) and the bytes
each rank read from storage (pyckpt: ``Reader.bytes_read``; DCP: the rank's ``rchar`` from
``/proc/self/io`` during the load, i.e. bytes returned by read calls), with max/mean and total
over the stored bytes. ``--s3`` loads from a local SeaweedFS instead (pyckpt only; bytes
fetched are ``Reader.bytes_fetched``).

    python benchmarks/bench_coop_load.py --size-gib 1 --world 4 --repeats 3 --json coop.json
    python benchmarks/bench_coop_load.py --size-gib 1 --world 4 --s3
    python benchmarks/bench_coop_load.py --size-mib 8 --world 2 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from pyckpt._format import CODECS

HERE = os.path.dirname(os.path.abspath(__file__))


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    """bf16 LLM-shaped tensors (4096-wide rows) totalling about ``nbytes``."""
    g = torch.Generator().manual_seed(0)
    width = 4096 if nbytes >= 64 << 20 else 256
    rows_total = max(8, nbytes // (2 * width))
    sd, i = {}, 0
    while rows_total > 0:
        rows = min(rows_total, 4 * width)
        sd[f"layers.{i}.weight"] = torch.randn(rows, width, generator=g).to(torch.bfloat16)
        rows_total -= rows
        i += 1
    return sd


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _rank(rank: int, world: int, port: int, args: dict[str, Any], q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), **args.get("env", {}))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    try:
        import pyckpt
        from pyckpt.api import load_planner

        state = _state(args["nbytes"])
        root = args["root"]
        pk = root if args["s3"] else os.path.join(root, "pyckpt")
        pyckpt.save(state, pk, compression=args["compression"])
        methods = ["pyckpt-solo", "pyckpt-coop", "pyckpt-default"]
        if not args["s3"]:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(root, "dcp")))
            methods.insert(0, "dcp")
        results: dict[str, list[tuple[float, int]]] = {m: [] for m in methods}
        for rep in range(args["repeats"]):
            for m in (methods if rep % 2 == 0 else methods[::-1]):
                target = {k: torch.empty_like(v) for k, v in state.items()}
                dist.barrier()
                t0 = time.perf_counter()
                if m == "dcp":
                    before = _rchar()
                    dcp.load(target, storage_reader=dcp.FileSystemReader(os.path.join(root, "dcp")))
                    nread = _rchar() - before
                else:
                    coop = {"pyckpt-solo": False, "pyckpt-coop": True}.get(m)
                    with pyckpt.Reader(pk, cooperative=coop) as reader:
                        dcp.load(target, storage_reader=reader, planner=load_planner())
                    nread = reader.bytes_fetched if args["s3"] else reader.bytes_read
                dist.barrier()
                results[m].append((time.perf_counter() - t0, nread))
                bad = [k for k in state if not torch.equal(target[k].view(torch.uint8),
                                                           state[k].view(torch.uint8))]
                if bad:
                    raise AssertionError(f"{m}: loaded values differ in {bad[:3]}")
        stored: Any = 0
        if rank == 0 and not args["s3"]:
            stored = {"pyckpt": _dir_bytes(pk, ".pyckpt"),
                      "dcp": _dir_bytes(os.path.join(root, "dcp"), ".distcp")}
        elif rank == 0:  # the data objects' sizes, as the committed metadata lists them
            from pyckpt.backends import open_backend

            with tempfile.TemporaryDirectory() as tmp:
                doc = os.path.join(tmp, "pyckpt.json")
                open_backend(pk).get_file("pyckpt.json", doc)
                with open(doc) as fh:
                    stored = {"pyckpt": sum(json.load(fh)["files"].values())}
        q.put((rank, results, stored))
    finally:
        dist.destroy_process_group()


def _dir_bytes(path: str, suffix: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
               if n.endswith(suffix))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=None)
    ap.add_argument("--size-mib", type=float, default=None)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compression", default="zstd", choices=CODECS)
    ap.add_argument("--s3", action="store_true", help="load from a local SeaweedFS")
    ap.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    mib = a.size_mib if a.size_mib is not None else (a.size_gib or 1.0) * 1024
    nbytes = int(mib * (1 << 20))
    root = tempfile.mkdtemp(prefix="coop-", dir=a.dir)
    server = None
    env: dict[str, str] = {}
    try:
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        if a.s3:
            from _s3server import SeaweedServer

            server = SeaweedServer()
            server.start()
            server.create_bucket("bench")
            env = server.env()
            root = f"s3://bench/coop-{os.getpid()}"
        from _ports import free_port

        args = {"nbytes": nbytes, "root": root, "repeats": a.repeats, "s3": a.s3, "env": env,
                "compression": None if a.compression == "none" else a.compression}
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, a.world, port, args, q))
                 for r in range(a.world)]
        for p in procs:
            p.start()
        out = [q.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"a rank failed (exit code {p.exitcode})")
    finally:
        if server is not None:
            server.close()
        if not a.s3:
            shutil.rmtree(root, ignore_errors=True)
    out.sort(key=lambda r: r[0])
    stored = out[0][2]
    report = _report(out, stored, a.world)
    print(f"replicated state {mib:.0f} MiB, {a.world} ranks, compression {a.compression}"
          f"{', S3 (SeaweedFS)' if a.s3 else ', one shared directory'}")
    print(f"{'method':<15} {'load s median [min-max]':>24} {'MiB/rank max':>13} {'max/mean':>9} "
          f"{'total/stored':>13}")
    for m, row in report.items():
        ratio = f"{row['total_over_stored']:.3f}" if row["total_over_stored"] else "-"
        spread = f"{row['seconds']:.3f} [{row['min_s']:.3f}-{row['max_s']:.3f}]"
        print(f"{m:<15} {spread:>24} {row['max_mib']:>13.1f} "
              f"{row['max_over_mean']:>9.3f} {ratio:>13}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mib": mib, "world": a.world, "s3": a.s3, "results": report}, f, indent=1)


def _report(out: list[Any], stored: dict[str, int], world: int) -> dict[str, Any]:
    report = {}
    for m in out[0][1]:
        reps = len(out[0][1][m])
        times = [max(out[r][1][m][i][0] for r in range(world)) for i in range(reps)]
        per_rank = [out[r][1][m][-1][1] for r in range(world)]
        mean = sum(per_rank) / world
        base = stored.get("dcp" if m == "dcp" else "pyckpt", 0) if stored else 0
        report[m] = {"seconds": statistics.median(times), "min_s": min(times),
                     "max_s": max(times), "per_rank_bytes": per_rank,
                     "max_mib": max(per_rank) / (1 << 20),
                     "max_over_mean": max(per_rank) / mean if mean else 0.0,
                     "total_over_stored": sum(per_rank) / base if base else None}
    return report


if __name__ == "__main__":
    main()
