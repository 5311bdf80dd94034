"""Recovery after losing one of 2 nodes: restore from the fast tier's replicas vs from durable.

Starts ``--nodes x --per-node`` CPU ranks (gloo) as separate processes with torchrun's
variables. Each node's fast tier is its own directory (``<work>/nodes/n<k>/...``, tmpfs by
default under /dev/shm). Every durable tier named by ``--durable`` is measured in the same run:
``dir`` (a local directory, ``<work>/durable``), ``s3`` (a real SeaweedFS started here, as
``bench_coop_load.py --s3`` does) or an explicit ``s3://bucket/prefix`` (the AWS_* variables
point the client at it). For each of ``--repeats`` rounds and each durable tier:

1. every rank's shard (``--size-mib`` MiB of bf16) is saved with ``dcp.async_save`` and
   pyckpt's Writer (the baseline blocking time), then with a CheckpointManager (replicas=1,
   persisted to the durable tier); the order of the two alternates between rounds. Reported:
   the blocking time of each (the slowest rank's), the fast-tier write time, the replication
   time and the replica bytes on the wire;
2. node 1 is lost (its fast-tier directory is deleted; its ranks come back with nothing);
3. every rank restores from the fast tier (node 0's files + replicas), timed. The durable
   tier's data files are moved away meanwhile (a read from it would fail) and the bytes the
   manager read from it must be 0: anything else stops the benchmark;
4. every rank restores the same step from the durable tier alone, timed, with its bytes.

Every timing is the median over the rounds with its min-max (never the best round). A warm-up
``async_save`` before the first round allocates the staging memory both saves reuse.

    python benchmarks/bench_recovery.py --size-mib 1024 --durable dir,s3   # the issue's target
    python benchmarks/bench_recovery.py --size-mib 8 --repeats 2 --json out.json
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
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
COLS = 4096  # bf16 elements per row of the state


# ----------------------------------------------------------------------------- rank side


def _shard(rank: int, rows: int) -> Any:
    """This rank's bf16 rows (std 0.02, like trained weights), made in slices (no float32 copy
    of the whole shard)."""
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    out = torch.empty(rows, COLS, dtype=torch.bfloat16)
    step = max(1, (64 << 20) // (4 * COLS))
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        out[r0:r0 + n] = (torch.randn(n, COLS, generator=g) * 0.02).to(torch.bfloat16)
    return out


def _hide_data(location: str, options: dict[str, Any] | None, aside: str) -> list[str]:
    """Moves the data files of the durable checkpoint ``location`` to directory ``aside`` (its
    ``pyckpt.json`` stays, so the step is still listed as committed); returns their names."""
    from pyckpt import _format
    from pyckpt.backends import open_backend

    backend = open_backend(location, options or None)
    names = sorted(n for n in backend.list_names() if _format.is_data_file(n))
    os.makedirs(aside, exist_ok=True)
    for n in names:
        backend.get_file(n, os.path.join(aside, n))
    backend.delete(names)
    left = [n for n in backend.list_names() if _format.is_data_file(n)]
    if left or not names:
        raise SystemExit(f"{location}: could not move its data files aside (left: {left}, "
                         f"moved: {names})")
    return names


def _restore_data(location: str, options: dict[str, Any] | None, aside: str,
                  names: Sequence[str]) -> None:
    from pyckpt.backends import open_backend

    backend = open_backend(location, options or None)
    for n in names:
        backend.put_file(os.path.join(aside, n))
    shutil.rmtree(aside)


def _rank_main(spec_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import pyckpt

    with open(spec_path) as f:
        spec = json.load(f)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["GROUP_RANK"])
    per_node = spec["per_node"]
    node_root = os.path.join(spec["work"], "nodes", f"n{node}")
    leader = rank % per_node == 0
    compression = spec["compression"]
    mesh = init_device_mesh("cpu", (world,))
    rows = max(1, spec["size_mib"] * (1 << 20) // (2 * COLS))
    mine = _shard(rank, rows)

    def state(zeros: bool) -> dict[str, Any]:
        src = torch.zeros_like(mine) if zeros else mine.clone()
        return {"w": DTensor.from_local(src, mesh, [Shard(0)], run_check=False)}

    def exact(target: dict[str, Any]) -> bool:
        return bool(torch.equal(target["w"].to_local().view(torch.int16),
                                mine.view(torch.int16)))

    def timed_async_save(path: str) -> float:
        with pyckpt.Writer(path, compression, shared_filesystem=False) as writer:
            sd = state(False)
            dist.barrier()
            t0 = time.perf_counter()
            pending = dcp.async_save(sd, storage_writer=writer)
            blocking = time.perf_counter() - t0
            pending.result()
        dist.barrier()
        if leader:
            shutil.rmtree(path)
        dist.barrier()
        return blocking

    def manager(durable: str, local: str | None, options: dict[str, Any] | None) -> Any:
        return pyckpt.CheckpointManager(
            durable, local=local, replicas=1, save_every=1, persist_every=1,
            compression=compression, storage_options=options)

    def timed_restore(durable: str, local: str | None,
                      options: dict[str, Any] | None) -> tuple[Any, Any, float, bool]:
        """A new manager's restore of step 1 into zeros, timed barrier to barrier: (manager,
        its last_restore, seconds, bit-exact)."""
        mgr = manager(durable, local, options)
        target = state(True)
        dist.barrier()
        t0 = time.perf_counter()
        step = mgr.restore(target)
        dist.barrier()
        seconds = time.perf_counter() - t0
        info = mgr.last_restore
        assert step == 1 and info is not None
        return mgr, info, seconds, exact(target)

    def timed_manager_save(mgr: Any, out: dict[str, Any]) -> None:
        sd = state(False)
        dist.barrier()
        t0 = time.perf_counter()
        fut = mgr.save(1, sd)
        out["save_blocking_s"] = time.perf_counter() - t0
        assert fut is not None and fut.result() == 1
        mgr.wait()  # the persistence to the durable tier too
        info = mgr.last_save
        assert info is not None
        out["save_write_s"] = info.write_s
        out["replication_s"] = info.replication_s
        out["replica_bytes_sent"] = info.bytes_sent
        mgr.close()

    # Warm-up: the first staging allocates the staging memory every later save reuses.
    timed_async_save(os.path.join(node_root, "warmup"))
    rounds: list[dict[str, Any]] = []
    for rep in range(spec["repeats"]):
        for d in spec["durables"]:
            out: dict[str, Any] = {"durable": d["name"], "repeat": rep}
            local = os.path.join(node_root, f"{d['name']}-r{rep}")
            durable = d["url"].rstrip("/") + f"/r{rep}"
            options = d["options"]

            if rep % 2 == 0:
                out["async_save_blocking_s"] = timed_async_save(os.path.join(node_root, "base"))
                timed_manager_save(manager(durable, local, options), out)
            else:
                timed_manager_save(manager(durable, local, options), out)
                out["async_save_blocking_s"] = timed_async_save(os.path.join(node_root, "base"))

            # Lose node 1: its fast tier is gone (its ranks come back with nothing).
            dist.barrier()
            if node == 1 and leader:
                shutil.rmtree(local)
            dist.barrier()

            step_url = durable + "/step-1"
            aside = os.path.join(spec["work"], f"aside-{d['name']}-r{rep}")
            hidden: list[str] = []
            if rank == 0:
                hidden = _hide_data(step_url, options, aside)
            dist.barrier()
            mgr, info, out["restore_fast_s"], out["restore_fast_exact"] = timed_restore(
                durable, local, options)
            out["restore_fast_tier"] = info.tier
            out["restore_fast_bytes_durable"] = info.bytes_durable + mgr.store.data_bytes_read
            out["restore_fast_durable_loads"] = mgr.store.direct_loads
            out["restore_fast_bytes_local"] = info.bytes_local
            out["restore_fast_bytes_peer"] = info.bytes_peer
            mgr.close()
            dist.barrier()
            if rank == 0:
                _restore_data(step_url, options, aside, hidden)
            dist.barrier()

            mgr, info, out["restore_durable_s"], out["restore_durable_exact"] = timed_restore(
                durable, None, options)  # durable only
            out["restore_durable_tier"] = info.tier
            out["restore_durable_bytes_durable"] = info.bytes_durable
            if rank == 0:
                mgr.store.remove(1)  # free the space before the next round
            mgr.close()
            dist.barrier()
            if leader:
                shutil.rmtree(local, ignore_errors=True)
            dist.barrier()
            rounds.append(out)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rounds)
    if rank == 0:
        with open(spec["result"], "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver side


def _stats(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "samples": list(values)}


def summarize(per_rank: list[list[dict[str, Any]]], spec: dict[str, Any]) -> dict[str, Any]:
    """Per durable tier: every timing over the rounds (each round's value is the slowest
    rank's), bytes summed over the ranks. Raises SystemExit when a fast-tier restore read
    durable bytes, came from another tier or was not bit-exact."""
    out: dict[str, Any] = {
        "ranks": len(per_rank), "nodes": spec["nodes"], "per_node": spec["per_node"],
        "size_mib_per_rank": spec["size_mib"], "compression": spec["compression"],
        "repeats": spec["repeats"], "durable": {}}
    for d in spec["durables"]:
        rounds = [[r for r in rank if r["durable"] == d["name"]] for rank in per_rank]
        n = len(rounds[0])

        def slowest(key: str, rounds: list[list[dict[str, Any]]] = rounds, n: int = n
                    ) -> list[float]:
            return [max(float(rank[i][key]) for rank in rounds) for i in range(n)]

        def total(key: str, rounds: list[list[dict[str, Any]]] = rounds, n: int = n
                  ) -> list[int]:
            return [sum(int(rank[i][key]) for rank in rounds) for i in range(n)]

        fast_durable = total("restore_fast_bytes_durable")
        loads = total("restore_fast_durable_loads")
        tiers = {rank[i]["restore_fast_tier"] for rank in rounds for i in range(n)}
        exact = all(rank[i]["restore_fast_exact"] and rank[i]["restore_durable_exact"]
                    for rank in rounds for i in range(n))
        if any(fast_durable) or any(loads) or tiers != {"fast"}:
            raise SystemExit(f"{d['name']}: the restore after losing node 1 read from the "
                             f"durable tier: bytes {fast_durable}, direct loads {loads}, "
                             f"tiers {sorted(map(str, tiers))}")
        if not exact:
            raise SystemExit(f"{d['name']}: a restore was not bit-exact")
        a, m = slowest("async_save_blocking_s"), slowest("save_blocking_s")
        fast, slow = slowest("restore_fast_s"), slowest("restore_durable_s")
        out["durable"][d["name"]] = {
            "location": d["url"],
            "async_save_blocking_s": _stats(a),
            "save_blocking_s": _stats(m),
            "save_blocking_over_async_save": _stats([y / x for x, y in zip(a, m)]),
            "save_write_s": _stats(slowest("save_write_s")),
            "replication_s": _stats(slowest("replication_s")),
            "replica_bytes_on_wire": _stats(total("replica_bytes_sent")),
            "restore_after_losing_node1_s": _stats(fast),
            "restore_after_losing_node1_bytes_from_durable": fast_durable,
            "restore_after_losing_node1_bytes_from_peers": _stats(
                total("restore_fast_bytes_peer")),
            "restore_after_losing_node1_bytes_local": _stats(total("restore_fast_bytes_local")),
            "restore_from_durable_s": _stats(slow),
            "restore_from_durable_bytes": _stats(total("restore_durable_bytes_durable")),
            "durable_over_fast_restore": _stats([y / x for x, y in zip(fast, slow)]),
            "bit_exact": exact,
        }
    return out


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table: one column per durable tier, median (min-max)."""
    names = list(report["durable"])

    def cell(v: Any, kind: str) -> str:
        if isinstance(v, list):  # per-round byte counts that must be 0
            return "/".join(str(x) for x in v)
        if kind == "s":
            return f"{v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})"
        if kind == "x":
            return f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"
        return f"{v['median'] / (1 << 20):.1f} ({v['min'] / (1 << 20):.1f}-" \
               f"{v['max'] / (1 << 20):.1f})"

    rows = [
        ("dcp.async_save(Writer) blocking, s", "async_save_blocking_s", "s"),
        ("CheckpointManager.save blocking, s", "save_blocking_s", "s"),
        ("save blocking / async_save (target <= 1.10x)", "save_blocking_over_async_save", "x"),
        ("fast-tier write, s", "save_write_s", "s"),
        ("replication, s", "replication_s", "s"),
        ("replica bytes on the wire, MiB", "replica_bytes_on_wire", "b"),
        ("restore after losing node 1 (fast tier), s", "restore_after_losing_node1_s", "s"),
        ("  bytes from durable (must be 0)", "restore_after_losing_node1_bytes_from_durable",
         "b0"),
        ("  bytes from peers, MiB", "restore_after_losing_node1_bytes_from_peers", "b"),
        ("restore from the durable tier, s", "restore_from_durable_s", "s"),
        ("  bytes from durable, MiB", "restore_from_durable_bytes", "b"),
        ("durable restore / fast-tier restore", "durable_over_fast_restore", "x"),
    ]
    lines = ["| measure | " + " | ".join(f"durable: {n}" for n in names) + " |",
             "|---" * (1 + len(names)) + "|"]
    for label, key, kind in rows:
        lines.append(f"| {label} | "
                     + " | ".join(cell(report["durable"][n][key], kind) for n in names) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--size-mib", type=int, default=64, help="state per rank (MiB of bf16)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="rounds (medians and min-max)")
    p.add_argument("--durable", default="dir,s3",
                   help="comma-separated durable tiers: dir, s3 (a SeaweedFS started here) or "
                        "an s3://bucket/prefix URL")
    p.add_argument("--compression", default="zstd", choices=["zstd", "none"])
    p.add_argument("--work", default=None, help="work directory (default: under /dev/shm)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before the ranks "
                   "are killed")
    p.add_argument("--rank-main", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        _rank_main(args.rank_main)
        return 0
    if args.nodes < 2 or args.per_node < 1 or args.repeats < 1 or args.size_mib < 1:
        p.error("--nodes >= 2, --per-node, --repeats and --size-mib >= 1")
    kinds = [k.strip() for k in args.durable.split(",") if k.strip()]
    if not kinds or any(k not in ("dir", "s3") and not k.startswith("s3://") for k in kinds):
        p.error(f"--durable {args.durable!r}: use dir, s3 or s3://bucket/prefix")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = tempfile.mkdtemp(prefix="pyckpt-recovery-", dir=args.work or base)
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from _ranks import run_ranks

    server = None
    env = dict(os.environ)
    try:
        durables = []
        for k in kinds:
            if k == "dir":
                durables.append({"name": "dir", "url": os.path.join(work, "durable"),
                                 "options": None})
            elif k == "s3":
                if server is None:
                    from _s3server import SeaweedServer

                    server = SeaweedServer()
                    server.start()
                    server.create_bucket("bench")
                durables.append({"name": "s3", "url": f"s3://bench/recovery-{os.getpid()}",
                                 "options": server.storage_options()})
            else:
                durables.append({"name": k, "url": k, "options": None})
        spec = {"work": work, "size_mib": args.size_mib, "nodes": args.nodes,
                "per_node": args.per_node, "repeats": args.repeats,
                "compression": None if args.compression == "none" else args.compression,
                "durables": durables, "result": os.path.join(work, "result.json")}
        per_rank = run_ranks(__file__, spec, args.nodes * args.per_node, args.per_node,
                             args.timeout, env)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)
    report = summarize(per_rank, spec)
    for d in report["durable"].values():  # no credentials in the report
        d.pop("options", None)
    print(f"recovery: {report['ranks']} ranks on {report['nodes']} nodes, "
          f"{args.size_mib} MiB bf16 per rank, compression {args.compression}, "
          f"{args.repeats} rounds; median (min-max)")
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
