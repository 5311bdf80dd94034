"""Coordination bytes of one save: what each rank sends and receives in collectives.

N gloo ranks on 127.0.0.1 (default 32; one process each) hold a small sharded model: ``--layers``
1-D tensors sharded over the ranks (DTensor ``Shard(0)``, ``--elems`` floats per rank and layer,
times 1-3), three replicated tensors and a step counter. The tensors are tiny on purpose: what is
measured is the coordination (plans, write results, metadata), not the data. Each method saves
the same state twice, into successive directories, and every rank counts the bytes it sends and
receives in collectives during each save (benchmarks/_collective_bytes.py: logical bytes, each
destination once), then during loads of the whole state on all ranks (pyckpt's first save, then
its second: the same layout, so the second load runs on the cached plan; DCP's second save with
``FileSystemReader``), each checked bit-exact:

* ``pyckpt``: ``pyckpt.save`` (its SavePlanner and Writer, coordination on
  ``pyckpt.coordination_group``);
* ``dcp``: ``dcp.save`` with ``FileSystemWriter`` and ``DefaultSavePlanner``;
* ``dcp-cache``: the same with ``DefaultSavePlanner(enable_plan_caching=True)`` (one planner
  for both saves, so the second may reuse the first's plans).

Reported per save: the median and the maximum over ranks of the bytes sent and received, rank 0's
(the coordinator's), its collective calls, and the slowest rank's time. Then the loads are
checked bit-exact across a reshard: the N-rank checkpoint loaded by the first ``--reshard`` ranks
(default N / 4; a subgroup, its own DTensor mesh), which save it again; that checkpoint loaded by
all N ranks.

    python benchmarks/bench_coord_bytes.py                 # 32 ranks (a minute or two on 2 cores)
    python benchmarks/bench_coord_bytes.py --ranks 8 --json coord.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

METHODS = ("pyckpt", "dcp", "dcp-cache")
SAVES = 2


def _global(i: int, layer_len: int) -> Any:
    """Layer ``i``'s whole tensor (the same on every rank and world size)."""
    import torch

    gen = torch.Generator().manual_seed(1000 + i)
    return torch.randn(layer_len, generator=gen)


def _layer_len(i: int, ranks: int, elems: int) -> int:
    return elems * ranks * (1 + i % 3)


