"""The cost of a background save to the training that goes on (CPU, gloo, DDP).

``--world`` ranks (processes, gloo) train a transformer-like MLP stack (pre-LayerNorm residual
blocks ``d -> 4d -> d`` with GELU; forward, backward, DDP all-reduce, AdamW) on CPU. Each round
runs ``--steps`` training steps in each mode, the modes in turn:

- ``none``: no save in flight (the baseline);
- ``async_save/t<N>``: ``dcp.async_save`` of the model + optimizer state through
  ``pyckpt.Writer(threads=N)``;
- ``async_process/t<N>`` (with ``--modes``): the same with DCP's process-based executor (the
  encode and write run in a process of their own; DCP starts it at a first, untimed save);
- ``manager/t<N>``: a ``pyckpt.CheckpointManager`` fast-tier save (node-local directory, one
  replica on the other "node", ``writer_options={"threads": N}``).

In a save mode a save is in flight for as long as possible: one starts at the phase's first
step, and the next one as soon as the previous one completed on every rank (the ranks agree on
that with one tiny all-reduce per step, done in every mode, the baseline included). A step's
time is that of its forward, backward and optimizer step (the slowest rank's); the time a save
held the caller (its staging copy) is reported apart, as "blocking". Steps that started while a
save was in flight make the distribution of a save mode.

Reported per mode: step time median, p90 and min-max, the slowdown of the median against
``none`` (the issue's target is <= 5%; on a machine whose cores the ranks already use, the
save's encode threads compete with the training for them), the save's blocking time and how
many saves completed. ``--writer-threads`` picks N (the ``threads`` of ``pyckpt.Writer``, the
knob of pyckpt's native worker pool).

    python benchmarks/bench_train_overlap.py                          # ~100 ms steps, 2 ranks
    python benchmarks/bench_train_overlap.py --writer-threads 1,2 --steps 40 --repeats 3 --json o.json
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


# ----------------------------------------------------------------------------- rank side


def _model(dim: int, layers: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, 4 * dim)
            self.down = nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    return nn.Sequential(*[Block() for _ in range(layers)], nn.LayerNorm(dim),
                         nn.Linear(dim, dim))


def _rank_main(spec_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel

    import pyckpt

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["torch_threads"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(_model(spec["dim"], spec["layers"]))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(spec["batch"], spec["seq"], spec["dim"], generator=g)
    y = torch.randn(spec["batch"], spec["seq"], spec["dim"], generator=g)
    work = spec["work"]
    node_dir = os.path.join(work, f"node{rank}")

    def train_step() -> float:
        t0 = time.perf_counter()
        optim.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        return time.perf_counter() - t0

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, optim)
        return {"model": msd, "optim": osd}

    for _ in range(spec["warmup"]):
        train_step()
    state_bytes = sum(t.numel() * t.element_size() for t in
                      torch.utils._pytree.tree_flatten(state())[0] if isinstance(t, torch.Tensor))
    pyckpt.reserve_pinned(state())  # staging memory made once, before the first timed save
    # The background save's collectives run on a group of their own (as the manager's do):
    # on the training's group they would interleave with DDP's all-reduces.
    save_group = dist.new_group(backend="gloo")

    def run_phase(mode: str, threads: int | None, tag: str) -> dict[str, Any]:
        saves: list[Any] = []  # futures
        blocking: list[float] = []
        steps: list[tuple[float, bool]] = []
        counter = [0]
        mgr = writer = None
        if mode in ("async_save", "async_process"):  # one Writer per phase (its thread pool reused), as the manager
            writer = pyckpt.Writer(os.path.join(node_dir, tag), spec["compression"],
                                   threads=threads, shared_filesystem=False)
        if mode == "manager":
            mgr = pyckpt.CheckpointManager(
                os.path.join(work, "durable", tag), local=os.path.join(node_dir, tag),
                node=str(rank), replicas=1 if world > 1 else 0, save_every=1,
                persist_every=1 << 40, keep_local=1, compression=spec["compression"],
                writer_options={"threads": threads})

        def start_save() -> None:
            counter[0] += 1
            sd = state()
            t0 = time.perf_counter()
            if mode in ("async_save", "async_process"):
                assert writer is not None
                extra: dict[str, Any] = {}
                if mode == "async_process":
                    from torch.distributed.checkpoint.state_dict_saver import (
                        AsyncCheckpointerType,
                    )

                    extra["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
                else:
                    extra["process_group"] = save_group
                fut = dcp.async_save(sd, storage_writer=writer,
                                     checkpoint_id=os.path.join(node_dir, tag,
                                                                f"s{counter[0] % 2}"),
                                     planner=pyckpt.SavePlanner(), **extra)
            else:
                assert mgr is not None
                fut = mgr.save(counter[0], sd)
            blocking.append(time.perf_counter() - t0)
            saves.append(fut)

        if mode == "async_process":  # DCP starts its save process at the first save: not timed
            start_save()
            saves.pop().result()
            blocking.clear()
        flag = torch.zeros(1)
        dist.barrier()
        for i in range(spec["steps"]):
            idle = 1.0 if not saves or saves[-1].done() else 0.0
            flag.fill_(idle)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank: no save in flight
            if mode != "none" and flag.item() == 1.0 and i < spec["steps"] - 1:
                start_save()
            in_flight = mode != "none" and bool(saves) and not saves[-1].done()
            steps.append((train_step(), in_flight))
        for fut in saves:
            fut.result()
        if mgr is not None:
            mgr.close()
        if writer is not None:
            writer.close()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(work, "durable", tag), ignore_errors=True)
        shutil.rmtree(os.path.join(node_dir, tag), ignore_errors=True)
        return {"steps": steps, "blocking": blocking, "saves": len(saves)}

    rounds: list[dict[str, Any]] = []
    for rep in range(spec["repeats"]):
        for mode in spec["modes"]:
            kind, threads = mode["kind"], mode["threads"]
            res = run_phase(kind, threads, f"{mode['name'].replace('/', '-')}-r{rep}")
            res.update(mode=mode["name"], repeat=rep)
            rounds.append(res)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rounds)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        with open(spec["result"], "w") as f:
            json.dump({"ranks": gathered, "params": params, "state_bytes": state_bytes}, f)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver side


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(raw: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Per mode: the slowest rank's step times (pooled over rounds; in save modes the steps
    that ran with a save in flight), their median, p90 and min-max, the slowdown against
    ``none``, and the saves' blocking times."""
    per_rank = raw["ranks"]
    modes: dict[str, Any] = {}
    for m in spec["modes"]:
        name = m["name"]
        times: list[float] = []
        blocking: list[float] = []
        saves = 0
        for i, rnd in enumerate(per_rank[0]):
            if rnd["mode"] != name:
                continue
            rows = [rank[i]["steps"] for rank in per_rank]
            for k in range(len(rows[0])):
                slowest = max(r[k][0] for r in rows)
                if name == "none" or any(r[k][1] for r in rows):
                    times.append(slowest)
            blk = [rank[i]["blocking"] for rank in per_rank]
            blocking += [max(b[k] for b in blk) for k in range(len(blk[0]))]
            saves += rnd["saves"]
        if not times:
            raise SystemExit(f"mode {name}: no step ran with a save in flight")
        modes[name] = {
            "step_s": {"median": statistics.median(times), "p90": _pct(times, 0.9),
                       "min": min(times), "max": max(times), "n": len(times)},
            "blocking_s": ({"median": statistics.median(blocking), "min": min(blocking),
                            "max": max(blocking)} if blocking else None),
            "saves": saves,
        }
    base = modes["none"]["step_s"]["median"]
    for row in modes.values():
        row["slowdown"] = row["step_s"]["median"] / base - 1.0
    return {"world": spec["world"], "dim": spec["dim"], "layers": spec["layers"],
            "batch": spec["batch"], "seq": spec["seq"], "torch_threads": spec["torch_threads"],
            "compression": spec["compression"], "steps_per_phase": spec["steps"],
            "repeats": spec["repeats"], "params": raw["params"],
            "state_bytes_per_rank": raw["state_bytes"], "cpus": os.cpu_count(),
            "modes": modes}


