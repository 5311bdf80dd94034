"""Async checkpoint staging benchmark: what ``dcp.async_save`` costs a training loop (script).

Runs on a GPU when there is one (``--device cuda``), else on the CPU (``--device cpu``, a small
default that fits a 2-core machine). The state is what a trainer saves: a nested
``{"model": model.state_dict()}`` (``--with-optim`` adds ``"optim": opt.state_dict()``) of
``--layers`` bias-free ``Linear(--width, --width)`` layers (bf16 on a GPU, fp32 on the CPU)
trained by SGD with momentum. Reported (median [min-max]):

* the floor: the raw copy of the same bytes into reused host buffers (pinned on a GPU);
* blocking time of ``dcp.async_save`` (until it returns; training may go on) for each pattern,
  first save and steady state (saves 2..N), each started from empty staging memory
  (``pyckpt.release_pinned()``):
    - ``new Writer per save``: ``dcp.async_save(sd, storage_writer=pyckpt.Writer(f".../{n}"))``,
      as the README's Quickstart writes it;
    - ``reused Writer``: one ``pyckpt.Writer`` for every save;
    - ``after reserve_pinned``: ``pyckpt.reserve_pinned(sd)`` (timed apart), then new Writers;
    - ``zstd, new Writer per save``;
    - DCP's default ``async_save`` (``FileSystemWriter``), and on a GPU DCP's ``DefaultStager``
      with pinned memory (time until its staging future is done, the training-safe point), for
      comparison (``--no-dcp`` skips both);
* training-step cost: each step (forward, backward, SGD, then a device sync so every step is
  timed alone) with no save in flight, against the steps that run while a save is written in
  the background (median and slowest; targets <= 1.02x and <= 1.25x), for pyckpt with a new
  Writer per save, for a ``CheckpointManager`` saving into its fast tier (a local directory;
  one process, no replicas), and for DCP's default unless ``--no-dcp``;
* host RSS and pyckpt's staging memory over ``--rss-saves`` saves with new Writers.

* synchronous saves (GB/s): pyckpt ``Writer`` against DCP ``FileSystemWriter`` (2 threads).

``--state flat --gib G`` saves the earlier benchmark's flat dict of 4096x4096 bf16 matrices
instead of the loop's state (the loop still trains).

Usage: python benchmarks/bench_gpu_async.py [--device cuda|cpu] [--layers 16] [--width 8192]
       [--batch 2048] [--saves 5] [--steps 30] [--rss-saves 20] [--with-optim]
       [--state model|flat] [--gib 2] [--no-dcp] [--no-sync] [--dir D]
Smoke run: python benchmarks/bench_gpu_async.py --device cpu --layers 2 --width 64 --saves 2
       --steps 3 --rss-saves 2
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _fmt(xs: list[float]) -> str:
    """``median [min-max]`` of repeated measurements (seconds)."""
    if not xs:
        return "       -"
    return f"{statistics.median(xs):8.4f} [{min(xs):.4f}-{max(xs):.4f}]"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _flat_state(torch: Any, device: str, total_bytes: int) -> dict[str, Any]:
    """The earlier benchmark's state: a flat dict of 4096x4096 bf16 matrices (``--state flat``)."""
    hidden = 4096
    per_layer = 4 * hidden * hidden * 2
    return {
        f"layers.{i}.{n}": torch.randn(hidden, hidden, device=device, dtype=torch.bfloat16)
        for i in range(max(1, total_bytes // per_layer))
        for n in ("q", "k", "v", "o")
    }


class Loop:
    """A training loop of bias-free Linear layers with SGD (momentum)."""

    def __init__(self, torch: Any, device: str, layers: int, width: int, batch: int) -> None:
        self.torch = torch
        self.device = device
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.model = torch.nn.Sequential(
            *[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]
        ).to(device=device, dtype=dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        self.x = torch.randn(batch, width, device=device, dtype=dtype)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def step(self) -> float:
        """One step, waited for; returns its wall time."""
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.model(self.x).float().square().mean().backward()
        self.opt.step()
        self.sync()
        return time.perf_counter() - t0

    def state(self, with_optim: bool) -> dict[str, Any]:
        sd: dict[str, Any] = {"model": self.model.state_dict()}
        if with_optim:
            sd["optim"] = self.opt.state_dict()
        return sd


def _tensors(sd: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(sd)[0] if isinstance(t, torch.Tensor)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--layers", type=int, default=None, help="default 16 (GPU) / 4 (CPU)")
    ap.add_argument("--width", type=int, default=None, help="default 8192 (GPU) / 1024 (CPU)")
    ap.add_argument("--batch", type=int, default=None, help="default 2048 (GPU) / 32 (CPU)")
    ap.add_argument("--saves", type=int, default=5, help="saves per pattern (first + steady)")
    ap.add_argument("--steps", type=int, default=30, help="baseline steps with no save")
    ap.add_argument("--rss-saves", type=int, default=20)
    ap.add_argument("--with-optim", action="store_true", help="also save the optimizer state")
    ap.add_argument("--state", choices=("model", "flat"), default="model",
                    help="model: the loop's nested state dict; flat: --gib of 4096x4096 bf16")
    ap.add_argument("--gib", type=float, default=2.0, help="size of the --state flat dict")
    ap.add_argument("--no-sync", action="store_true", help="skip the synchronous-save section")
    ap.add_argument("--no-dcp", action="store_true", help="skip DCP's default async_save")
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import pyckpt
    from pyckpt import _staging

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            print("bench_gpu_async: no CUDA device; run with --device cpu for the CPU variant.")
            return 0
        rt = _staging.runtime()
        if rt is None or not rt.available:
            print(f"bench_gpu_async: pyckpt CUDA staging unavailable ({rt.error if rt else 'off'})")
            return 0
    gpu = device == "cuda"
    layers = args.layers or (16 if gpu else 4)
    width = args.width or (8192 if gpu else 1024)
    batch = args.batch or (2048 if gpu else 32)

    loop = Loop(torch, device, layers, width, batch)
    loop.step()  # optimizer state exists from here on
    if args.state == "flat":
        sd: Any = _flat_state(torch, device, int(args.gib * (1 << 30)))
    else:
        sd = loop.state(args.with_optim)
    tensors = _tensors(sd)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    root = args.dir or Path(tempfile.mkdtemp(prefix="pyckpt-async-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    counter = iter(range(1 << 30))
    rows: dict[str, list[float]] = {}
    notes: dict[str, str] = {}

    def fresh_dir(tag: str) -> Path:
        d = root / f"{tag}-{next(counter)}"
        return d

    def cleanup() -> None:
        for d in root.iterdir():
            shutil.rmtree(d, ignore_errors=True)

    # Floor: the raw copy of the same bytes into reused host buffers (pinned on a GPU).
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=gpu) for t in tensors]
    floor = []
    for _ in range(max(3, args.saves)):
        loop.sync()
        t0 = time.perf_counter()
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=gpu)
        loop.sync()
        floor.append(time.perf_counter() - t0)
    del host
    floor_name = "raw pinned D2H of the same bytes" if gpu else "raw host copy of the same bytes"
    rows[floor_name] = floor

    def blocking(name: str, make_writer: Callable[[], Any], pre: Callable[[], None] | None = None,
                 **kw: Any) -> None:
        """First and steady-state blocking time of ``args.saves`` saves, from empty staging
        memory (each save waits for the previous one to finish writing)."""
        pyckpt.release_pinned()
        gc.collect()
        if pre is not None:
            pre()
        out = []
        for _ in range(args.saves):
            loop.sync()
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, storage_writer=make_writer(), no_dist=True, **kw)
            out.append(time.perf_counter() - t0)
            fut.result()
            cleanup()
        rows[f"{name}: first save"] = out[:1]
        rows[f"{name}: steady (saves 2..{args.saves})"] = out[1:]

    blocking("pyckpt, new Writer per save", lambda: pyckpt.Writer(fresh_dir("new")))
    reused = pyckpt.Writer(root / "reused")

    def reuse() -> Any:
        shutil.rmtree(root / "reused", ignore_errors=True)
        return reused

    blocking("pyckpt, one Writer reused", reuse)
    reused.close()

    def reserve() -> None:
        t0 = time.perf_counter()
        got = pyckpt.reserve_pinned(sd)
        rows["reserve_pinned(state) itself"] = [time.perf_counter() - t0]
        notes["reserve_pinned(state) itself"] = f"{got / 2**20:.1f} MiB allocated"

    blocking("pyckpt after reserve_pinned, new Writer", lambda: pyckpt.Writer(fresh_dir("res")),
             pre=reserve)
    blocking("pyckpt zstd, new Writer per save",
             lambda: pyckpt.Writer(fresh_dir("zstd"), compression="zstd"))
    if not args.no_dcp:
        try:
            blocking("DCP default async_save", lambda: FileSystemWriter(fresh_dir("dcp")))
        except Exception as e:  # a baseline failing on this torch version is reported, not fatal
            notes["DCP default async_save"] = f"failed: {type(e).__name__}: {e}"
        if gpu:
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                stager = DefaultStager(StagingOptions(use_pinned_memory=True,
                                                      use_shared_memory=False,
                                                      use_async_staging=True,
                                                      use_non_blocking_copy=True))
                pinned_blocking: list[float] = []
                for _ in range(args.saves):
                    loop.sync()
                    t0 = time.perf_counter()
                    resp = dcp.async_save(sd, storage_writer=FileSystemWriter(fresh_dir("dcpp")),
                                          async_stager=stager, no_dist=True)
                    resp.staging_completion.result()  # the training-safe point
                    pinned_blocking.append(time.perf_counter() - t0)
                    resp.upload_completion.result()
                    cleanup()
                stager.close()
                rows["DCP DefaultStager(pinned): first save"] = pinned_blocking[:1]
                rows[f"DCP DefaultStager(pinned): steady (saves 2..{args.saves})"] = (
                    pinned_blocking[1:]
                )
            except Exception as e:  # reported, not fatal (it failed on torch 2.11)
                notes["DCP DefaultStager(pinned)"] = f"failed: {type(e).__name__}: {e}"

    # Training-step cost while a save is in flight.
    pyckpt.release_pinned()
    pyckpt.reserve_pinned(sd)  # the steady state every later save sees
    for _ in range(3):
        loop.step()
    base = [loop.step() for _ in range(args.steps)]
    steps: dict[str, list[float]] = {"no save in flight": base}
    stall: dict[str, list[float]] = {}

    def during(name: str, make_writer: Callable[[], Any]) -> None:
        inflight: list[float] = []
        blocks: list[float] = []
        for _ in range(args.saves):
            loop.sync()
            t0 = time.perf_counter()
            fut = dcp.async_save(loop.state(args.with_optim), storage_writer=make_writer(),
                                 no_dist=True)
            blocks.append(time.perf_counter() - t0)
            n = 0
            while not fut.done() or n == 0:
                inflight.append(loop.step())
                n += 1
            fut.result()
            cleanup()
        steps[f"during a save: {name}"] = inflight
        stall[name] = blocks

    during("pyckpt, new Writer per save", lambda: pyckpt.Writer(fresh_dir("train")))

    # The same with a CheckpointManager saving into its fast tier (a local directory, zstd; one
    # process, so no replicas; no durable copy among these steps).
    mgr = pyckpt.CheckpointManager(root / "mgr-durable", local=root / "mgr-local", replicas=0,
                                   save_every=1, persist_every=1 << 30, keep_local=1)
    try:
        inflight, blocks = [], []
        for s in range(args.saves):
            loop.sync()
            t0 = time.perf_counter()
            fut = mgr.save(s + 1, loop.state(args.with_optim))
            blocks.append(time.perf_counter() - t0)
            n = 0
            while fut is not None and (not fut.done() or n == 0):
                inflight.append(loop.step())
                n += 1
            mgr.wait()
        steps["during a save: CheckpointManager, fast tier"] = inflight
        stall["CheckpointManager, fast tier"] = blocks
    finally:
        mgr.close()
        shutil.rmtree(root / "mgr-durable", ignore_errors=True)
        shutil.rmtree(root / "mgr-local", ignore_errors=True)
    if not args.no_dcp and "DCP default async_save" not in notes:
        during("DCP default async_save", lambda: FileSystemWriter(fresh_dir("train-dcp")))

    # Synchronous saves (GB/s, fsync on both sides).
    sync_rows: dict[str, list[float]] = {}
    if not args.no_sync:
        def sync(make_writer: Callable[[], Any]) -> list[float]:
            out = []
            for _ in range(max(1, args.saves - 1)):
                loop.sync()
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=make_writer(), no_dist=True)
                out.append(nbytes / (time.perf_counter() - t0) / 1e9)
                cleanup()
            return out

        sync_rows["pyckpt sync save (GB/s)"] = sync(lambda: pyckpt.Writer(fresh_dir("sync")))
        if not args.no_dcp:
            sync_rows["DCP FileSystemWriter sync save, 2 threads (GB/s)"] = sync(
                lambda: FileSystemWriter(fresh_dir("dcps"), thread_count=2)
            )

    # Host memory over many saves with new Writers.
    gc.collect()
    rss0, pinned0 = _rss_bytes(), pyckpt.pinned_stats()["allocated_bytes"]
    for _ in range(args.rss_saves):
        dcp.async_save(sd, storage_writer=pyckpt.Writer(fresh_dir("rss")), no_dist=True).result()
        cleanup()
    gc.collect()
    rss_growth = (_rss_bytes() - rss0) / 2**20
    pinned_growth = (pyckpt.pinned_stats()["allocated_bytes"] - pinned0) / 2**20

    name = torch.cuda.get_device_name() if gpu else f"CPU ({torch.get_num_threads()} threads)"
    what = (f"{layers} x Linear({width}, {width}) {'bf16' if gpu else 'fp32'}"
            f"{' + SGD state' if args.with_optim else ''}, nested" if args.state == "model"
            else "flat dict of 4096x4096 bf16")
    print(f"device: {name}  torch {torch.__version__}  state: {nbytes / 2**30:.3f} GiB ({what}); "
          f"training loop: {layers} x Linear({width}, {width}), batch {batch}")
    print("blocking time of dcp.async_save (s), median [min-max]")
    for k, v in rows.items():
        print(f"  {k:58s} {_fmt(v)}  {notes.get(k, '')}")
    for k, why in notes.items():
        if k not in rows:
            print(f"  {k:58s} {why}")
    floor_s = statistics.median(floor)
    for k in ("pyckpt, new Writer per save", "pyckpt after reserve_pinned, new Writer",
              "pyckpt, one Writer reused"):
        first = rows.get(f"{k}: first save", [])
        steady = rows.get(f"{k}: steady (saves 2..{args.saves})", [])
        if first:
            ratio = f"first {first[0] / floor_s:6.2f}x"
            if steady:
                ratio += f", steady {statistics.median(steady) / floor_s:6.2f}x"
            print(f"  {k} / floor: {ratio} (target <= 1.2 from the 2nd save; first after reserve)")
    print("training steps (s), median [min-max]; a device sync ends every step")
    base_med, base_max = statistics.median(base), max(base)
    for k, v in steps.items():
        extra = ""
        if v and k != "no save in flight":
            extra = (f"  median {statistics.median(v) / base_med:.3f}x (<= 1.02), "
                     f"slowest {max(v) / base_max:.3f}x (<= 1.25) of the no-save loop")
        print(f"  {k:58s} {_fmt(v)}{extra}")
    for k, v in stall.items():
        print(f"  async_save blocking in that loop: {k:33s} {_fmt(v)}")
    for k, v in sync_rows.items():
        print(f"  {k:58s} {_fmt(v)}")
    print(f"host RSS growth over {args.rss_saves} more saves with new Writers: {rss_growth:.1f} MiB;"
          f" pyckpt staging memory growth: {pinned_growth:.1f} MiB")
    print(f"pyckpt staging memory: {pyckpt.pinned_stats()}")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
