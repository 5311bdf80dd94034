"""The tail of a small multi-rank export: from the end of the last rank's copy to the return.

Usage:
    python benchmarks/export_tail.py [--scale 1] [--repeats 100] [--dir DIR]

2 gloo ranks on this machine (as in ``examples/train.py``) save the demo's Llama model
(``benchmarks/export_ranks.py``'s model; scale 1 is the demo's 19 MiB) as a zstd pyckpt
checkpoint, then export it ``--repeats`` times with ``pyckpt.consolidate`` on both ranks, each
run from the demo's start (previous output removed, ``sync()``, the input read once, a
barrier; the last export is checked against the saved tensors, bit for bit). Every rank
records, on the machine's monotonic clock, when its call began, when its
copy ended (``ConsolidationResult.phases``: plan + copy) and when the call returned.

Printed, medians [min-max] over the runs after the first three: the slowest rank's total, the
time to the last rank's copy end, and the tail, from that copy end to the last return: what
the ranks spend agreeing that every share is in, committing and hearing the commit. The tail
is the part of a small export that depends on how the ranks talk (BENCHMARKS.md, "The rounds
after the copies").
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
WORLD = 2
WARMUP = 3


def _rank_main(spec_path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import pyckpt

    sys.path.insert(0, HERE)
    from export_ranks import _model_state

    with open(spec_path) as f:
        spec = json.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    src, out = os.path.join(spec["work"], "zstd"), os.path.join(spec["work"], "out")
    msd = _model_state(spec["scale"])
    with pyckpt.Writer(src, compression="zstd") as w:
        dcp.save(msd, storage_writer=w)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in msd.items()}
    rows = []
    for _ in range(spec["repeats"]):
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            for name in sorted(os.listdir(src)):
                with open(os.path.join(src, name), "rb") as fh:
                    fh.read()
        dist.barrier()
        t0 = time.monotonic()
        res = pyckpt.consolidate(src, out, fsync=False)
        t1 = time.monotonic()
        rows.append((t0, t0 + res.phases["plan"] + res.phases["copy"], t1))
    every: list[Any] = [None] * WORLD
    dist.all_gather_object(every, rows)
    if rank == 0:  # the last export holds the saved tensors, bit for bit
        from safetensors.torch import load_file

        got: dict[str, Any] = {}
        for path in res.files:
            got.update(load_file(path))
        if got.keys() != full.keys() or not all(got[k].equal(full[k]) for k in full):
            raise SystemExit("the export differs from the saved state dict")
        with open(spec["result"], "w") as f:
            json.dump({"rows": every, "bytes": res.total_bytes}, f)
    dist.barrier()  # rank 1 leaves with rank 0, not while rank 0 still checks the export
    dist.destroy_process_group()


def report(result: dict[str, Any]) -> str:
    runs = list(zip(*result["rows"]))[WARMUP:]  # per run: one (start, copy end, return) per rank
    total = [max(r[2] for r in run) - min(r[0] for r in run) for run in runs]
    copies = [max(r[1] for r in run) - min(r[0] for r in run) for run in runs]
    tail = [max(r[2] for r in run) - max(r[1] for r in run) for run in runs]

    def med(values: list[float]) -> str:
        v = sorted(values)
        return f"{statistics.median(v) * 1e3:.2f} [{v[0] * 1e3:.2f}-{v[-1] * 1e3:.2f}] ms"

    return (f"{result['bytes'] / 2**20:.0f} MiB from zstd on {WORLD} ranks, {len(runs)} runs:\n"
            f"  total (slowest rank)       {med(total)}\n"
            f"  to the last copy's end     {med(copies)}\n"
            f"  last copy's end -> return  {med(tail)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=int, default=1, help="model scale (1: 19 MiB)")
    ap.add_argument("--repeats", type=int, default=100, help="exports, the first 3 untimed")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--rank-main", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_main:
        _rank_main(args.rank_main)
        return 0
    if args.repeats <= WARMUP:
        ap.error(f"--repeats must be more than {WARMUP}")
    sys.path.insert(0, HERE)
    from _ranks import run_ranks

    work = tempfile.mkdtemp(prefix="pyckpt-export-tail-", dir=args.dir)
    try:
        spec = {"work": work, "result": os.path.join(work, "result.json"), "scale": args.scale,
                "repeats": args.repeats}
        result = run_ranks(__file__, spec, WORLD, WORLD, timeout=300 + args.repeats,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
