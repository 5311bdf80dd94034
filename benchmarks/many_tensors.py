"""Save, load and export of a state dict of many small tensors, in one process.

Usage:
    python benchmarks/many_tensors.py [--tensors 4000] [--shape 64,64] [--repeats 15]
                                      [--live 0] [--collector-always-on] [--dir DIR]

What a deep model (hundreds of layers) or a checkpoint with optimizer state looks like to the
per-tensor code paths: ``--tensors`` fp32 tensors of ``--shape`` (default 4,000 of 16 KiB,
62.5 MiB). Alternating, ``--repeats`` timed runs of each (after one untimed round):

* ``pyckpt.save`` (zstd) and ``dcp.save`` with DCP's ``FileSystemWriter`` (each into a new
  directory, the previous one removed and ``sync()`` first);
* ``pyckpt.load`` and ``dcp.load`` with ``FileSystemReader`` (into the same state dict);
* ``pyckpt.consolidate`` from the zstd pyckpt checkpoint and from DCP ``HuggingFaceStorageWriter``
  shards, and torch's ``consolidate_safetensors_files`` from those shards, each as it runs and
  with Python's cyclic collector paused around it (torch's own time without collections).

``--live N`` keeps N more small Python objects alive (a training process's heap: every full
collection walks them). ``--collector-always-on`` replaces ``pyckpt._gc.paused`` with a no-op,
i.e. pyckpt as it was before it paused the collector (for an A/B in one run, use it in a second
run). Every load is checked bit for bit, every export against torch's. Prints medians
[min-max] in ms.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

METHODS = ("pyckpt save", "dcp save", "pyckpt load", "dcp load", "pyckpt export zstd",
           "pyckpt export shards", "torch export", "torch export, collector paused")


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(tensors: int, shape: tuple[int, ...], repeats: int, live: int, always_on: bool,
        work: str) -> dict[str, list[float]]:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    import pyckpt
    from pyckpt import _gc

    heap = [{"i": [i]} for i in range(live)]  # noqa: F841  (kept alive on purpose)
    paused = _gc.paused
    if always_on:
        _gc.paused = contextlib.nullcontext  # type: ignore[assignment]
    g = torch.Generator().manual_seed(0)
    sd = {f"model.layers.{i}.w": torch.randn(*shape, generator=g) for i in range(tensors)}
    into = {k: torch.empty_like(v) for k, v in sd.items()}
    src, shards = os.path.join(work, "pyckpt"), os.path.join(work, "shards")
    pyckpt.save(sd, src, compression="zstd")
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(shards, save_distributed=True))
    dcp_dir = os.path.join(work, "dcp")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(dcp_dir))
    out = os.path.join(work, "out")
    fqns = dict.fromkeys(sd, 1)

    def torch_export() -> None:
        os.makedirs(out)
        consolidate_safetensors_files(shards, out, fqns)

    def torch_export_paused() -> None:
        with paused():
            torch_export()

    steps: dict[str, Callable[[], Any]] = {
        "pyckpt save": lambda: pyckpt.save(sd, out, compression="zstd"),
        "dcp save": lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(out)),
        "pyckpt load": lambda: pyckpt.load(into, src),
        "dcp load": lambda: dcp.load(into, storage_reader=dcp.FileSystemReader(dcp_dir)),
        "pyckpt export zstd": lambda: pyckpt.consolidate(src, out, fsync=False),
        "pyckpt export shards": lambda: pyckpt.consolidate(shards, out, fsync=False),
        "torch export": torch_export,
        "torch export, collector paused": torch_export_paused,
    }
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for i in range(repeats + 1):  # the first round warms the process up, untimed
        k = i % len(METHODS)
        for method in METHODS[k:] + METHODS[:k]:
            shutil.rmtree(out, ignore_errors=True)
            for t in into.values():
                t.zero_()
            os.sync()
            t0 = time.perf_counter()
            steps[method]()
            seconds = time.perf_counter() - t0
            if i:
                times[method].append(seconds)
            if method.endswith("load") and not _same(into, sd):
                raise SystemExit(f"{method}: the loaded state differs from the saved one")
            if method.startswith("pyckpt export"):
                exported: dict[str, Any] = {}
                for name in sorted(os.listdir(out)):
                    if name.endswith(".safetensors"):
                        exported.update(load_file(os.path.join(out, name)))
                if not _same(exported, sd):
                    raise SystemExit(f"{method}: the export differs from the state dict")
    _gc.paused = paused  # type: ignore[assignment]
    return times


def report(times: dict[str, list[float]], tensors: int, nbytes: int) -> str:
    lines = [f"{tensors} tensors, {nbytes / 2**20:.1f} MiB; ms, median [min-max] of "
             f"{len(next(iter(times.values())))}", ""]
    for method, values in times.items():
        v = sorted(values)
        lines.append(f"{method:32s} {statistics.median(v) * 1e3:8.1f} "
                     f"[{v[0] * 1e3:.1f}-{v[-1] * 1e3:.1f}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=4000, help="number of tensors")
    ap.add_argument("--shape", default="64,64", help="shape of each fp32 tensor")
    ap.add_argument("--repeats", type=int, default=15, help="timed runs of each method")
    ap.add_argument("--live", type=int, default=0,
                    help="extra small Python objects kept alive (a training process's heap)")
    ap.add_argument("--collector-always-on", action="store_true",
                    help="pyckpt without its collector pauses (the code before them)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.tensors < 1 or args.repeats < 1:
        ap.error("--tensors and --repeats must be positive")
    shape = tuple(int(s) for s in args.shape.split(","))
    work = tempfile.mkdtemp(prefix="pyckpt-many-tensors-", dir=args.dir)
    try:
        times = run(args.tensors, shape, args.repeats, args.live, args.collector_always_on,
                    work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = 4
    for s in shape:
        n *= s
    print(report(times, args.tensors, n * args.tensors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
