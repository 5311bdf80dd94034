"""accelerator.save_state through pyckpt (pyckpt.integrations.accelerate) vs accelerate's own.

One process, one Accelerator (CPU; accelerate 1.15 builds FSDP only on GPUs, so this is the
non-FSDP path: ``model.safetensors`` + ``optimizer.bin`` against one pyckpt checkpoint), a
trained MLP with AdamW moments. Each repeat saves once with each method (same run, alternating)
and reports the blocking time of ``save_state`` (fsync included for both: pyckpt fsyncs by
default, and accelerate's files are fsynced after its save returns, counted in its time) and
the bytes on disk of the folder, as median [min-max].

    python benchmarks/integration_accelerate.py                    # ~8M params, 5 repeats
    python benchmarks/integration_accelerate.py --hidden 2048 --layers 12 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _fsync_tree(path: str) -> None:
    for d, _, fs in os.walk(path):
        for f in fs:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _stats(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compression", default="zstd", help="pyckpt's (zstd or none)")
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)

    import torch
    from accelerate import Accelerator

    from pyckpt.integrations import accelerate as integ

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    for _ in range(2):  # moments exist and weights are no longer their init
        loss = model(torch.randn(8, args.hidden)).square().mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    params = sum(p.numel() for p in model.parameters())

    work = tempfile.mkdtemp(prefix="bench-accelerate-", dir=args.work)
    times: dict[str, list[float]] = {"pyckpt": [], "accelerate": []}
    sizes: dict[str, list[float]] = {"pyckpt": [], "accelerate": []}
    handle = None
    try:
        for r in range(args.repeats):
            for method in ("pyckpt", "accelerate"):
                path = os.path.join(work, f"{method}-{r}")
                if method == "pyckpt":
                    handle = integ.install(acc, compression=args.compression)
                start = time.perf_counter()
                acc.save_state(path)
                if method == "accelerate":
                    _fsync_tree(path)
                times[method].append(time.perf_counter() - start)
                if handle is not None:
                    handle.uninstall()
                    handle = None
                sizes[method].append(float(_du(path)))
                shutil.rmtree(path)
    finally:
        if handle is not None:
            handle.uninstall()
        shutil.rmtree(work, ignore_errors=True)

    report = {"params": params, "repeats": args.repeats, "compression": args.compression,
              "save_blocking_s": {m: _stats(v) for m, v in times.items()},
              "bytes_on_disk": {m: _stats(v) for m, v in sizes.items()}}
    print(f"accelerator.save_state, {params / 1e6:.1f}M params + AdamW, CPU, "
          f"{args.repeats} repeats (median [min-max])")
    print("| method | save blocking, s | bytes on disk, MiB |")
    print("|---|---|---|")
    for m in times:
        t, s = report["save_blocking_s"][m], report["bytes_on_disk"][m]
        print(f"| {m} | {t['median']:.3f} [{t['min']:.3f}-{t['max']:.3f}] | "
              f"{s['median'] / 2**20:.1f} [{s['min'] / 2**20:.1f}-{s['max'] / 2**20:.1f}] |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
