"""The demo's export on its ranks, phase by phase: where a small multi-rank export's time goes.

Usage:
    python benchmarks/export_ranks.py [--scales 1,2,4,8] [--repeats 15] [--dir DIR] [--json F]
                                      [--layers L] [--hidden H] [--input warm|after-save]

For each scale, 2 gloo ranks on this machine (as in ``examples/train.py``) build the demo's
Llama model (``LlamaForCausalLM``: vocab 4096 x scale, hidden 256, 4 x scale layers, fp32;
scale 1 is the demo's 19 MiB; ``--layers`` and ``--hidden`` set the depth and width instead,
e.g. ``--layers 400 --hidden 64`` for a model of 3,603 small tensors, the tensor count of a
deep model at a size this machine exports in a fraction of a second), shard it with FSDP2
(``fully_shard``), and save its model
state dict three times: pyckpt checkpoints with and without zstd and DCP
``HuggingFaceStorageWriter`` shards. Then, alternating, the same number of runs each:

* ``pyckpt zstd``: ``pyckpt.consolidate`` on both ranks from the zstd pyckpt checkpoint (every
  chunk verified and decoded);
* ``pyckpt raw``: the same from the uncompressed one (every chunk verified);
* ``pyckpt shards``: the same from the DCP shards, torch's own input;
* ``torch``: ``consolidate_safetensors_files`` in rank 0 from the DCP shards (it has no
  multi-rank mode), the other rank waiting in a barrier. Two times: rank 0's call alone, and
  the step as a job sees it, up to the barrier after the call (what a 2-rank job runs, so that
  no rank moves on before the export exists; a pyckpt run's time likewise ends when its
  slowest rank has heard the commit);
* ``torch nogc``: the same with Python's cyclic collector paused around it. With thousands of
  tensors ``torch`` often pays for a full collection that the runs before it left due (pyckpt
  pauses the collector during its calls); ``torch nogc`` is torch's own cost. The ratios use the
  faster of the two medians.

Each run starts as the demo's do: previous output removed, ``sync()``, its input read once
(page cache), a barrier; no fsync on either side. With ``--input after-save``, each run starts
instead as a job's export right after its save does: the pyckpt checkpoints' files dropped from
the page cache (pyckpt saves with O_DIRECT, which leaves none there), the DCP shards read once
(DCP writes through the page cache). A pyckpt run's time is its slowest rank's.
Printed: medians [min-max] of the runs, torch / pyckpt from torch's call alone, the same from
torch's step up to its barrier, and per rank the medians of ``ConsolidationResult.phases``
(plan, copy, wait, commit) of the pyckpt runs.
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
from contextlib import nullcontext
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
METHODS = ("pyckpt zstd", "pyckpt raw", "pyckpt shards", "torch", "torch nogc")
TORCH = ("torch", "torch nogc")


def _model_state(scale: int, layers: int | None = None, hidden: int | None = None) -> Any:
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    width = hidden or 256
    config = LlamaConfig(vocab_size=4096 * scale, hidden_size=width,
                         intermediate_size=width * 688 // 256,
                         num_hidden_layers=layers or 4 * scale, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return get_model_state_dict(model)


def _same_export(files: list[str], torch_dir: str, what: str) -> None:
    """Raises SystemExit unless the safetensors ``files`` hold exactly the tensors of torch's
    export in ``torch_dir``, bit for bit."""
    import torch
    from safetensors.torch import load_file

    ours: dict[str, Any] = {}
    for f in files:
        ours.update(load_file(f))
    theirs: dict[str, Any] = {}
    for name in sorted(os.listdir(torch_dir)):
        if name.endswith(".safetensors"):
            theirs.update(load_file(os.path.join(torch_dir, name)))
    if ours.keys() != theirs.keys() or not all(torch.equal(ours[k], theirs[k]) for k in ours):
        raise SystemExit(f"{what}: the export differs from torch's")


def _rank_main(spec_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from _consolidate_data import drop, warm
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    import pyckpt
    from pyckpt import _gc

    with open(spec_path) as f:
        spec = json.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work, repeats = spec["work"], spec["repeats"]
    results: dict[str, Any] = {}
    for scale in spec["scales"]:
        root = os.path.join(work, f"scale-{scale}")
        src, raw, shards, out = (os.path.join(root, d) for d in ("zstd", "raw", "shards", "out"))
        msd = _model_state(scale, spec.get("layers"), spec.get("hidden"))
        with pyckpt.Writer(src, compression="zstd") as w:
            dcp.save(msd, storage_writer=w)
        with pyckpt.Writer(raw) as w:
            dcp.save(msd, storage_writer=w)
        dcp.save(msd, storage_writer=HuggingFaceStorageWriter(shards, save_distributed=True))
        names = list(msd)
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        jobs: dict[str, list[float]] = {m: [] for m in TORCH}  # up to the barrier after
        inputs = {"pyckpt zstd": src, "pyckpt raw": raw, "pyckpt shards": shards,
                  "torch": shards, "torch nogc": shards}
        phases: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS if m not in TORCH}
        total = 0

        def slowest(seconds: float) -> float:
            t = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t)

        for i in range(repeats + 1):  # the first round warms the processes up, untimed
            k = i % len(METHODS)
            order = list(METHODS[k:] + METHODS[:k])
            for method in order:
                if rank == 0:
                    shutil.rmtree(out, ignore_errors=True)
                    os.sync()
                    if spec.get("input") == "after-save" and method in ("pyckpt zstd",
                                                                        "pyckpt raw"):
                        drop(inputs[method])
                    else:
                        warm(inputs[method])
                dist.barrier()
                if method in TORCH:
                    seconds = 0.0
                    t0 = time.perf_counter()
                    if rank == 0:
                        # "torch nogc": its own time, without the collections that what ran
                        # before it in this process left due (pyckpt pauses the collector).
                        quiet = _gc.paused() if method == "torch nogc" else nullcontext()
                        with quiet:
                            os.makedirs(out)
                            consolidate_safetensors_files(shards, out, dict.fromkeys(names, 1))
                        seconds = time.perf_counter() - t0
                    dist.barrier()
                    job = slowest(time.perf_counter() - t0)
                    if i:
                        jobs[method].append(job)
                else:
                    t0 = time.perf_counter()
                    res = pyckpt.consolidate(inputs[method], out, fsync=False)
                    seconds = time.perf_counter() - t0
                    total = res.total_bytes
                    if i:
                        phases[method].append(res.phases)
                seconds = slowest(seconds)
                if i:
                    times[method].append(seconds)
        # Untimed: every pyckpt export must equal torch's, tensor for tensor, bit for bit.
        theirs = os.path.join(root, "check-torch")
        if rank == 0:
            os.makedirs(theirs)
            consolidate_safetensors_files(shards, theirs, dict.fromkeys(names, 1))
        dist.barrier()
        for method in phases:
            mine = os.path.join(root, "check-" + method.split()[1])
            res = pyckpt.consolidate(inputs[method], mine, fsync=False)
            if rank == 0:
                _same_export(res.files, theirs, method)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, phases)
        results[str(scale)] = {"bytes": total, "tensors": len(names), "times": times,
                               "jobs": jobs, "phases": gathered}
        dist.barrier()
    if rank == 0:
        with open(spec["result"], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _med(values: list[float]) -> str:
    v = sorted(values)
    return f"{statistics.median(v) * 1e3:.2f} [{v[0] * 1e3:.2f}-{v[-1] * 1e3:.2f}]"


def report(results: dict[str, Any]) -> str:
    ours = [m for m in METHODS if m not in TORCH]
    lines = ["torch / X: torch's faster median of the two (with and without the collector).", "",
             "| MiB (tensors) | " + " | ".join(f"{m} ms" for m in METHODS) + " | "
             + " | ".join(f"torch / {m.split()[1]}" for m in ours) + " |",
             "|---:|" + "---|" * len(METHODS) + "---:|" * len(ours)]
    for r in results.values():
        t = r["times"]
        med = {m: statistics.median(t[m]) for m in METHODS}
        theirs = min(med[m] for m in TORCH)
        lines.append(f"| {r['bytes'] / 2**20:.0f} ({r.get('tensors', '?')}) | "
                     + " | ".join(_med(t[m]) for m in METHODS)
                     + " | " + " | ".join(f"{theirs / med[m]:.2f}x" for m in ours) + " |")
    lines += ["", "torch's step as the job sees it: its call, then the barrier that tells the "
              "other rank (torch's faster median of the two again):", "",
              "| MiB | torch + barrier ms | torch nogc + barrier ms | "
              + " | ".join(f"torch + barrier / {m.split()[1]}" for m in ours) + " |",
              "|---:|---|---|" + "---:|" * len(ours)]
    for r in results.values():
        jobs = r.get("jobs")
        if not jobs:
            continue
        t = r["times"]
        theirs = min(statistics.median(jobs[m]) for m in TORCH)
        lines.append(f"| {r['bytes'] / 2**20:.0f} | " + " | ".join(_med(jobs[m]) for m in TORCH)
                     + " | " + " | ".join(f"{theirs / statistics.median(t[m]):.2f}x"
                                          for m in ours) + " |")
    lines += ["", "Phases of the pyckpt runs, ms, medians per rank (plan / copy / wait / commit):",
              ""]
    for r in results.values():
        for method in ours:
            cells = []
            for rank, per_rank in enumerate(r["phases"]):
                runs = per_rank[method]
                cells.append(f"rank {rank}: " + " / ".join(
                    f"{statistics.median(p[k] for p in runs) * 1e3:.2f}"
                    for k in ("plan", "copy", "wait", "commit")))
            lines.append(f"- {r['bytes'] / 2**20:.0f} MiB, {method}: " + "; ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scales", default="1", help="comma-separated model scales (1: 19 MiB)")
    ap.add_argument("--repeats", type=int, default=15, help="timed runs of each method")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: 4 x scale); 9 tensors each")
    ap.add_argument("--hidden", type=int, default=None,
                    help="hidden size (default 256; the MLP is 688/256 of it)")
    ap.add_argument("--input", choices=("warm", "after-save"), default="warm",
                    help="warm: every input read once before each run; after-save: pyckpt's "
                         "checkpoints out of the page cache, as its O_DIRECT save leaves them")
    ap.add_argument("--rank-main", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_main:
        _rank_main(args.rank_main)
        return 0
    scales = [int(s) for s in args.scales.split(",")]
    sys.path.insert(0, HERE)
    from _ranks import run_ranks

    work = tempfile.mkdtemp(prefix="pyckpt-export-ranks-", dir=args.dir)
    try:
        spec = {"work": work, "result": os.path.join(work, "result.json"), "scales": scales,
                "repeats": args.repeats, "layers": args.layers, "hidden": args.hidden,
                "input": args.input}
        results = run_ranks(__file__, spec, WORLD, WORLD, timeout=600 + 120 * sum(scales),
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
