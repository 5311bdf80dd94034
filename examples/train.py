"""pyckpt end-to-end demo: train, checkpoint, crash mid-save, resume bit-identically, export.

Two local processes (gloo on 127.0.0.1) train a small Llama-style causal LM (``transformers``
``LlamaForCausalLM``, random init, no downloads) with FSDP2 ``fully_shard`` and AdamW on seeded
synthetic tokens, and save the model + optimizer with ``dcp.async_save`` into
``pyckpt.Writer(..., compression="zstd")`` every ``--ckpt-every`` steps. The driver (this script
without ``--worker``) runs three phases, each a fresh pair of worker processes:

1. reference: an uninterrupted run. At every checkpoint step it saves once with pyckpt and once
   with DCP's own ``FileSystemWriter`` (one after the other, the order alternating) and records
   the training stall of each: the time ``dcp.async_save`` takes to return, i.e. until training
   can continue.
2. crash: a new run from scratch with pyckpt checkpoints only. At ``--crash-at`` rank 1's
   background write signals once its data file is on disk, before the checkpoint is committed
   (``pyckpt.json`` is written last); the driver then SIGKILLs rank 1 and, as torchrun's agent
   would, stops rank 0.
3. resume: both workers restart, pick the latest COMPLETE checkpoint (a directory holding
   ``pyckpt.json``; the killed save has none), load it (timed; DCP's reference checkpoint of
   the same step is loaded into a second copy of the model for comparison and must restore the
   identical state), train to the end, then export the model: a model-only pyckpt checkpoint
   consolidated by ``pyckpt.consolidate`` over both ranks into Hugging Face safetensors, timed
   against torch's ``consolidate_safetensors_files`` on a DCP ``HuggingFaceStorageWriter`` save
   of the same model. Rank 0 writes config.json, loads the export with
   ``LlamaForCausalLM.from_pretrained`` and compares its logits with the trained model's.

Training is deterministic (``torch.use_deterministic_algorithms``, fixed seeds, one thread per
process, each batch a function of the step index, no dropout), so every loss logged after the
resume must equal the reference run's bit for bit (compared as float hex). The driver prints a
table, writes a PNG plot and ``summary.json`` into the work directory, and ends with
``resumed bit-identical: yes|no`` and ``export loads in transformers: yes|no`` (exit status 1
when a check fails).

    python examples/train.py [--workdir DIR] [--size small|tiny] [--steps N] [--ckpt-every K]
                             [--crash-at S] [--no-progress]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORLD_SIZE = 2
VICTIM_RANK = 1  # the worker killed in the middle of a save
COMMIT_FILE = "pyckpt.json"  # a pyckpt checkpoint is complete once this file exists


@dataclasses.dataclass(frozen=True)
class Size:
    """Model, data and schedule of one demo size."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    seq: int
    batch: int  # sequences per rank per step
    steps: int
    ckpt_every: int
    crash_at: int


SIZES = {
    # ~5.3 M parameters; fp32 model + AdamW state ~61 MiB.
    "small": Size(vocab=4096, hidden=256, intermediate=688, layers=4, heads=8, kv_heads=4,
                  seq=64, batch=8, steps=60, ckpt_every=10, crash_at=40),
    # For tests: a few thousand parameters, a dozen steps.
    "tiny": Size(vocab=128, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2,
                 seq=16, batch=4, steps=12, ckpt_every=4, crash_at=8),
}


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def latest_complete(root: Path) -> tuple[int | None, list[str]]:
    """The newest checkpoint step under ``root`` holding ``pyckpt.json``, and the names of the
    newer directories that were skipped because they have none (interrupted saves)."""
    steps = sorted(
        (int(p.name.split("-", 1)[1]), p) for p in root.glob("step-*") if p.is_dir()
    ) if root.is_dir() else []
    skipped = []
    for step, path in reversed(steps):
        if (path / COMMIT_FILE).is_file():
            return step, skipped
        skipped.append(path.name)
    return None, skipped


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# =============================================================================== worker