def _state(mesh: Any, world: int, rank: int, ranks: int, layers: int, elems: int,
           fill: bool) -> dict[str, Any]:
    """The state of group rank ``rank`` of ``world`` (``fill``: the values; else zeros)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    sd: dict[str, Any] = {}
    for i in range(layers):
        n = _layer_len(i, ranks, elems)
        per = n // world
        local = (_global(i, n)[rank * per:(rank + 1) * per].clone() if fill
                 else torch.zeros(per))
        sd[f"layers.{i}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size([n]), stride=(1,))
    gen = torch.Generator().manual_seed(7)
    replicated = {"norm.weight": torch.randn(64, generator=gen),
                  "embed.scale": torch.randn(16, generator=gen).to(torch.bfloat16),
                  "rope.index": torch.arange(8, dtype=torch.int64)}
    for name, t in replicated.items():
        sd[name] = t if fill else torch.zeros_like(t)
    sd["step"] = 1000 if fill else 0
    return sd


def _mismatches(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    import torch
    from torch.distributed.tensor import DTensor

    bad = []
    for name, w in want.items():
        g = got[name]
        if isinstance(w, DTensor):
            g, w = g.to_local(), w.to_local()
        if isinstance(w, torch.Tensor):
            same = g.dtype == w.dtype and torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        else:
            same = g == w
        if not same:
            bad.append(name)
    return bad


def _rank_work(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: the saves (counted), then the reshard checks."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from _collective_bytes import count_collective_bytes
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.device_mesh import DeviceMesh

    import pyckpt

    root, layers, elems, reshard = spec["dir"], spec["layers"], spec["elems"], spec["reshard"]
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    sd = _state(mesh, world, rank, world, layers, elems, fill=True)
    caching = DefaultSavePlanner(enable_plan_caching=True)
    savers = {
        "pyckpt": lambda p: pyckpt.save(sd, p),
        "dcp": lambda p: dcp.save(sd, storage_writer=FileSystemWriter(p),
                                  planner=DefaultSavePlanner()),
        "dcp-cache": lambda p: dcp.save(sd, storage_writer=FileSystemWriter(p),
                                        planner=caching),
    }
    out: dict[str, Any] = {"saves": {}}
    for method in METHODS:
        for k in range(1, SAVES + 1):
            path = os.path.join(root, f"{method}-{k}")
            dist.barrier()
            t0 = time.perf_counter()
            with count_collective_bytes() as counts:
                savers[method](path)
            seconds = time.perf_counter() - t0
            entry = {"sent": counts.sent_total, "received": counts.received_total,
                     "calls": sum(counts.calls.values()), "seconds": seconds}
            if rank == 0:
                entry["detail"] = counts.as_dict()
            out["saves"][f"{method}-{k}"] = entry
    # Loads of the whole state on all N ranks, counted the same way: pyckpt's first load of a
    # layout, its second (the next save, same layout: the cached global plan), and DCP's.
    from torch.distributed.checkpoint import FileSystemReader

    loaders = {
        "pyckpt-load-1": lambda got: pyckpt.load(got, os.path.join(root, "pyckpt-1")),
        "pyckpt-load-2": lambda got: pyckpt.load(got, os.path.join(root, "pyckpt-2")),
        "dcp-load": lambda got: dcp.load(
            got, storage_reader=FileSystemReader(os.path.join(root, "dcp-2"))),
    }
    out["bad_loads"] = []
    for key, loader in loaders.items():
        got = _state(mesh, world, rank, world, layers, elems, fill=False)
        dist.barrier()
        t0 = time.perf_counter()
        with count_collective_bytes() as counts:
            loader(got)
        seconds = time.perf_counter() - t0
        out["bad_loads"] += [f"{key}: {name}" for name in _mismatches(got, sd)]
        entry = {"sent": counts.sent_total, "received": counts.received_total,
                 "calls": sum(counts.calls.values()), "seconds": seconds}
        if rank == 0:
            entry["detail"] = counts.as_dict()
        out["saves"][key] = entry
    # Reshard N -> M: the first M ranks (a subgroup with its own mesh) load pyckpt's second
    # save, compare bit for bit, and save it again; then N -> M's checkpoint on all N ranks.
    sub = dist.new_group(list(range(reshard)))
    if rank < reshard:
        sub_mesh = DeviceMesh.from_group(sub, "cpu")
        want = _state(sub_mesh, reshard, rank, world, layers, elems, fill=True)
        got = _state(sub_mesh, reshard, rank, world, layers, elems, fill=False)
        pyckpt.load(got, os.path.join(root, f"pyckpt-{SAVES}"), process_group=sub)
        out["bad_down"] = _mismatches(got, want)
        pyckpt.save(want, os.path.join(root, "resharded"), process_group=sub)
    dist.barrier()
    got = _state(mesh, world, rank, world, layers, elems, fill=False)
    pyckpt.load(got, os.path.join(root, "resharded"))
    out["bad_up"] = _mismatches(got, sd)
    return out


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    rows = {}
    for key in results[0]["saves"]:
        per = [r["saves"][key] for r in results]
        sent = [p["sent"] for p in per]
        received = [p["received"] for p in per]
        rows[key] = {
            "sent_median": statistics.median(sent), "sent_max": max(sent),
            "received_median": statistics.median(received), "received_max": max(received),
            "rank0_sent": sent[0], "rank0_received": received[0],
            "rank0_calls": per[0]["calls"], "seconds_max": max(p["seconds"] for p in per),
            "rank0_detail": per[0]["detail"],
        }
    return rows


def _kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def _table(rows: dict[str, Any]) -> str:
    lines = ["| operation | sent KiB median / max | received KiB median / max | rank 0 sent / "
             "received KiB | rank 0 calls | s (slowest) |", "|---|---|---|---|---|---|"]
    for key, r in rows.items():
        lines.append(
            f"| {key} | {_kib(r['sent_median'])} / {_kib(r['sent_max'])} | "
            f"{_kib(r['received_median'])} / {_kib(r['received_max'])} | "
            f"{_kib(r['rank0_sent'])} / {_kib(r['rank0_received'])} | {r['rank0_calls']} | "
            f"{r['seconds_max']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--elems", type=int, default=4, help="floats per rank of a layer (x1-3)")
    ap.add_argument("--reshard", type=int, default=None,
                    help="ranks of the reshard check (default ranks // 4; must divide ranks)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp directory)")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    reshard = args.reshard or max(1, args.ranks // 4)
    if args.ranks < 1 or args.ranks % reshard:
        ap.error(f"--reshard {reshard} must divide --ranks {args.ranks}")
    from dist_utils import run_distributed

    work = tempfile.mkdtemp(prefix="coord-bytes-", dir=args.dir)
    try:
        spec = {"dir": work, "layers": args.layers, "elems": args.elems, "reshard": reshard}
        t0 = time.perf_counter()
        results = run_distributed(_rank_work, args.ranks, spec)
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = _summary(results)
    bad = {r: (res.get("bad_down", []), res["bad_up"], res["bad_loads"])
           for r, res in enumerate(results)
           if res.get("bad_down") or res["bad_up"] or res["bad_loads"]}
    print(f"{args.ranks} gloo ranks, {args.layers} sharded layers + 3 replicated tensors + a "
          f"step; bytes per save (logical: each destination once); {wall:.0f} s in all")
    print(_table(rows))
    print(f"loads, and reshard {args.ranks} -> {reshard} -> {args.ranks}: "
          + ("bit-exact" if not bad else f"MISMATCH {bad}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "layers": args.layers, "elems": args.elems,
                       "reshard": reshard, "wall_s": wall, "rows": rows,
                       "bit_exact": not bad, "mismatches": bad}, f, indent=1)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