def markdown(report: dict[str, Any]) -> str:
    lines = ["| mode | steps | step median ms | p90 ms | min-max ms | slowdown vs none | "
             "save blocking median ms (min-max) | saves |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in report["modes"].items():
        s, b = row["step_s"], row["blocking_s"]
        blk = "-" if b is None else \
            f"{b['median'] * 1e3:.1f} ({b['min'] * 1e3:.1f}-{b['max'] * 1e3:.1f})"
        lines.append(f"| {name} | {s['n']} | {s['median'] * 1e3:.1f} | {s['p90'] * 1e3:.1f} | "
                     f"{s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f} | {row['slowdown'] * 100:+.1f}% "
                     f"| {blk} | {row['saves']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=30, help="training steps per mode and round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="rounds (the modes take turns)")
    p.add_argument("--writer-threads", default="1,2",
                   help="comma-separated native thread counts of the save (Writer threads)")
    p.add_argument("--modes", default="async_save,manager",
                   help="save modes to measure besides 'none': async_save, async_process, "
                        "manager")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads per rank (default: cpus // world, at least 1)")
    p.add_argument("--compression", default="zstd", choices=["zstd", "none"])
    p.add_argument("--work", default=None, help="work directory (default: under /dev/shm)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--rank-main", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        _rank_main(args.rank_main)
        return 0
    threads = [int(t) for t in args.writer_threads.split(",") if t.strip()]
    kinds = [k.strip() for k in args.modes.split(",") if k.strip()]
    if any(k not in ("async_save", "async_process", "manager") for k in kinds) or not threads or \
            any(t < 1 for t in threads) or args.steps < 2 or args.world < 1:
        p.error("--modes: async_save and/or manager; --writer-threads >= 1; --steps >= 2")
    modes = [{"name": "none", "kind": "none", "threads": None}]
    modes += [{"name": f"{k}/t{t}", "kind": k, "threads": t} for k in kinds for t in threads]
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = tempfile.mkdtemp(prefix="pyckpt-overlap-", dir=args.work or base)

    spec = {"work": work, "world": args.world, "dim": args.dim, "layers": args.layers,
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "repeats": args.repeats, "modes": modes,
            "torch_threads": args.torch_threads or max(1, (os.cpu_count() or 1) // args.world),
            "compression": None if args.compression == "none" else args.compression,
            "result": os.path.join(work, "result.json")}
    from _ranks import run_ranks

    try:
        # One "node": every rank shares the machine (LOCAL_WORLD_SIZE = world).
        raw = run_ranks(__file__, spec, args.world, args.world, args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = summarize(raw, spec)
    print(f"training with a save in flight: {args.world} ranks (gloo, DDP), "
          f"{report['params'] / 1e6:.1f} M params, state {report['state_bytes_per_rank'] / 2**20:.0f}"
          f" MiB per rank, {spec['torch_threads']} torch threads per rank on {os.cpu_count()} "
          f"cpus, {args.steps} steps x {args.repeats} rounds per mode")
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