def _worker(cfg: dict[str, Any]) -> int:
    import contextlib
    import datetime

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import pyckpt

    size = Size(**cfg["size"])
    phase: str = cfg["phase"]
    work = Path(cfg["workdir"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # the same kernels in every run, on every rank
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["timeout"]))
    # Checkpoint collectives run in DCP's background thread: give them their own group so they
    # never interleave with the training collectives of the main thread.
    ckpt_pg = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (world,))
    show = rank == 0 and cfg["progress"]

    def say(msg: str) -> None:
        if rank == 0:
            print(f"  [{phase}] {msg}", flush=True)

    config = LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, max_position_embeddings=size.seq,
        tie_word_embeddings=False, attention_dropout=0.0, use_cache=False,
    )

    def build() -> tuple[Any, Any]:
        torch.manual_seed(cfg["seed"])  # the same initial weights in every run and process
        model = LlamaForCausalLM(config)
        model.config._attn_implementation = "eager"
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)

    def batch(index: int) -> Any:
        """Arithmetic token sequences (learnable), a pure function of ``index``."""
        g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + index)
        start = torch.randint(size.vocab, (size.batch, 1), generator=g)
        stride = torch.randint(1, 8, (size.batch, 1), generator=g)
        return (start + stride * torch.arange(size.seq + 1)) % size.vocab

    model, opt = build()
    n_params = sum(p.numel() for p in model.parameters())  # global sizes (DTensors)
    results: dict[str, Any] = {"phase": phase, "rank": rank, "params": n_params, "stalls": []}
    ckpt_root = work / "ckpt"
    start = 0

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            out: dict[str, Any] = {}
            for k, v in tree.items():
                out.update(leaves(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: tree}

    if phase == "resume":
        found = [None]
        if rank == 0:
            step, skipped = latest_complete(ckpt_root)
            found = [(step, skipped)]
        dist.broadcast_object_list(found, src=0)
        step, skipped = found[0]
        if step is None:
            raise SystemExit(f"no complete checkpoint under {ckpt_root}")
        for name in skipped:
            say(f"skipping {name}: no {COMMIT_FILE}, the save was interrupted")
        say(f"resuming from {step_name(step)} (latest complete checkpoint)")

        def load(m: Any, o: Any, reader: Any, path: Path) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            msd, osd = get_state_dict(m, o)
            state = {"model": msd, "optim": osd, "step": -1}
            dcp.load(state, checkpoint_id=path, storage_reader=reader)
            set_state_dict(m, o, model_state_dict=msd, optim_state_dict=osd)
            elapsed = time.perf_counter() - t0
            if state["step"] != step:
                raise RuntimeError(f"{path}: holds step {state['step']}, expected {step}")
            return elapsed

        from torch.distributed.checkpoint import FileSystemReader

        # For comparison, DCP's checkpoint of the same step from the reference run goes into a
        # second copy of the model. Each is loaded twice, alternating, and the faster load
        # counts: the first load in a process pays one-time costs whichever method comes first.
        dcp_path = work / "ref" / "dcp" / step_name(step)
        path = ckpt_root / step_name(step)
        ref_model, ref_opt = build()
        times: dict[str, list[float]] = {"dcp": [], "pyckpt": []}
        for _ in range(2):
            times["dcp"].append(load(ref_model, ref_opt, FileSystemReader(dcp_path), dcp_path))
            with pyckpt.Reader(path) as reader:
                times["pyckpt"].append(load(model, opt, reader, path))
        results["load_dcp_s"], results["load_pyckpt_s"] = min(times["dcp"]), min(times["pyckpt"])
        a = leaves(dict(zip(("model", "optim"), get_state_dict(model, opt))))
        b = leaves(dict(zip(("model", "optim"), get_state_dict(ref_model, ref_opt))))
        same = a.keys() == b.keys() and all(
            (torch.equal(local(a[k]), local(b[k])) if isinstance(a[k], torch.Tensor)
             else a[k] == b[k]) for k in a
        )
        flags = [None] * world
        dist.all_gather_object(flags, same)
        results["state_matches_dcp"] = all(flags)
        say(f"restored state equals DCP's reference checkpoint of {step_name(step)}: "
            f"{'yes' if all(flags) else 'NO'}")
        del ref_model, ref_opt
        start = results["resumed_from"] = step

    # ---------------------------------------------------------------- checkpointing
    class CrashInjectingWriter(pyckpt.Writer):
        """pyckpt.Writer that, on the victim rank and for one checkpoint, reports once this
        rank's data file is on disk and then waits to be killed before the save can commit."""

        crash_dir: str | None = None

        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)
            if self.crash_dir is not None and Path(self.path).name == self.crash_dir:
                fut.wait()  # this rank's data file is written; the commit comes after
                (work / "crash.marker").write_text(self.path)
                time.sleep(cfg["timeout"])  # the driver SIGKILLs this process now
                raise RuntimeError("crash injection: the driver did not kill this worker")
            return fut

    if phase == "reference":
        ckpt_root = work / "ref" / "pyckpt"
    writer = CrashInjectingWriter(ckpt_root, compression="zstd")
    if phase == "crash" and rank == VICTIM_RANK:
        writer.crash_dir = step_name(cfg["crash_at"])
    pending: list[Any] = []

    def wait_pending() -> None:
        while pending:
            f = pending.pop()
            getattr(f, "upload_completion", f).result()

    def checkpoint(step: int, index: int) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        wait_pending()  # one save in flight at a time
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": step}
        saves = [("pyckpt", lambda: writer, ckpt_root / step_name(step))]
        if phase == "reference":
            dcp_path = work / "ref" / "dcp" / step_name(step)
            saves.append(("dcp", lambda: FileSystemWriter(dcp_path), dcp_path))
            if index % 2:
                saves.reverse()
        for name, make, path in saves:
            wait_pending()  # never measure one writer while the other still writes
            w = make()
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=path, storage_writer=w,
                                 process_group=ckpt_pg)
            results["stalls"].append({"step": step, "writer": name,
                                      "seconds": time.perf_counter() - t0})
            pending.append(fut)

    # ---------------------------------------------------------------- training
    bar: Any = contextlib.nullcontext()
    if show:
        from tqdm import tqdm

        bar = tqdm(total=size.steps, initial=start, desc=f"{phase:>9} train", unit="step",
                   dynamic_ncols=True, mininterval=0.5)
    with bar, open(work / "logs" / f"{phase}-rank{rank}.jsonl", "a") as log:
        for step in range(start + 1, size.steps + 1):
            ids = batch(step * world + rank)
            logits = model(input_ids=ids[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, size.vocab), ids[:, 1:].reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            value = loss.item()
            log.write(json.dumps({"step": step, "loss": value.hex()}) + "\n")
            log.flush()
            if show:
                bar.update(1)
                bar.set_postfix(loss=f"{value:.4f}")
            if step % size.ckpt_every == 0:
                checkpoint(step, step // size.ckpt_every)
    wait_pending()
    writer.close()

    if phase == "resume":
        results.update(_export(cfg, config, model, batch, rank, show, say))
    (work / "results" / f"{phase}-rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _export(cfg: dict[str, Any], config: Any, model: Any, batch: Any, rank: int, show: bool,
            say: Any) -> dict[str, Any]:
    """Exports the FSDP model with pyckpt.consolidate (and, for comparison, torch's
    consolidator), then loads the export with transformers on rank 0 and compares logits."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import pyckpt

    out: dict[str, Any] = {}
    work = Path(cfg["workdir"]) / "export"
    eval_ids = batch(10**9)[:, :-1]
    with torch.no_grad():
        trained_logits = model(input_ids=eval_ids).logits

    # The training checkpoints hold model and optimizer; the export wants the model only, so it
    # gets a model-only checkpoint (its keys are the Hugging Face parameter names).
    msd = get_model_state_dict(model)
    src, hf_dir = work / "pyckpt-model", work / "hf"
    with pyckpt.Writer(src, compression="zstd") as w:
        dcp.save(msd, storage_writer=w)
    dist.barrier()
    bar: Any = None
    if show:
        from tqdm import tqdm

        bar = tqdm(desc="   export consolidate", unit="B", unit_scale=True, dynamic_ncols=True)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    t0 = time.perf_counter()
    res = pyckpt.consolidate(src, hf_dir, fsync=False, progress=progress if show else None)
    mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the export is done when the slowest rank is
    if bar is not None:
        progress(res.total_bytes, res.total_bytes)
        bar.close()
    out["export_pyckpt_s"] = float(mine)
    out["export_bytes"] = res.total_bytes

    # Baseline: DCP's Hugging Face sharded save of the same model, then torch's consolidator
    # (one process; it has no rank-partitioned mode for a single output file).
    shards, torch_dir = work / "dcp-hf-shards", work / "torch-consolidated"
    dcp.save(msd, storage_writer=HuggingFaceStorageWriter(str(shards), save_distributed=True))
    dist.barrier()
    if rank == 0:
        torch_dir.mkdir(parents=True)
        t0 = time.perf_counter()
        consolidate_safetensors_files(str(shards), str(torch_dir), dict.fromkeys(msd, 1))
        out["export_torch_s"] = time.perf_counter() - t0

        from safetensors.torch import load_file
        from transformers import LlamaForCausalLM

        ours = {}
        for f in res.files:
            ours.update(load_file(f))
        theirs = {}
        for f in sorted(torch_dir.glob("*.safetensors")):
            theirs.update(load_file(str(f)))
        out["export_matches_torch"] = ours.keys() == theirs.keys() and all(
            torch.equal(ours[k], theirs[k]) for k in ours
        )
        say("export equals torch's consolidated output: "
            f"{'yes' if out['export_matches_torch'] else 'NO'}")

        config.save_pretrained(hf_dir)  # config.json next to the safetensors files
        hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                              attn_implementation="eager")
        hf.eval()
        with torch.no_grad():
            hf_logits = hf(input_ids=eval_ids).logits
        out["logits_exact"] = bool(torch.equal(hf_logits, trained_logits))
        out["logits_max_abs_diff"] = float((hf_logits - trained_logits).abs().max())
        say(f"transformers logits equal the trained model's: "
            f"{'yes' if out['logits_exact'] else 'NO'} "
            f"(max |diff| {out['logits_max_abs_diff']:.3g})")
    return out


# =============================================================================== driver


class DemoError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(cfg: dict[str, Any]) -> list[subprocess.Popen[bytes]]:
    port = _free_port()
    procs = []
    for rank in range(WORLD_SIZE):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)], env=env,
        ))
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _run_phase(cfg: dict[str, Any], timeout: float) -> None:
    procs = _launch(cfg)
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                raise DemoError(f"{cfg['phase']}: worker {failed[0]} exited with status "
                                f"{procs[failed[0]].returncode}")
            if time.monotonic() > deadline:
                raise DemoError(f"{cfg['phase']}: timed out after {timeout:.0f} s")
            time.sleep(0.05)
        bad = [i for i, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise DemoError(f"{cfg['phase']}: worker {bad[0]} exited with status "
                            f"{procs[bad[0]].returncode}")
    finally:
        _stop(procs)


def _run_crash(cfg: dict[str, Any], timeout: float) -> None:
    marker = Path(cfg["workdir"]) / "crash.marker"
    procs = _launch(cfg)
    try:
        deadline = time.monotonic() + timeout
        while not marker.exists():
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    raise DemoError(f"crash: worker {i} exited with status {p.returncode} "
                                    "before the save to interrupt began")
            if time.monotonic() > deadline:
                raise DemoError(f"crash: timed out after {timeout:.0f} s")
            time.sleep(0.01)
        procs[VICTIM_RANK].send_signal(signal.SIGKILL)
        procs[VICTIM_RANK].wait()
        print(f"  [crash] rank {VICTIM_RANK} SIGKILLed while saving "
              f"{Path(marker.read_text()).name} (its data file written, checkpoint not "
              "committed); stopping the other worker", flush=True)
    finally:
        _stop(procs)


def _read_losses(path: Path) -> dict[int, str]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[rec["step"]] = rec["loss"]
    return out


def losses_match(reference: dict[int, str], run: dict[int, str], steps: Any) -> bool:
    """True when ``run`` logged exactly ``steps`` and each loss equals the reference run's
    (the logs hold ``float.hex`` strings, so equal means bit-identical)."""
    steps = list(steps)
    return bool(steps) and sorted(run) == steps and all(
        s in reference and run[s] == reference[s] for s in steps
    )


def _table(rows: list[tuple[str, str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(r)).rstrip())
        if j == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def _plot(path: Path, summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = _figure(summary)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _figure(summary: dict[str, Any]) -> Any:
    """The demo's figure: losses with the kill and the resume point, stalls per checkpoint with
    their ratio, bytes on disk, and resume and export times on axes of their own. Every panel
    says how many runs it shows."""
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(14, 8.5))
    grid = fig.add_gridspec(2, 4)
    blue, orange = "#1f77b4", "#ff7f0e"
    w = 0.4

    a = fig.add_subplot(grid[0, :2])
    ref = summary["losses"]["reference"]
    a.plot(list(ref), [float.fromhex(v) for v in ref.values()], color="0.6", lw=3,
           label="reference run (uninterrupted)")
    for name, label, style in (
        ("crash", "run that was killed", dict(color="tab:red", ls="--")),
        ("resume", "restarted run", dict(color="tab:green", ls=":")),
    ):
        d = summary["losses"][name]
        a.plot(list(d), [float.fromhex(v) for v in d.values()], lw=1.5, label=label, **style)
    a.axvline(summary["crash_at"], color="tab:red", lw=1,
              label=f"SIGKILL while saving step {summary['crash_at']}")
    a.axvline(summary["resumed_from"], color="tab:green", lw=1,
              label=f"resumed from step {summary['resumed_from']} (last complete checkpoint)")
    a.set(title="training loss (rank 0; 1 run each)", xlabel="step", ylabel="loss")
    a.legend(fontsize=8)

    a = fig.add_subplot(grid[0, 2:])
    steps = summary["stall_steps"]
    x = list(range(len(steps)))
    ours = [v * 1e3 for v in summary["stall_pyckpt_s"]]
    theirs = [v * 1e3 for v in summary["stall_dcp_s"]]
    b1 = a.bar([i - w / 2 for i in x], ours, w, color=blue, label="pyckpt.Writer zstd")
    b2 = a.bar([i + w / 2 for i in x], theirs, w, color=orange, label="DCP FileSystemWriter")
    a.bar_label(b1, [f"{v:.1f}" for v in ours], fontsize=8)
    a.bar_label(b2, [f"{v:.1f}" for v in theirs], fontsize=8)
    top = max(ours + theirs + [1e-9])
    for i, (p, d) in enumerate(zip(ours, theirs)):  # the ratio above each pair
        a.text(i, 1.12 * max(p, d), f"DCP / pyckpt {d / p:.2f}x" if p > 0 else "-",
               ha="center", fontsize=8, fontweight="bold")
    a.set_ylim(0, 1.3 * top)
    a.set_xticks(x, [str(s) for s in steps])
    a.set(title=f"training stall per async_save (max over ranks; {len(steps)} saves, 1 run "
                "each)", xlabel="checkpoint step", ylabel="ms")
    a.legend(loc="upper left", fontsize=8)

    a = fig.add_subplot(grid[1, :2])
    mib = [summary["bytes_pyckpt"] / 2**20, summary["bytes_dcp"] / 2**20]
    bars = a.bar(["pyckpt zstd", "DCP"], mib, color=[blue, orange])
    a.bar_label(bars, [f"{v:.1f}" for v in mib])
    raw = summary["bytes_raw"] / 2**20
    a.axhline(raw, color="0.3", ls="--", lw=1, label="raw tensor bytes")
    a.set_ylim(0, 1.25 * max(mib + [raw]))  # room for the legend
    a.set(title=f"checkpoint on disk (step {summary['bytes_step']})", ylabel="MiB")
    a.legend(loc="upper right")

    # Resume and export on axes of their own: their scales differ by an order of magnitude.
    for col, title, ours_s, theirs_s, theirs_label in (
        (2, "resume (load + set_state_dict)", summary["load_pyckpt_s"], summary["load_dcp_s"],
         "DCP"),
        (3, f"export to safetensors ({summary.get('export_bytes', 0) / 2**20:.1f} MiB)",
         summary["export_pyckpt_s"], summary["export_torch_s"], "torch"),
    ):
        a = fig.add_subplot(grid[1, col])
        bars = a.bar(["pyckpt", theirs_label], [ours_s, theirs_s], color=[blue, orange])
        a.bar_label(bars, [f"{ours_s:.3f}", f"{theirs_s:.3f}"], fontsize=8)
        ratio = f"{theirs_s / ours_s:.2f}x" if ours_s > 0 else "-"
        a.set_ylim(0, 1.25 * max(ours_s, theirs_s, 1e-9))
        a.set(title=f"{title}\n{theirs_label} / pyckpt {ratio} (1 run)", ylabel="s")
        a.title.set_fontsize(9)

    fig.suptitle(f"pyckpt demo: {summary['params'] / 1e6:.2f} M-parameter Llama, FSDP2 on "
                 f"{WORLD_SIZE} gloo processes, async checkpoint every {summary['ckpt_every']} "
                 "steps")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="pyckpt-demo",
                    help="work directory (checkpoints, exports, plot); default ./pyckpt-demo")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--ckpt-every", type=int, default=None)
    ap.add_argument("--crash-at", type=int, default=None,
                    help="checkpoint step whose save is interrupted (a multiple of --ckpt-every)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="per phase, seconds")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return _worker(json.loads(args.worker))

    size = SIZES[args.size]
    size = dataclasses.replace(
        size,
        steps=args.steps or size.steps,
        ckpt_every=args.ckpt_every or size.ckpt_every,
        crash_at=args.crash_at or size.crash_at,
    )
    if not (size.ckpt_every < size.crash_at < size.steps and size.crash_at % size.ckpt_every == 0):
        ap.error("--crash-at must be a multiple of --ckpt-every, after the first checkpoint and "
                 "before the last step")

    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    for sub in ("ref", "ckpt", "export", "logs", "results"):
        shutil.rmtree(work / sub, ignore_errors=True)
    for sub in ("logs", "results"):
        (work / sub).mkdir()
    (work / "crash.marker").unlink(missing_ok=True)
    base = {"size": dataclasses.asdict(size), "workdir": str(work), "seed": args.seed,
            "crash_at": size.crash_at, "timeout": args.timeout, "progress": not args.no_progress}

    t_start = time.perf_counter()
    print(f"pyckpt demo in {work}: {WORLD_SIZE} processes, {size.steps} steps, "
          f"checkpoint every {size.ckpt_every}, crash while saving step {size.crash_at}",
          flush=True)
    try:
        print("1/3 reference run (uninterrupted; pyckpt and DCP checkpoints)", flush=True)
        _run_phase(dict(base, phase="reference"), args.timeout)
        print(f"2/3 training run, one worker killed while saving step {size.crash_at}",
              flush=True)
        _run_crash(dict(base, phase="crash"), args.timeout)
        for p in sorted((work / "ckpt").glob("step-*")):
            files = sorted(f.name for f in p.iterdir())
            state = ("complete" if COMMIT_FILE in files else
                     f"INCOMPLETE: no {COMMIT_FILE}, {len(files)} other file(s), "
                     f"{dir_bytes(p) / 2**20:.2f} MiB")
            print(f"  {p.name}: {state}", flush=True)
        print("3/3 restart both workers, resume, finish, export", flush=True)
        _run_phase(dict(base, phase="resume"), args.timeout)
    except DemoError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        print("resumed bit-identical: no")
        print("export loads in transformers: no")
        return 1

    res = {(ph, r): json.loads((work / "results" / f"{ph}-rank{r}.json").read_text())
           for ph in ("reference", "resume") for r in range(WORLD_SIZE)}
    resumed_from = res[("resume", 0)]["resumed_from"]
    checks = []  # (description, ok)
    losses: dict[str, dict[int, str]] = {}
    for rank in range(WORLD_SIZE):
        ref = _read_losses(work / "logs" / f"reference-rank{rank}.jsonl")
        crash = _read_losses(work / "logs" / f"crash-rank{rank}.jsonl")
        resumed = _read_losses(work / "logs" / f"resume-rank{rank}.jsonl")
        if rank == 0:
            losses = {"reference": ref, "crash": crash, "resume": resumed}
        checks.append((f"rank {rank}: losses of steps {resumed_from + 1}..{size.steps} after "
                       "the resume equal the reference run's (float hex)",
                       losses_match(ref, resumed, range(resumed_from + 1, size.steps + 1))))
        checks.append((f"rank {rank}: losses of the run that crashed equal the reference run's",
                       losses_match(ref, crash, sorted(crash) or [1])))
    checks.append(("restored state equals DCP's checkpoint of the same step",
                   all(res[("resume", r)]["state_matches_dcp"] for r in range(WORLD_SIZE))))
    resumed_ok = all(ok for _, ok in checks)
    r0 = res[("resume", 0)]
    export_ok = bool(r0.get("logits_exact")) and bool(r0.get("export_matches_torch"))

    def per_step(phase: str, writer: str) -> dict[int, float]:
        out: dict[int, float] = {}
        for r in range(WORLD_SIZE):
            for s in res[(phase, r)]["stalls"]:
                if s["writer"] == writer:
                    out[s["step"]] = max(out.get(s["step"], 0.0), s["seconds"])
        return out

    st_p, st_d = per_step("reference", "pyckpt"), per_step("reference", "dcp")
    stall_steps = sorted(st_p)
    last = stall_steps[-1]
    ref_root = work / "ref"
    summary: dict[str, Any] = {
        "params": r0["params"],
        "ckpt_every": size.ckpt_every,
        "crash_at": size.crash_at,
        "resumed_from": resumed_from,
        "stall_steps": stall_steps,
        "stall_pyckpt_s": [st_p[s] for s in stall_steps],
        "stall_dcp_s": [st_d[s] for s in stall_steps],
        "bytes_step": last,
        "bytes_pyckpt": dir_bytes(ref_root / "pyckpt" / step_name(last)),
        "bytes_dcp": dir_bytes(ref_root / "dcp" / step_name(last)),
        # fp32 model + AdamW exp_avg + exp_avg_sq (the step counters are a few bytes more)
        "bytes_raw": r0["params"] * 4 * 3,
        "load_pyckpt_s": max(res[("resume", r)]["load_pyckpt_s"] for r in range(WORLD_SIZE)),
        "load_dcp_s": max(res[("resume", r)]["load_dcp_s"] for r in range(WORLD_SIZE)),
        "export_pyckpt_s": r0["export_pyckpt_s"],
        "export_torch_s": r0["export_torch_s"],
        "export_bytes": r0["export_bytes"],
        "logits_max_abs_diff": r0["logits_max_abs_diff"],
        "checks": {d: ok for d, ok in checks},
        "losses": {k: {s: v[s] for s in sorted(v)} for k, v in losses.items()},
    }
    plot = work / "demo.png"
    _plot(plot, summary)
    (work / "summary.json").write_text(json.dumps(summary, indent=2))

    def ratio(a: float, b: float) -> str:
        return f"{b / a:.2f}x" if a > 0 else "-"

    med_p, med_d = statistics.median(summary["stall_pyckpt_s"]), statistics.median(
        summary["stall_dcp_s"])
    rows = [
        ("", "pyckpt", "DCP / torch", "DCP / pyckpt"),
        (f"stall per async_save, median of {len(stall_steps)}", f"{med_p * 1e3:.1f} ms",
         f"{med_d * 1e3:.1f} ms", ratio(med_p, med_d)),
        (f"bytes on disk (step {last}; raw {summary['bytes_raw'] / 2**20:.1f} MiB)",
         f"{summary['bytes_pyckpt'] / 2**20:.1f} MiB", f"{summary['bytes_dcp'] / 2**20:.1f} MiB",
         ratio(summary["bytes_pyckpt"], summary["bytes_dcp"])),
        ("time to resume (load + set_state_dict)", f"{summary['load_pyckpt_s']:.3f} s",
         f"{summary['load_dcp_s']:.3f} s", ratio(summary["load_pyckpt_s"], summary["load_dcp_s"])),
        (f"export to safetensors ({summary['export_bytes'] / 2**20:.1f} MiB)",
         f"{summary['export_pyckpt_s']:.3f} s", f"{summary['export_torch_s']:.3f} s",
         ratio(summary["export_pyckpt_s"], summary["export_torch_s"])),
    ]
    print()
    print(_table(rows))
    print("  pyckpt: pyckpt.Writer(compression='zstd') / pyckpt.Reader / pyckpt.consolidate on "
          f"{WORLD_SIZE} ranks; DCP: FileSystemWriter() defaults / FileSystemReader / torch's "
          "consolidate_safetensors_files on a HuggingFaceStorageWriter save (1 process).")
    print("  Exports: no fsync on either side (torch's consolidator never fsyncs). "
          f"Measured once, same run, on a machine with {os.cpu_count()} CPUs.")
    print()
    for desc, ok in checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {desc}")
    print(f"  [{'ok' if r0.get('export_matches_torch') else 'FAILED'}] export equals torch's "
          "consolidated safetensors")
    print(f"  [{'ok' if r0.get('logits_exact') else 'FAILED'}] transformers logits equal the "
          f"trained model's (max |diff| {summary['logits_max_abs_diff']:.3g})")
    print()
    print(f"plot: {plot}")
    print(f"summary: {work / 'summary.json'}")
    print(f"demo time: {time.perf_counter() - t_start:.0f} s")
    print(f"resumed bit-identical: {'yes' if resumed_ok else 'no'}")
    print(f"export loads in transformers: {'yes' if export_ok else 'no'}")
    return 0 if resumed_ok and export_ok else 1


if __name__ == "__main__":
    sys.exit(main())
