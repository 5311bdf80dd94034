"""Replicated-state saves: pyckpt.SavePlanner vs DCP's default planner, and planning cost.

Every rank holds the same bf16 LLM-shaped state dict (DDP / FSDP NO_SHARD). For each world size
the same pyckpt.Writer saves it with each planner (fsync on, same machine, same run, the order of
the planners alternating between repeats); the table gives the median save wall time (slowest
rank, barrier to barrier) and the bytes each rank wrote, read from the data files on disk. A second table times the coordinator's global planning on
synthetic local plans of many tensors.

The replica check (every rank digests the replicated tensors it holds, the coordinator compares
the digests) is measured in both of its modes, ``sample`` (the default: at most 1 MiB read per
tensor) and ``full`` (every byte): end to end, as the save time of ``pyckpt`` (default check)
and ``pyckpt-full`` (``check_replicas="full"``) against ``pyckpt-nocheck``
(``check_replicas=False``); and directly, as the time each rank spends in
``pyckpt.planner.replica_digests`` over its state dict (all ranks at once, as in a save; slowest
rank per repeat), given as median [min-max] over the repeats and as a share of the median
``pyckpt-nocheck`` save. At world size 1 the check does not run (nothing to compare), but its
time is still measured.

    python benchmarks/bench_replicated.py --check-cost --repeats 5   # check cost only, 2 and 4 ranks

    python benchmarks/bench_replicated.py --size-gib 1 --worlds 1 2 4 --json replicated.json
    python benchmarks/bench_replicated.py --workload single --plan-counts   # saves only

On a machine whose ranks share one disk (and two cores), wall time is bounded by the disk
whatever the split, so bytes per rank is the primary figure; save time shows the split's effect
only where ranks write to separate disks or nodes.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pickle
import platform
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Literal

import torch
import torch.multiprocessing as mp

from pyckpt import tools

PLANNERS = ("pyckpt", "pyckpt-full", "pyckpt-nocheck", "dcp-default")
CHECK_PLANNERS = ("pyckpt", "pyckpt-full", "pyckpt-nocheck")
CHECK_MODES: tuple[Literal["sample", "full"], ...] = ("sample", "full")


def _planner(name: str) -> Any:
    import pyckpt

    if name == "pyckpt":
        return pyckpt.SavePlanner()  # the default check: sampled
    if name == "pyckpt-full":
        return pyckpt.SavePlanner(check_replicas="full")
    if name == "pyckpt-nocheck":
        return pyckpt.SavePlanner(check_replicas=False)
    return None  # DCP's DefaultSavePlanner


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def time_hashing(sd: dict[str, Any], repeats: int, barrier: Any = None) -> dict[str, list[float]]:
    """Seconds per repeat of the replica check's digests of every tensor of ``sd`` (what each
    rank does in SavePlanner.create_local_plan when every tensor is replicated), per mode
    (``check-sample``, ``check-full``); the modes alternate, ``barrier`` (if any) starts every
    rank's repeat together."""
    from pyckpt.planner import replica_digests

    tensors = _tensors(sd)
    times: dict[str, list[float]] = {f"check-{mode}": [] for mode in CHECK_MODES}
    for r in range(repeats):
        for mode in CHECK_MODES if r % 2 == 0 else CHECK_MODES[::-1]:
            if barrier is not None:
                barrier()
            start = time.perf_counter()
            replica_digests(tensors, mode=mode)
            times[f"check-{mode}"].append(time.perf_counter() - start)
    return times


