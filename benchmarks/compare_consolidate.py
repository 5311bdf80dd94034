"""Compare pyckpt.consolidate with torch's consolidate_safetensors_files; print tables.

Usage:
    PYCKPT_BENCH_SCALE=1 python benchmarks/compare_consolidate.py [--repeats 3] [--dir DIR]
    python benchmarks/compare_consolidate.py --export-sizes 1,16,256 [--repeats 5]

``--export-sizes`` (MiB) measures the fixed cost instead: at each size, one process exports the
same 2-shard DCP-HF input (dim 0, bf16 and fp32 tensors) with torch's consolidator, with
pyckpt.consolidate, and copies the input files with shutil.copyfile (the floor: the bytes
moved once), alternating, medians with [min-max].

Same tensors, same run, alternating, warm page cache, no fsync on either side (torch's
consolidator never fsyncs). Before each timed run, untimed: sync(), a read of its inputs, then
removal of the method's previous output, so no run pays for another's writeback, for inputs the
VM evicted, or for memory the VM handed back to its host (see the loop). Inputs per shard dim:
the DCP-HF sharded safetensors (2 shard files, as HuggingFaceStorageWriter(save_distributed=True)
writes them), read by torch and by pyckpt, and pyckpt checkpoints of the same DTensor pieces
saved by 2 gloo ranks with pyckpt.Writer (raw and zstd), read by pyckpt (chunks verified and
decoded on the way). Then pyckpt with 2 and 4 local gloo workers (one output file, and ~5
files): bytes per rank, max/mean, and peak RSS per worker (anonymous memory and file-backed
pages separately: the output mapping's pages count as RssFile).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _consolidate_data import (
    MemSampler,
    nbytes,
    scale,
    state_dict,
    warm,
    write_pyckpt,
    write_shards,
)


def run_torch(src: str, dst: str, names: list[str]) -> float:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    t = time.perf_counter()  # the output directory is part of the export (pyckpt makes its own)
    os.makedirs(dst)
    consolidate_safetensors_files(src, dst, dict.fromkeys(names, 1), num_threads=1)
    return time.perf_counter() - t


def run_pyckpt(src: str, dst: str, threads: int) -> float:
    import pyckpt

    t = time.perf_counter()
    pyckpt.consolidate(src, dst, threads=threads, fsync=False)
    return time.perf_counter() - t


def _worker(rank: int, world: int, port: int, src: str, dst: str, mfb, out: str) -> None:
    import torch.distributed as dist

    import pyckpt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        dist.barrier()
        with MemSampler() as mem:
            res = pyckpt.consolidate(src, dst, threads=1, fsync=False, max_file_bytes=mfb)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump({"bytes": res.rank_bytes, "total": res.total_bytes, "secs": res.seconds,
                       "anon": mem.peak_anon, "base_anon": mem.base_anon,
                       "file": mem.peak_file, "files": len(res.files)}, fh)
    finally:
        dist.destroy_process_group()


def multi_rank(src: str, work: str, world: int, mfb) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(dir=work)
    dst = os.path.join(work, "mr-dst")
    shutil.rmtree(dst, ignore_errors=True)
    mp.spawn(_worker, args=(world, port, src, dst, mfb, out), nprocs=world, join=True)
    res = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            res.append(json.load(fh))
    shutil.rmtree(dst)
    return res


def _sized_state_dict(target_bytes: int) -> dict[str, torch.Tensor]:
    """Eight 2-D tensors (bf16, with two fp32 ones) of 1024 columns, about target_bytes."""
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(8):
        dtype = torch.float32 if i % 4 == 3 else torch.bfloat16
        rows = max(2, target_bytes // 8 // (1024 * (4 if dtype == torch.float32 else 2)))
        sd[f"model.layers.{i}.weight"] = torch.randn(rows, 1024, generator=g).to(dtype)
    return sd


def run_copy(src: str, dst: str) -> float:
    """The floor: every input file copied once into dst (what any export must at least move)."""
    t = time.perf_counter()
    os.makedirs(dst)
    for name in sorted(os.listdir(src)):
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return time.perf_counter() - t


def export_sizes(sizes_mib: list[float], repeats: int, threads: int, work: str,
                 dim: int = 0) -> None:
    """The export at small and medium sizes against torch's consolidator and a plain copy."""
    from safetensors.torch import load_file

    load = os.getloadavg()
    print(f"# export fixed cost: 2 shards (dim {dim}), bf16 + fp32; {os.cpu_count()} CPUs; load "
          f"average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; repeats={repeats}; warm cache, "
          f"no fsync; pyckpt.consolidate: 1 process, {threads} threads")
    print("\n| size MiB | copy of the inputs | torch consolidator | pyckpt.consolidate | "
          "torch / pyckpt | pyckpt / copy |")
    print("|---|---|---|---|---|---|")

    def spread(ts: list[float]) -> str:
        return f"{statistics.median(ts) * 1e3:.1f} [{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}] ms"

    for mib in sizes_mib:
        sd = _sized_state_dict(int(mib * (1 << 20)))
        size = nbytes(sd)
        src = os.path.join(work, f"export-src-{mib:g}")
        write_shards(src, sd, 2, dim)
        names = list(sd)
        runners = {
            "copy": run_copy,
            "torch": lambda s, d, names=names: run_torch(s, d, names),
            "pyckpt": lambda s, d: run_pyckpt(s, d, threads),
        }
        times: dict[str, list[float]] = {k: [] for k in runners}
        for rep in range(repeats + 1):  # the first round warms caches and imports, unrecorded
            order = list(runners.items())
            for who, fn in (order if rep % 2 == 0 else order[::-1]):  # alternating
                dst = os.path.join(work, f"export-dst-{who}")
                os.sync()
                warm(src)
                shutil.rmtree(dst, ignore_errors=True)
                secs = fn(src, dst)
                if rep:
                    times[who].append(secs)
        for who in ("torch", "pyckpt"):
            out = load_file(os.path.join(work, f"export-dst-{who}",
                                         "model-00001-of-00001.safetensors"))
            assert sorted(out) == sorted(sd) and all(torch.equal(out[k], sd[k]) for k in sd), who
        for who in runners:
            shutil.rmtree(os.path.join(work, f"export-dst-{who}"))
        shutil.rmtree(src)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {size / 2**20:.1f} | {spread(times['copy'])} | {spread(times['torch'])} | "
              f"{spread(times['pyckpt'])} | {med['torch'] / med['pyckpt']:.2f}x | "
              f"{med['pyckpt'] / med['copy']:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=2, help="pyckpt threads (1 process)")
    ap.add_argument("--no-multi-rank", action="store_true", help="skip the multi-rank table")
    ap.add_argument("--export-sizes", default=None, metavar="MIB,MIB,...",
                    help="measure the export's fixed cost at these sizes (MiB) against torch's "
                         "consolidator and a plain copy of the inputs, instead of the tables")
    ap.add_argument("--export-dim", type=int, default=0, choices=[0, 1],
                    help="with --export-sizes: the dimension the 2 input shards split")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="pyckpt-bench-", dir=args.dir)
    try:
        if args.export_sizes:
            sizes = [float(v) for v in args.export_sizes.split(",") if v.strip()]
            export_sizes(sizes, args.repeats, args.threads, work, args.export_dim)
            return
        target = int(scale() * (1 << 30))
        sd = state_dict(target)
        size = nbytes(sd)
        names = list(sd)
        load = os.getloadavg()
        print(f"# state dict: {len(sd)} bf16 tensors, {size / 2**20:.0f} MiB; 2 shards; "
              f"{os.cpu_count()} CPUs; load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; "
              f"repeats={args.repeats}; warm cache, no fsync")
        # who -> (implementation, input)
        cases = {
            "torch": ("torch", "hf"),
            "pyckpt": ("pyckpt", "hf"),
            "pyckpt-raw": ("pyckpt", "raw"),
            "pyckpt-zstd": ("pyckpt", "zstd"),
        }
        rows = []
        stored = {}
        for dim in (0, 1):
            srcs = {"hf": os.path.join(work, f"src{dim}")}
            write_shards(srcs["hf"], sd, 2, dim)
            for comp in ("raw", "zstd"):
                srcs[comp] = os.path.join(work, f"pyckpt{dim}-{comp}")
                write_pyckpt(srcs[comp], target, 2, dim, None if comp == "raw" else comp)
                stored[(dim, comp)] = sum(
                    os.path.getsize(os.path.join(srcs[comp], n)) for n in os.listdir(srcs[comp])
                    if n.endswith(".pyckpt")
                )
            times: dict[str, list[float]] = {who: [] for who in cases}
            for rep in range(args.repeats + 1):  # first round warms the cache, not recorded
                for who, (impl, inp) in cases.items():
                    dst = os.path.join(work, f"dst-{who}")
                    # Untimed: write back the previous runs' outputs first, so no run pays for
                    # another's dirty pages (a 1 GiB output per run otherwise crosses the
                    # kernel's background-writeback threshold in whichever run comes next);
                    # then warm the inputs; then remove this method's previous output, last, so
                    # its pages are free for this run's output (this VM hands memory that stays
                    # free for ~2 s back to the host, and touching it again traps to the host).
                    os.sync()
                    warm(srcs[inp])
                    shutil.rmtree(dst, ignore_errors=True)
                    secs = (run_torch(srcs[inp], dst, names) if impl == "torch"
                            else run_pyckpt(srcs[inp], dst, args.threads))
                    if rep:
                        times[who].append(secs)
            from safetensors.torch import load_file

            ref = load_file(os.path.join(work, "dst-torch", "model-00001-of-00001.safetensors"))
            assert all(torch.equal(ref[k], sd[k]) for k in sd)
            for who in cases:
                out = load_file(os.path.join(work, f"dst-{who}", "model-00001-of-00001.safetensors"))
                assert sorted(out) == sorted(sd) and all(torch.equal(out[k], sd[k]) for k in sd), who
                shutil.rmtree(os.path.join(work, f"dst-{who}"))
            for comp in ("raw", "zstd"):
                shutil.rmtree(srcs[comp])
            rows.append((dim, {who: statistics.median(t) for who, t in times.items()}, times))
        print("\n| shard dim | torch `consolidate_safetensors_files` (1 thread), DCP-HF input | "
              f"pyckpt.consolidate (1 process, {args.threads} threads), DCP-HF input | speedup |")
        print("|---|---|---|---|")
        def spread(ts: list[float]) -> str:
            return f"{statistics.median(ts):.3f} [{min(ts):.3f}-{max(ts):.3f}] s"

        for dim, med, times in rows:
            mt, mp_ = med["torch"], med["pyckpt"]
            print(f"| {dim} | {spread(times['torch'])} ({size / mt / 1e9:.2f} GB/s) | "
                  f"{spread(times['pyckpt'])} ({size / mp_ / 1e9:.2f} GB/s) | {mt / mp_:.1f}x |")
        print("\n| shard dim | pyckpt input | stored MiB | pyckpt.consolidate "
              f"({args.threads} threads) | speedup vs torch on DCP-HF | "
              "time / pyckpt on DCP-HF |")
        print("|---|---|---|---|---|---|")
        for dim, med, times in rows:
            for comp in ("raw", "zstd"):
                m = med[f"pyckpt-{comp}"]
                print(f"| {dim} | {comp} | {stored[(dim, comp)] / 2**20:.0f} | "
                      f"{spread(times[f'pyckpt-{comp}'])} "
                      f"({size / m / 1e9:.2f} GB/s) | {med['torch'] / m:.2f}x | "
                      f"{m / med['pyckpt']:.2f} |")

        if args.no_multi_rank:
            return
        src = os.path.join(work, "src1")
        print("\n| workers | outputs | bytes per rank (MiB) | max/mean | wall max (s) | "
              "peak RssAnon per worker (MiB, +growth) | peak RssFile (MiB) |")
        print("|---|---|---|---|---|---|---|")
        for world in (2, 4):
            for mfb in (None, size // 5):
                res = multi_rank(src, work, world, mfb)
                per = [r["bytes"] for r in res]
                mem = ", ".join(f"{r['anon']:.0f} (+{r['anon'] - r['base_anon']:.0f})" for r in res)
                mean = sum(per) / len(per)
                print(f"| {world} | {res[0]['files']} file(s) | "
                      f"{', '.join(f'{b / 2**20:.1f}' for b in per)} | {max(per) / mean:.3f} | "
                      f"{max(r['secs'] for r in res):.2f} | "
                      f"{mem} | "
                      f"{max(r['file'] for r in res):.0f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
