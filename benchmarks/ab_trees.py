"""Same-run A/B of two pyckpt checkouts on the operations users run: save, load, export, S3,
and the CheckpointManager, on a GPT-2-small-shaped bf16 state dict (124 M parameters, 237 MiB).

Each checkout must hold its built extension (``pyckpt/_C*.so``; e.g. copied from a wheel built
from it). Rounds alternate A and B; each round is one fresh process per checkout that builds
the state dict, runs every workload once untimed and then ``--inner`` timed times, so a round's
figures are warm-process figures and both checkouts see the same machine drift. Reported: the
median and [min-max] over all rounds of each checkout, and B/A of the medians.

    python benchmarks/ab_trees.py --a ../pyckpt-old --b . --rounds 5
    python benchmarks/ab_trees.py --a ../pyckpt-old --b . --workloads save_zstd,load_zstd

The S3 workloads start a local SeaweedFS server (tests/_s3server.py, the ``weed`` binary on
PATH or in the places that module looks) and are skipped without one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

WORKLOADS = ("save_none", "save_zstd", "load_none", "load_zstd", "export", "s3_save",
             "s3_load", "manager_save", "manager_restore")
HERE = os.path.dirname(os.path.abspath(__file__))


def gpt2_small() -> dict[str, Any]:
    """The parameter shapes of GPT-2 small (12 layers, hidden 768, vocabulary 50257), bf16,
    values distributed like trained weights (normal, std 0.02)."""
    import torch

    g = torch.Generator().manual_seed(0)
    h, v, n = 768, 50257, 1024

    def p(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd: dict[str, Any] = {"wte.weight": p(v, h), "wpe.weight": p(n, h)}
    for i in range(12):
        b = f"h.{i}."
        sd.update({b + "ln_1.weight": p(h), b + "ln_1.bias": p(h),
                   b + "attn.c_attn.weight": p(h, 3 * h), b + "attn.c_attn.bias": p(3 * h),
                   b + "attn.c_proj.weight": p(h, h), b + "attn.c_proj.bias": p(h),
                   b + "ln_2.weight": p(h), b + "ln_2.bias": p(h),
                   b + "mlp.c_fc.weight": p(h, 4 * h), b + "mlp.c_fc.bias": p(4 * h),
                   b + "mlp.c_proj.weight": p(4 * h, h), b + "mlp.c_proj.bias": p(h)})
    sd.update({"ln_f.weight": p(h), "ln_f.bias": p(h)})
    return sd


def _zeros(sd: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: torch.zeros_like(t) for k, t in sd.items()}


def worker(workloads: list[str], work: str, inner: int, bucket: str | None) -> dict[str, list]:
    """Runs in a fresh process of one checkout: every workload once untimed, then timed."""
    import pyckpt

    sd = {"model": gpt2_small()}
    out: dict[str, list[float]] = {}

    def fresh(name: str) -> str:
        path = os.path.join(work, name)
        shutil.rmtree(path, ignore_errors=True)
        return path

    def run(name: str) -> None:
        if name.startswith("save_"):
            pyckpt.save(sd, fresh(name), compression=name.removeprefix("save_"))
        elif name.startswith("load_"):
            pyckpt.load({"model": _zeros(sd["model"])}, os.path.join(work, "src_" + name))
        elif name == "export":
            pyckpt.consolidate(os.path.join(work, "src_load_zstd"), fresh(name))
        elif name == "s3_save":
            pyckpt.save(sd, f"s3://{bucket}/ab", compression="zstd")
        elif name == "s3_load":
            pyckpt.load({"model": _zeros(sd["model"])}, f"s3://{bucket}/ab")
        elif name == "manager_save":
            mgr = pyckpt.CheckpointManager(fresh("durable"), local=fresh("fast"),
                                           replicas=0, persist_every=1)
            with mgr:
                for step in (1, 2):
                    mgr.save(step, sd, force=True)
                    mgr.wait()
        elif name == "manager_restore":
            with pyckpt.CheckpointManager(os.path.join(work, "durable"),
                                          local=os.path.join(work, "fast"), replicas=0) as mgr:
                assert mgr.restore({"model": _zeros(sd["model"])}) == 2

    for comp in ("none", "zstd"):  # the inputs of the load and export workloads
        pyckpt.save(sd, fresh(f"src_load_{comp}"), compression=comp)
    for name in workloads:
        if name == "manager_restore" and "manager_save" not in workloads:
            run("manager_save")
        if name.startswith("s3_") and bucket is None:
            continue
        if name == "s3_load" and "s3_save" not in workloads:
            run("s3_save")
        run(name)  # warm
        times = []
        for _ in range(inner):
            t0 = time.perf_counter()
            run(name)
            times.append(time.perf_counter() - t0)
        out[name] = times
    return out


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="checkout A (the baseline)")
    ap.add_argument("--b", required=True, help="checkout B")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner", type=int, default=2, help="timed runs per round and workload")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--work", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bucket", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    if args.worker:
        json.dump(worker(workloads, args.work, args.inner, args.bucket), sys.stdout)
        return 0

    server = None
    env = dict(os.environ)
    bucket = None
    if any(w.startswith("s3_") for w in workloads):
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        try:
            from _s3server import SeaweedServer, ServerUnavailable

            server = SeaweedServer()
            server.start()
            bucket = "pyckpt-ab"
            server.create_bucket(bucket)
            env.update(server.env())
        except (ImportError, ServerUnavailable) as e:
            print(f"S3 workloads skipped: {e}", file=sys.stderr)
            server = None
    work = args.work or tempfile.mkdtemp(prefix="pyckpt-ab-")
    trees = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    times: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
    try:
        for r in range(args.rounds):
            for tag, tree in trees.items():
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--a", "", "--b",
                       "", "--work", os.path.join(work, tag), "--inner", str(args.inner),
                       "--workloads", ",".join(workloads)]
                if bucket:
                    cmd += ["--bucket", bucket]
                os.makedirs(os.path.join(work, tag), exist_ok=True)
                res = subprocess.run(cmd, env={**env, "PYTHONPATH": tree}, cwd=tree,
                                     capture_output=True, text=True, check=False)
                if res.returncode:
                    print(res.stderr, file=sys.stderr)
                    return 1
                for name, xs in json.loads(res.stdout).items():
                    times[tag].setdefault(name, []).extend(xs)
                print(f"round {r + 1}/{args.rounds} {tag} done", file=sys.stderr)
    finally:
        if server is not None:
            server.close()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"A = {args.a}\nB = {args.b}\n{args.rounds} rounds x {args.inner} timed runs "
          f"(seconds, median [min-max]; B/A of the medians)\n")
    print("| workload | A | B | B/A |\n|---|---|---|---|")
    for name in workloads:
        a, b = times["A"].get(name), times["B"].get(name)
        if not a or not b:
            continue
        print(f"| {name} | {_fmt(a)} | {_fmt(b)} | "
              f"{statistics.median(b) / statistics.median(a):.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(times, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