def bytes_per_rank(path: str, world: int) -> list[int]:
    """Sizes of each rank's data files (``<rank>-<k>.<save_id>.pyckpt``), summed per rank."""
    by_rank = tools.bytes_per_rank(path)
    return [by_rank.get(r, 0) for r in range(world)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_state_dict(workload: str, size: int) -> dict[str, Any]:
    """The replicated state dict: ``llm`` (bf16 LLM-shaped, many tensors) or ``single`` (one
    fp32 tensor, DCP's worst case: the dedup gives it whole to one rank)."""
    from pyckpt import bench

    if workload == "llm":
        return bench.llm_state_dict(size, seed=0)
    g = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(size // 4, generator=g)}


def _alternating(planners: list[str], repeats: int) -> list[str]:
    """Save order: every planner once per repeat, the order reversed on odd repeats, so that
    neither planner always runs first (the second of two back-to-back saves is often slower)."""
    order: list[str] = []
    for r in range(repeats):
        order += planners if r % 2 == 0 else planners[::-1]
    return order


def _save_rank(
    rank: int,
    world: int,
    port: int,
    workload: str,
    size: int,
    root: str,
    planners: list[str],
    repeats: int,
    q: Any,
) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import pyckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
        )
        try:
            sd = make_state_dict(workload, size)  # identical on every rank
            times: dict[str, list[float]] = {name: [] for name in planners}
            times.update(time_hashing(sd, repeats, dist.barrier))
            for name in _alternating(planners, repeats):
                path = os.path.join(root, f"w{world}-{name}")
                planner = _planner(name)
                gc.collect()
                with pyckpt.Writer(path) as writer:
                    dist.barrier()
                    start = time.perf_counter()
                    dcp.save(sd, storage_writer=writer, planner=planner)
                    dist.barrier()
                    times[name].append(time.perf_counter() - start)
            q.put((rank, "ok", times))
        finally:
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        raise


def _single_process_save(
    workload: str, size: int, root: str, planners: list[str], repeats: int
) -> dict[str, list[float]]:
    import warnings

    import torch.distributed.checkpoint as dcp

    import pyckpt

    sd = make_state_dict(workload, size)
    times: dict[str, list[float]] = {name: [] for name in planners}
    times.update(time_hashing(sd, repeats))
    for name in _alternating(planners, repeats):
        path = os.path.join(root, f"w1-{name}")
        planner = _planner(name)
        gc.collect()
        with pyckpt.Writer(path) as writer, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            start = time.perf_counter()
            dcp.save(sd, storage_writer=writer, planner=planner)
            times[name].append(time.perf_counter() - start)
    return times


def run_saves(
    world: int, workload: str, size: int, root: str, planners: list[str], repeats: int
) -> dict[str, list[float]]:
    """Saves on ``world`` spawned gloo ranks; returns per planner the time of each repeat
    (slowest rank, barrier to barrier), and under ``"check-sample"`` / ``"check-full"`` the
    replica digest time of each repeat (slowest rank)."""
    if world == 1:
        return _single_process_save(workload, size, root, planners, repeats)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_save_rank, args=(r, world, port, workload, size, root, planners, repeats, q)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            try:
                rank, status, payload = q.get(timeout=1)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    raise RuntimeError("a rank died without reporting") from None
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return {
        name: [max(results[r][name][k] for r in range(world)) for k in range(repeats)]
        for name in [*planners, *(f"check-{mode}" for mode in CHECK_MODES)]
    }


# --------------------------------------------------------------------------- planning cost


def synthetic_local_plans(count: int, world: int) -> list[Any]:
    """Local plans of ``world`` ranks each holding the same ``count`` tensors (1-16 KiB each).

    Made by the planner's own local planning, then pickled and unpickled per rank as DCP's
    gather does, so the coordinator sees distinct objects per rank.
    """
    import pyckpt

    sd = {f"layers.{i}.p{i % 5}": torch.empty(16 * (1 + i % 8), 32) for i in range(count)}
    planner = pyckpt.SavePlanner()
    planner.set_up_planner(sd, is_coordinator=True)
    blob = pickle.dumps(planner.create_local_plan())
    return [pickle.loads(blob) for _ in range(world)]


def time_planning(count: int, world: int, repeats: int) -> dict[str, float]:
    """Median wall and CPU seconds of ``create_global_plan`` for both planners.

    The two planners alternate within each repeat. CPU time (``time.process_time``) is the
    steadier figure on a machine shared with other jobs; wall time includes being descheduled.
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    import pyckpt

    planners = (("pyckpt", pyckpt.SavePlanner), ("dcp-default", DefaultSavePlanner))
    wall: dict[str, list[float]] = {name: [] for name, _ in planners}
    cpu: dict[str, list[float]] = {name: [] for name, _ in planners}
    for r in range(repeats):
        for name, cls in planners if r % 2 == 0 else planners[::-1]:
            plans = synthetic_local_plans(count, world)
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            cls().create_global_plan(plans)
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    out = {}
    for name, _ in planners:
        out[name] = statistics.median(wall[name])
        out[f"{name}_cpu"] = statistics.median(cpu[name])
    return out


# ------------------------------------------------------------------------------------ main


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


def _spread(samples: list[float]) -> str:
    """``median [min-max]`` in seconds."""
    return f"{statistics.median(samples):.3f} [{min(samples):.3f}-{max(samples):.3f}]"


def check_read_bytes(sd: dict[str, Any]) -> dict[str, int]:
    """Bytes each rank's check reads per mode (``sample``: tensors up to a sample whole, at
    most one sample of larger ones)."""
    from pyckpt import _replicas

    sample = _replicas._SAMPLE_BLOCK_BYTES * _replicas._SAMPLE_BLOCKS
    sizes = [t.numel() * t.element_size() for t in _tensors(sd)]
    return {"off": 0, "sample": sum(min(n, sample) for n in sizes), "full": sum(sizes)}


def check_rows(
    world: int, times: dict[str, list[float]], read: dict[str, int]
) -> list[dict[str, Any]]:
    """The replica check's cost at one world size, per mode: its own time per rank and the
    save with it, against the save without it (``pyckpt-nocheck``)."""
    base = statistics.median(times["pyckpt-nocheck"])
    rows = []
    for mode, planner in (("off", "pyckpt-nocheck"), ("sample", "pyckpt"), ("full", "pyckpt-full")):
        check = times.get(f"check-{mode}", [0.0])
        save = times[planner]
        rows.append(
            {
                "world": world,
                "mode": mode,
                "check_s": statistics.median(check),
                "check_s_samples": check,
                "check_over_nocheck_save": statistics.median(check) / base,
                "save_s": statistics.median(save),
                "save_s_samples": save,
                "save_over_nocheck_save": statistics.median(save) / base,
                "read_bytes_per_rank": read[mode],
            }
        )
    return rows


def print_check_rows(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        check = "-" if row["mode"] == "off" else f"{_spread(row['check_s_samples'])} s"
        share = "-" if row["mode"] == "off" else f"{100 * row['check_over_nocheck_save']:.1f} %"
        print(
            f"{row['world']:>5} {row['mode']:<6} {check:>26} {share:>8}   "
            f"{_spread(row['save_s_samples'])} s  x{row['save_over_nocheck_save']:.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="state dict size per rank")
    parser.add_argument("--workload", choices=("llm", "single"), default="llm")
    parser.add_argument(
        "--repeats", type=int, default=3, help="saves per planner and world (order alternates)"
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: tmp)")
    parser.add_argument(
        "--plan-counts",
        type=int,
        nargs="*",
        default=[2500, 5000, 10000, 20000],
        help="tensor counts for the planning table (none: skip it)",
    )
    parser.add_argument("--plan-world", type=int, default=4)
    parser.add_argument("--plan-repeats", type=int, default=5)
    parser.add_argument("--skip-saves", action="store_true")
    parser.add_argument(
        "--check-cost",
        action="store_true",
        help="only the replica check's cost: worlds 2 and 4 (unless --worlds), planners "
        "pyckpt / pyckpt-full / pyckpt-nocheck, no planning table",
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    planners = list(PLANNERS)
    if args.check_cost:
        planners = list(CHECK_PLANNERS)
        if "--worlds" not in (argv if argv is not None else sys.argv[1:]):
            args.worlds = [2, 4]
        args.plan_counts = []

    size = int(args.size_gib * (1 << 30))
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "loadavg_at_start": os.getloadavg(),
        },
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "workload": args.workload,
        "size_bytes": size,
        "saves": [],
        "checks": [],
        "planning": [],
    }

    if not args.skip_saves:
        from pyckpt import bench

        total = bench.state_dict_bytes(make_state_dict(args.workload, size))
        report["state_dict_bytes"] = total
        print(
            f"replicated {args.workload} state dict: {_mib(total)} MiB on every rank; fsync on; "
            f"save time = median of {args.repeats} (order alternating)"
        )
        print(
            f"{'world':>5} {'planner':<14} {'save s':>7} {'GB/s':>6} {'max/mean':>8}  MiB per rank"
        )
        check_table: list[dict[str, Any]] = []
        read = check_read_bytes(make_state_dict(args.workload, size))
        base = tempfile.mkdtemp(prefix="pyckpt-bench-repl-", dir=args.dir)
        try:
            for world in args.worlds:
                root = os.path.join(base, f"w{world}")
                os.makedirs(root)
                times = run_saves(world, args.workload, size, root, planners, args.repeats)
                for name in planners:
                    per_rank = bytes_per_rank(os.path.join(root, f"w{world}-{name}"), world)
                    ratio = max(per_rank) / (sum(per_rank) / world)
                    median = statistics.median(times[name])
                    row = {
                        "world": world,
                        "planner": name,
                        "save_s": median,
                        "save_s_samples": times[name],
                        "gb_per_s": total / median / 1e9,
                        "bytes_per_rank": per_rank,
                        "max_over_mean": ratio,
                    }
                    report["saves"].append(row)
                    print(
                        f"{world:>5} {name:<14} {median:>7.2f} {row['gb_per_s']:>6.2f} "
                        f"{ratio:>8.3f}  {' '.join(_mib(b) for b in per_rank)}"
                    )
                rows = check_rows(world, times, read)
                report["checks"] += rows
                check_table += rows
                shutil.rmtree(root)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print(
            f"\nreplica check per rank (slowest rank; median [min-max] of {args.repeats}), share "
            "of the median pyckpt-nocheck save; save with that check, and its ratio to the "
            "pyckpt-nocheck save"
        )
        print(
            f"check reads per rank: sample {_mib(read['sample'])} MiB, full {_mib(read['full'])} MiB"
        )
        print(f"{'world':>5} {'mode':<6} {'check s':>26} {'share':>8}   save s")
        print_check_rows(check_table)

    if args.plan_counts:
        print_planning(args, report)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def print_planning(args: argparse.Namespace, report: dict[str, Any]) -> None:
    print(
        f"\nglobal planning, {args.plan_world} ranks, median of {args.plan_repeats} "
        "(create_global_plan on the coordinator)"
    )
    print(
        f"{'tensors':>8} {'pyckpt ms':>10} {'cpu ms':>8} {'cpu us/t':>8}"
        f" {'dcp ms':>8} {'cpu ms':>8} {'cpu us/t':>8}"
    )
    for count in args.plan_counts:
        t = time_planning(count, args.plan_world, args.plan_repeats)
        report["planning"].append({"tensors": count, "world": args.plan_world, **t})
        p, d = t["pyckpt"], t["dcp-default"]
        pc, dc = t["pyckpt_cpu"], t["dcp-default_cpu"]
        print(
            f"{count:>8} {p * 1e3:>10.1f} {pc * 1e3:>8.1f} {pc / count * 1e6:>8.1f}"
            f" {d * 1e3:>8.1f} {dc * 1e3:>8.1f} {dc / count * 1e6:>8.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
