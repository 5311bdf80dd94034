"""GPU checkpoint staging benchmark (script; needs a CUDA device, exits cleanly without one).

Measures, for one LLM-shaped bf16 state dict on the current GPU (median [min-max] over --repeat
runs):

* raw pinned D2H: ``pinned.copy_(gpu, non_blocking=True)`` of the same bytes + stream sync
  (the floor every stager is compared with);
* blocking time of ``dcp.async_save``: pyckpt ``Writer`` (its own AsyncStager), DCP's default
  (``FileSystemWriter``, no stager options), and DCP's ``DefaultStager`` with
  ``StagingOptions(use_pinned_memory=True, use_non_blocking_copy=True)`` (2.13; time until its
  staging future is done, i.e. the training-safe point);
* synchronous save throughput: pyckpt ``Writer`` (streamed through pinned blocks) vs DCP
  ``FileSystemWriter`` (fsync on, both);
* host RSS growth over ``--rss-saves`` pyckpt async saves (pinned regions must be reused).

Usage: python benchmarks/bench_gpu_async.py [--gib 2] [--repeat 5] [--rss-saves 20] [--dir D]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path


def _state_dict(torch, total_bytes: int):
    hidden = 4096
    per_layer = 4 * hidden * hidden * 2  # four hidden x hidden bf16 matrices
    layers = max(1, total_bytes // per_layer)
    return {
        f"layers.{i}.{n}": torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16)
        for i in range(layers)
        for n in ("q", "k", "v", "o")
    }


def _fmt(xs: list[float]) -> str:
    """``median [min-max]`` of repeated measurements."""
    return f"{statistics.median(xs):8.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rss-saves", type=int, default=20)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("bench_gpu_async: no CUDA device; nothing measured.")
        return 0
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from pyckpt import _staging
    from pyckpt.storage import Writer

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    rt = _staging.runtime()
    if rt is None or not rt.available:
        print(f"bench_gpu_async: pyckpt CUDA staging unavailable ({rt.error if rt else 'off'})")
        return 0

    sd = _state_dict(torch, int(args.gib * (1 << 30)))
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    root = args.dir or Path(tempfile.mkdtemp(prefix="pyckpt-gpu-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[float]] = {}
    failed: dict[str, str] = {}

    def measure(name: str, fn) -> None:
        """Records ``fn()``'s measurements under ``name``; a baseline that fails on this torch
        version is reported as such instead of ending the run."""
        try:
            results[name] = fn()
        except Exception as e:  # any baseline failure is reported, not fatal
            failed[name] = f"{type(e).__name__}: {e}"

    # Raw pinned D2H of the same bytes (buffers allocated once, outside the timing).
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in sd.items()}
    times = []
    for _ in range(args.repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, v in sd.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        times.append(time.perf_counter() - t0)
    results["raw pinned D2H (s)"] = times
    del pinned

    def blocking(make_call) -> list[float]:
        out = []
        for i in range(args.repeat + 1):  # first run warms pools and caches
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            wait = make_call(i)
            out.append(time.perf_counter() - t0)
            wait()
        return out[1:]

    w = Writer(root / "pyckpt-async")

    def pyckpt_async(i: int):
        fut = dcp.async_save(sd, storage_writer=w, no_dist=True)
        return fut.result

    results["pyckpt async_save blocking (s)"] = blocking(pyckpt_async)
    # Host memory must stay flat over many saves: the pinned regions are reused.
    rss0 = _rss_bytes()
    for _ in range(args.rss_saves):
        pyckpt_async(0)()
    rss_growth_mib = (_rss_bytes() - rss0) / 2**20
    w.close()

    wz = Writer(root / "pyckpt-async-zstd", compression="zstd")

    def pyckpt_async_zstd(i: int):
        fut = dcp.async_save(sd, storage_writer=wz, no_dist=True)
        return fut.result

    results["pyckpt zstd async_save blocking (s)"] = blocking(pyckpt_async_zstd)
    wz.close()

    def dcp_default(i: int):
        fut = dcp.async_save(sd, storage_writer=FileSystemWriter(root / "dcp-async"), no_dist=True)
        return fut.result

    measure("DCP async_save default blocking (s)", lambda: blocking(dcp_default))

    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=True,
        )
    )

    def dcp_pinned(i: int):
        resp = dcp.async_save(
            sd,
            storage_writer=FileSystemWriter(root / "dcp-pinned"),
            async_stager=stager,
            no_dist=True,
        )
        resp.staging_completion.result()  # training-safe point
        return resp.upload_completion.result

    measure("DCP async_save DefaultStager(pinned) blocking (s)", lambda: blocking(dcp_pinned))
    stager.close()

    def sync(writer_factory) -> list[float]:
        out = []
        for _ in range(args.repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=writer_factory(), no_dist=True)
            out.append(nbytes / (time.perf_counter() - t0) / 1e9)
        return out

    ww = Writer(root / "pyckpt-sync")
    results["pyckpt sync save (GB/s)"] = sync(lambda: ww)
    ww.close()
    measure(
        "DCP FileSystemWriter sync save (GB/s)",
        lambda: sync(lambda: FileSystemWriter(root / "dcp-sync", thread_count=2)),
    )

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"state dict: {nbytes / 2**30:.2f} GiB bf16")
    print(f"  median [min-max] over {args.repeat} runs")
    for k, v in results.items():
        print(f"  {k:52s} {_fmt(v)}")
    for k, why in failed.items():
        print(f"  {k:52s} failed: {why}")
    raw = statistics.median(results["raw pinned D2H (s)"])
    ratio = statistics.median(results["pyckpt async_save blocking (s)"]) / raw
    print(f"  pyckpt blocking / raw pinned D2H (medians): {ratio:.2f} (target <= 1.2)")
    print(f"  host RSS growth over {args.rss_saves} more pyckpt async saves: {rss_growth_mib:.1f} MiB")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
