"""pyckpt end-to-end demo: train, checkpoint with CheckpointManager, lose a node, resume
bit-identically from the peers' replicas, export.

Two local processes (gloo on 127.0.0.1) train a small Llama-style causal LM (``transformers``
``LlamaForCausalLM``, random init, no downloads) with FSDP2 ``fully_shard`` and AdamW on seeded
synthetic tokens. Each process is one "node" (torchrun's ``GROUP_RANK`` 0 and 1, one rank per
node) and checkpoints model + optimizer with ``pyckpt.CheckpointManager``: every ``--save-every``
steps into the fast tier (each node's own directory, ``fast/node-{node}``, with a replica of its
files on the other node), every ``--persist-every`` steps also into the durable tier
(``durable/``) in the background. The driver (this script without ``--worker``) runs three
phases, each a fresh pair of worker processes:

1. reference: an uninterrupted run. At every save step it saves three ways, one after the other
   (the order rotating), and records the training stall of each: the time until training can
   continue (``CheckpointManager.save``; ``dcp.async_save`` into ``pyckpt.Writer(compression=
   "zstd")``; ``dcp.async_save`` into DCP's own ``FileSystemWriter``).
2. node loss: a new run from scratch with the manager only. After step ``--kill-at`` (its
   checkpoint work finished, so what each tier holds is deterministic) the driver SIGKILLs node
   1's process and deletes node 1's fast-tier directory, then, as torchrun's agent would, stops
   node 0.
3. resume: both nodes restart (node 1 with an empty fast tier) and ``CheckpointManager.restore``
   loads the newest step complete in any tier: the newest fast-tier step, newer than the newest
   durable one, node 1's pieces coming from node 0's replicas over the process group. Each rank
   reports where its restored bytes came from (local / peer / durable); the durable bytes must be
   0. The restore is timed against DCP loading its reference checkpoint of the same step into a
   second copy of the model (which must hold the identical state). The run then trains to the end
   and exports the model: a model-only pyckpt checkpoint consolidated by ``pyckpt.consolidate``
   over both ranks into Hugging Face safetensors, timed against torch's
   ``consolidate_safetensors_files`` on a DCP ``HuggingFaceStorageWriter`` save of the same
   model; ``pyckpt.consolidate`` of those same DCP-HF shards over both ranks is timed too (the
   export without decoding and verifying a compressed input). Rank 0 writes config.json, loads the export with ``LlamaForCausalLM.from_pretrained``
   and compares its logits with the trained model's.

Training is deterministic (``torch.use_deterministic_algorithms``, fixed seeds, one thread per
process, each batch a function of the step index, no dropout), so every loss logged after the
resume must equal the reference run's bit for bit (compared as float hex). The driver prints a
table, writes a PNG plot and ``summary.json`` into the work directory, and ends with
``resumed bit-identical: yes|no`` and ``export loads in transformers: yes|no`` (exit status 1
when a check fails). No root and no mount namespaces: the two "nodes" share this machine's file
system, each with its own fast-tier directory.

    python examples/train.py [--workdir DIR] [--size small|tiny] [--steps N] [--save-every K]
                             [--persist-every P] [--kill-at S] [--no-progress]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORLD_SIZE = 2  # two "nodes" of one rank each
VICTIM_RANK = 1  # the node lost in the middle of the run (its rank is its node id)
WRITERS = ("manager", "pyckpt", "dcp")  # the saves compared in the reference run
EXPORT_REPEATS = 15  # timed runs of each export after the first (a run is ~10 ms: the medians need many)


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
    save_every: int  # fast-tier saves
    persist_every: int  # durable-tier copies (a multiple of save_every)
    kill_at: int  # node 1 is lost after this step


SIZES = {
    # ~5.3 M parameters; fp32 model + AdamW state ~61 MiB.
    "small": Size(vocab=4096, hidden=256, intermediate=688, layers=4, heads=8, kv_heads=4,
                  seq=64, batch=8, steps=60, save_every=5, persist_every=20, kill_at=47),
    # For tests: a few thousand parameters, a dozen steps.
    "tiny": Size(vocab=128, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2,
                 seq=16, batch=4, steps=12, save_every=3, persist_every=6, kill_at=10),
}


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def expected_resume(size: Size) -> tuple[int, int]:
    """(the step a restore after losing a node at ``kill_at`` must pick: the newest fast-tier
    step, the newest durable step at that point)."""
    fast = size.kill_at - size.kill_at % size.save_every
    return fast, size.kill_at - size.kill_at % size.persist_every


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def manager_paths(work: Path, phase: str) -> tuple[Path, str]:
    """(durable tier, fast tier with ``{node}``) of a phase; the resume reuses the run's."""
    root = work / ("ref" if phase == "reference" else "run")
    return root / "durable", str(root / "fast" / "node-{node}")


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
    # DCP's async_save runs its collectives in a background thread: give them their own group
    # so they never interleave with the training collectives of the main thread (the manager
    # makes groups of its own for the same reason).
    ckpt_pg = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (world,))
    # Bars only on a terminal: a log file or a pipe would get every redraw (one huge line).
    show = rank == 0 and cfg["progress"] and sys.stderr.isatty()

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
    durable, local = manager_paths(work, phase)
    # The fast tier on each node (here: one directory per node on this machine's disk; on a
    # cluster the same path on every node, e.g. /dev/shm/pyckpt), one replica of every node's
    # files on another node, the durable tier every persist_every steps.
    mgr = pyckpt.CheckpointManager(
        durable, local=local, replicas=1, save_every=size.save_every,
        persist_every=size.persist_every, keep_local=2, keep_durable=2, compression="zstd")
    start = 0

    def local_part(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            out: dict[str, Any] = {}
            for k, v in tree.items():
                out.update(leaves(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: tree}

    if phase == "resume":
        from torch.distributed.checkpoint import FileSystemReader

        def timed(m: Any, o: Any, load: Any) -> tuple[float, Any]:
            dist.barrier()
            t0 = time.perf_counter()
            msd, osd = get_state_dict(m, o)
            state = {"model": msd, "optim": osd, "step": -1}
            got = load(state)
            set_state_dict(m, o, model_state_dict=msd, optim_state_dict=osd)
            return time.perf_counter() - t0, (got, state["step"])

        # The newest complete step, read from this node's fast tier and the peers' replicas.
        # For comparison, DCP's checkpoint of the same step from the reference run goes into a
        # second copy of the model. Each is loaded twice, alternating, and the faster load
        # counts: the first load in a process pays one-time costs whichever method comes first.
        ref_model, ref_opt = build()
        times: dict[str, list[float]] = {"dcp": [], "manager": []}
        infos = []
        step = None
        for _ in range(2):
            seconds, (step, loaded) = timed(model, opt, mgr.restore)
            if step is None:
                raise SystemExit(f"no complete checkpoint in {local} or {durable}")
            if loaded != step:
                raise RuntimeError(f"restored step {step}, but the state holds step {loaded}")
            times["manager"].append(seconds)
            infos.append(dataclasses.asdict(mgr.last_restore))
            dcp_path = work / "ref" / "dcp" / step_name(step)

            def dcp_load(state: Any, path: Path = dcp_path) -> int:
                dcp.load(state, checkpoint_id=path, storage_reader=FileSystemReader(path))
                return int(state["step"])

            seconds, (got, _) = timed(ref_model, ref_opt, dcp_load)
            if got != step:
                raise RuntimeError(f"{dcp_path}: holds step {got}, expected {step}")
            times["dcp"].append(seconds)
        assert step is not None
        results["restores"] = infos
        results["node"] = mgr.node
        results["load_dcp_s"], results["load_pyckpt_s"] = min(times["dcp"]), min(times["manager"])
        say(f"CheckpointManager.restore: step {step} from the {infos[0]['tier']} tier")
        a = leaves(dict(zip(("model", "optim"), get_state_dict(model, opt))))
        b = leaves(dict(zip(("model", "optim"), get_state_dict(ref_model, ref_opt))))
        same = a.keys() == b.keys() and all(
            (torch.equal(local_part(a[k]), local_part(b[k])) if isinstance(a[k], torch.Tensor)
             else a[k] == b[k]) for k in a
        )
        flags = [None] * world
        dist.all_gather_object(flags, same)
        results["state_matches_dcp"] = all(flags)
        say(f"restored state equals DCP's reference checkpoint of step {step}: "
            f"{'yes' if all(flags) else 'NO'}")
        del ref_model, ref_opt
        start = results["resumed_from"] = step

    # ---------------------------------------------------------------- checkpointing
    writer = pyckpt.Writer(work / "ref" / "pyckpt", compression="zstd")  # reference run only
    pending: list[Any] = []

    def wait_pending() -> None:
        mgr.wait()
        while pending:
            f = pending.pop()
            getattr(f, "upload_completion", f).result()

    def checkpoint(step: int, index: int) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": step}
        if phase != "reference":
            t0 = time.perf_counter()
            mgr.save(step, state)  # returns once staged; the rest runs in the background
            results["stalls"].append({"step": step, "writer": "manager",
                                      "seconds": time.perf_counter() - t0})
            return
        order = list(WRITERS[index % len(WRITERS):] + WRITERS[:index % len(WRITERS)])
        for name in order:
            wait_pending()  # never measure one save while another still writes
            t0 = time.perf_counter()
            if name == "manager":
                mgr.save(step, state)
            else:
                path = work / "ref" / name / step_name(step)
                w = writer if name == "pyckpt" else FileSystemWriter(path)
                pending.append(dcp.async_save(state, checkpoint_id=path, storage_writer=w,
                                              process_group=ckpt_pg))
            results["stalls"].append({"step": step, "writer": name,
                                      "seconds": time.perf_counter() - t0})

    def lose_this_node(step: int) -> None:
        """Node 1 at the kill step: finish its checkpoint work, tell the driver, wait for the
        SIGKILL (the driver then deletes this node's fast tier)."""
        mgr.wait()
        marker = work / "kill.marker"
        marker.with_suffix(".tmp").write_text(json.dumps(
            {"step": step, "node": mgr.node, "tiers": mgr.steps(),
             "fast_dir": local.replace("{node}", mgr.node)}))
        marker.with_suffix(".tmp").rename(marker)
        time.sleep(cfg["timeout"])  # the driver SIGKILLs this process now
        raise RuntimeError("node loss: the driver did not kill this worker")

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
            if step % size.save_every == 0:
                checkpoint(step, step // size.save_every)
            if phase == "crash" and step == size.kill_at and rank == VICTIM_RANK:
                lose_this_node(step)
    wait_pending()
    mgr.close()
    writer.close()

    if phase == "resume":
        results.update(_export(cfg, config, model, batch, rank, show, say))
    (work / "results" / f"{phase}-rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _read_through(path: Path) -> None:
    """Reads a file into the page cache in 128 KiB reads, as ``cat`` and pyckpt do. One read of
    the whole file (``read_bytes()``) leaves pages it brings in as 4 KiB pages on Linux 6.18,
    which read back at half the speed of the large folios that smaller reads or a buffered
    write (torch's shards) leave (BENCHMARKS.md, "Reads in 128 KiB pieces")."""
    with open(path, "rb", buffering=0) as fh:
        while fh.read(128 << 10):
            pass


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
    # gets a model-only checkpoint (its keys are the Hugging Face parameter names). Each side
    # saves its export input and exports it at once, as a job's last step does: pyckpt a zstd
    # checkpoint, consolidated on both ranks; DCP a HuggingFaceStorageWriter save, consolidated
    # by torch's consolidate_safetensors_files (one process: it has no multi-rank mode).
    msd = get_model_state_dict(model)
    src, shards = work / "pyckpt-model", work / "dcp-hf-shards"
    hf_dir, torch_dir = work / "hf", work / "torch-consolidated"
    bar: Any = None
    if show:
        from tqdm import tqdm

        bar = tqdm(desc="   export consolidate", unit="B", unit_scale=True, dynamic_ncols=True)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    def slowest(seconds: float) -> float:  # a step is done when the slowest rank is
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    # torch's step as the job runs it: rank 0 consolidates, then a barrier, so that no rank
    # moves on before the export exists (pyckpt's call likewise returns on every rank once the
    # commit is known there). Its time is the slowest rank's, to the barrier's end; rank 0's
    # call alone is kept too (torch_calls) and printed under the table.
    torch_calls: list[float] = []

    def torch_export(dst: Path) -> float:
        t0 = time.perf_counter()
        if rank == 0:
            dst.mkdir(parents=True)
            consolidate_safetensors_files(str(shards), str(dst), dict.fromkeys(msd, 1))
            torch_calls.append(time.perf_counter() - t0)
        dist.barrier()
        return slowest(time.perf_counter() - t0)

    t0 = time.perf_counter()
    with pyckpt.Writer(src, compression="zstd") as w:
        dcp.save(msd, storage_writer=w)
    out["export_save_pyckpt_s"] = slowest(time.perf_counter() - t0)
    t0 = time.perf_counter()
    res = pyckpt.consolidate(src, hf_dir, fsync=False, progress=progress if show else None)
    out["export_first_pyckpt_s"] = slowest(time.perf_counter() - t0)
    if bar is not None:
        progress(res.total_bytes, res.total_bytes)
        bar.close()
    out["export_bytes"] = res.total_bytes
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(msd, storage_writer=HuggingFaceStorageWriter(str(shards), save_distributed=True))
    out["export_save_torch_s"] = slowest(time.perf_counter() - t0)
    out["export_first_torch_s"] = torch_export(torch_dir)
    export_first_torch_call_s = torch_calls.pop() if torch_calls else 0.0
    res_shards = pyckpt.consolidate(shards, work / "hf-from-shards", fsync=False)

    # Then each export again, EXPORT_REPEATS times in a rotating order, every run from the same
    # start: written data synced, its input read once (in the page cache, as torch's was after
    # its save), its previous output removed. A single run of a 20-30 ms operation on a shared
    # machine is mostly noise; the medians are the demo's figures.
    def pyckpt_export(input_dir: Path) -> Callable[[Path], float]:
        def run(dst: Path) -> float:
            t0 = time.perf_counter()
            pyckpt.consolidate(input_dir, dst, fsync=False)
            return slowest(time.perf_counter() - t0)
        return run

    runs: dict[str, tuple[Path, Callable[[Path], float]]] = {
        "pyckpt": (src, pyckpt_export(src)),
        "pyckpt_shards": (shards, pyckpt_export(shards)),
        "torch": (shards, torch_export),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    scratch = work / "repeats"
    for i in range(EXPORT_REPEATS):
        names = list(runs)
        for name in names[i % len(names):] + names[:i % len(names)]:
            input_dir, run = runs[name]
            if rank == 0:
                shutil.rmtree(scratch, ignore_errors=True)
                os.sync()
                for f in sorted(input_dir.iterdir()):
                    if f.is_file():
                        _read_through(f)
            dist.barrier()
            times[name].append(run(scratch))
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    for name, values in times.items():
        out[f"export_{name}_runs_s"] = values
    out["export_pyckpt_s"] = statistics.median(times["pyckpt"])
    out["export_pyckpt_shards_s"] = statistics.median(times["pyckpt_shards"])
    out["export_torch_s"] = statistics.median(times["torch"])
    if torch_calls:  # rank 0
        out["export_torch_call_runs_s"] = list(torch_calls)
        out["export_torch_call_s"] = statistics.median(torch_calls)
        out["export_first_torch_call_s"] = export_first_torch_call_s
    if rank == 0:
        from safetensors.torch import load_file
        from transformers import LlamaForCausalLM

        theirs = {}
        for f in sorted(torch_dir.glob("*.safetensors")):
            theirs.update(load_file(str(f)))
        matches = True
        for result in (res, res_shards):
            ours = {}
            for f in result.files:
                ours.update(load_file(f))
            matches = matches and ours.keys() == theirs.keys() and all(
                torch.equal(ours[k], theirs[k]) for k in ours)
        out["export_matches_torch"] = matches
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


def _stderr_log(cfg: dict[str, Any], rank: int) -> Path:
    return Path(cfg["workdir"]) / "logs" / f"{cfg['phase']}-rank{rank}.stderr"


def _launch(cfg: dict[str, Any], stderr_to_log: bool = False) -> list[subprocess.Popen[bytes]]:
    """Starts the workers; with ``stderr_to_log`` their stderr goes to ``logs/`` (the node-loss
    phase: the surviving worker's error about its lost peer is expected there)."""
    port = _free_port()
    procs = []
    for rank in range(WORLD_SIZE):
        # What torchrun sets on 2 nodes of 1 rank each: the manager's node id is GROUP_RANK.
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   GROUP_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        err = open(_stderr_log(cfg, rank), "wb") if stderr_to_log else None
        try:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
                env=env, stderr=err,
            ))
        finally:
            if err is not None:
                err.close()
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


def _run_node_loss(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs the training until node 1 reports the kill step, SIGKILLs node 1, deletes its fast
    tier, stops node 0; returns what node 1 reported (its step, tiers and fast-tier dir)."""
    marker = Path(cfg["workdir"]) / "kill.marker"
    procs = _launch(cfg, stderr_to_log=True)
    try:
        deadline = time.monotonic() + timeout
        while not marker.exists():
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    raise DemoError(f"node loss: worker {i} exited with status {p.returncode} "
                                    f"before step {cfg['size']['kill_at']} (its stderr: "
                                    f"{_stderr_log(cfg, i)})")
            if time.monotonic() > deadline:
                raise DemoError(f"node loss: timed out after {timeout:.0f} s")
            time.sleep(0.01)
        report: dict[str, Any] = json.loads(marker.read_text())
        procs[VICTIM_RANK].send_signal(signal.SIGKILL)
        procs[VICTIM_RANK].wait()
        fast = Path(report["fast_dir"])
        files = [f for f in fast.rglob("*") if f.is_file()]
        lost = sum(f.stat().st_size for f in files)
        shutil.rmtree(fast)
        print(f"  [crash] node {report['node']} held fast-tier steps {report['tiers']['local']} "
              "(its own files and node 0's replicas); durable tier: steps "
              f"{report['tiers']['durable']}", flush=True)
        print(f"  [crash] node {report['node']} SIGKILLed after step {report['step']}; its fast "
              f"tier deleted ({len(files)} files, {lost} B); stopping node 0 (its error about "
              f"the lost peer: {_stderr_log(cfg, 0)})", flush=True)
        return report
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
    a.axvline(summary["kill_at"], color="tab:red", lw=1,
              label=f"node 1 lost after step {summary['kill_at']} (SIGKILL, fast tier deleted)")
    a.axvline(summary["resumed_from"], color="tab:green", lw=1,
              label=f"resumed from step {summary['resumed_from']} (fast tier: peers' replicas)")
    a.set(title="training loss (rank 0; 1 run each)", xlabel="step", ylabel="loss")
    a.legend(fontsize=8)

    a = fig.add_subplot(grid[0, 2:])
    steps = summary["stall_steps"]
    x = list(range(len(steps)))
    ours = [v * 1e3 for v in summary["stall_manager_s"]]
    plain = [v * 1e3 for v in summary["stall_pyckpt_s"]]
    theirs = [v * 1e3 for v in summary["stall_dcp_s"]]
    w = 0.27
    for offset, values, color, label in (
        (-w, ours, blue, "CheckpointManager.save (fast tier, zstd)"),
        (0.0, plain, "#aec7e8", "async_save, pyckpt.Writer zstd"),
        (w, theirs, orange, "async_save, DCP FileSystemWriter"),
    ):
        bars = a.bar([i + offset for i in x], values, w, color=color, label=label)
        a.bar_label(bars, [f"{v:.1f}" for v in values], fontsize=7)
    top = max(ours + plain + theirs + [1e-9])
    for i, (p, d) in enumerate(zip(ours, theirs)):  # the ratio above each group
        a.text(i, 1.12 * max(p, plain[i], d), f"{d / p:.2f}x" if p > 0 else "-",
               ha="center", fontsize=8, fontweight="bold")
    a.set_ylim(0, 1.3 * top)
    a.set_xticks(x, [str(s) for s in steps])
    a.set(title=f"training stall per save (max over ranks; {len(steps)} saves, 1 run "
                "each)\nabove each group: DCP / manager", xlabel="checkpoint step", ylabel="ms")
    a.legend(loc="upper left", fontsize=8)

    a = fig.add_subplot(grid[1, :2])
    mib = [summary["bytes_pyckpt"] / 2**20, summary["bytes_dcp"] / 2**20]
    bars = a.bar(["pyckpt zstd\n(durable tier)", "DCP"], mib, color=[blue, orange])
    a.bar_label(bars, [f"{v:.1f}" for v in mib])
    raw = summary["bytes_raw"] / 2**20
    a.axhline(raw, color="0.3", ls="--", lw=1, label="raw tensor bytes")
    a.set_ylim(0, 1.25 * max(mib + [raw]))  # room for the legend
    a.set(title=f"checkpoint on disk (step {summary['bytes_step']})", ylabel="MiB")
    a.legend(loc="upper right")

    # Resume and export on axes of their own: their scales differ by an order of magnitude.
    shards_s = summary.get("export_pyckpt_shards_s")
    for col, title, ours_s, theirs_s, theirs_label, extra in (
        (2, "resume (restore + set_state_dict)", summary["load_pyckpt_s"],
         summary["load_dcp_s"], "DCP", None),
        (3, f"export to safetensors ({summary.get('export_bytes', 0) / 2**20:.1f} MiB)",
         summary["export_pyckpt_s"], summary["export_torch_s"], "torch",
         None if shards_s is None else ("pyckpt from\ntorch's input", shards_s)),
    ):
        a = fig.add_subplot(grid[1, col])
        names, values, colors = ["pyckpt", theirs_label], [ours_s, theirs_s], [blue, orange]
        if extra is not None:  # the export from the same plain shards torch reads
            names.insert(1, extra[0])
            values.insert(1, extra[1])
            colors.insert(1, "#9ecae1")
            names[0] = "pyckpt from\nits zstd ckpt"
        bars = a.bar(names, values, color=colors)
        a.bar_label(bars, [f"{v:.3f}" for v in values], fontsize=8)
        a.tick_params(axis="x", labelsize=7)
        lines = [title, f"{theirs_label} / pyckpt "
                        + (f"{theirs_s / ours_s:.2f}x" if ours_s > 0 else "-")]
        a.set_ylim(0, 1.25 * max(*values, 1e-9))
        if extra is not None and extra[1] > 0:
            lines.append(f"from torch's input {theirs_s / extra[1]:.2f}x")
        lines.append("(1 run)" if extra is None else
                     f"(median of {len(summary['export_runs_s']['torch'])} runs)")
        a.set(title="\n".join(lines), ylabel="s")
        a.title.set_fontsize(9)

    fig.suptitle(f"pyckpt demo: {summary['params'] / 1e6:.2f} M-parameter Llama, FSDP2 on "
                 f"{WORLD_SIZE} nodes x 1 gloo process; CheckpointManager: fast tier every "
                 f"{summary['save_every']} steps (1 replica), durable every "
                 f"{summary['persist_every']}")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="pyckpt-demo",
                    help="work directory (checkpoints, exports, plot); default ./pyckpt-demo")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--save-every", type=int, default=None,
                    help="fast-tier save every K steps")
    ap.add_argument("--persist-every", type=int, default=None,
                    help="durable-tier copy every P steps (a multiple of --save-every)")
    ap.add_argument("--kill-at", type=int, default=None,
                    help="node 1 is lost after this step (not a multiple of --persist-every)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="per phase, seconds")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bars (they are drawn only when stderr is a terminal)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return _worker(json.loads(args.worker))

    size = SIZES[args.size]
    size = dataclasses.replace(
        size,
        steps=args.steps or size.steps,
        save_every=args.save_every or size.save_every,
        persist_every=args.persist_every or size.persist_every,
        kill_at=args.kill_at or size.kill_at,
    )
    if size.persist_every % size.save_every:
        ap.error("--persist-every must be a multiple of --save-every")
    if not size.save_every <= size.kill_at < size.steps:
        ap.error("--kill-at must come after the first save and before the last step")
    fast_step, durable_step = expected_resume(size)
    if fast_step == durable_step:
        ap.error("--kill-at must leave a fast-tier step newer than the newest durable one (the "
                 "demo shows the restore from the peers' replicas)")

    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    for sub in ("ref", "run", "export", "logs", "results"):
        shutil.rmtree(work / sub, ignore_errors=True)
    for sub in ("logs", "results"):
        (work / sub).mkdir()
    (work / "kill.marker").unlink(missing_ok=True)
    base = {"size": dataclasses.asdict(size), "workdir": str(work), "seed": args.seed,
            "timeout": args.timeout, "progress": not args.no_progress}

    t_start = time.perf_counter()
    print(f"pyckpt demo in {work}: {WORLD_SIZE} nodes x 1 process, {size.steps} steps, "
          f"CheckpointManager: fast tier every {size.save_every} steps with 1 replica, durable "
          f"every {size.persist_every}; node {VICTIM_RANK} lost after step {size.kill_at}",
          flush=True)
    try:
        print("1/3 reference run (uninterrupted; at every save step: CheckpointManager.save, "
              "pyckpt and DCP async_save)", flush=True)
        _run_phase(dict(base, phase="reference"), args.timeout)
        print(f"2/3 training run with CheckpointManager, node {VICTIM_RANK} lost after step "
              f"{size.kill_at}", flush=True)
        kill = _run_node_loss(dict(base, phase="crash"), args.timeout)
        print(f"3/3 restart both nodes (node {VICTIM_RANK} with an empty fast tier), restore, "
              "finish, export", flush=True)
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
        checks.append((f"rank {rank}: losses of the run that lost a node equal the reference "
                       "run's", losses_match(ref, crash, sorted(crash) or [1])))
    checks.append(("restored state equals DCP's checkpoint of the same step",
                   all(res[("resume", r)]["state_matches_dcp"] for r in range(WORLD_SIZE))))
    restores = [(r, i) for r in range(WORLD_SIZE) for i in res[("resume", r)]["restores"]]
    checks.append((f"restored step {fast_step} from the fast tier, the newest complete step "
                   f"(durable tier's newest: {durable_step}; node {VICTIM_RANK} held "
                   f"{kill['tiers']['local']} before it was lost)",
                   resumed_from == fast_step
                   and kill["tiers"]["durable"][-1:] == ([durable_step] if durable_step else [])
                   and all(i["step"] == fast_step and i["tier"] == "fast" for _, i in restores)))
    checks.append((f"node {VICTIM_RANK} (fast tier deleted) restored every byte from peers' "
                   "replicas", all(i["bytes_local"] == 0 and i["bytes_peer"] > 0
                                   for r, i in restores if r == VICTIM_RANK)))
    durable_read = sum(i["bytes_durable"] for _, i in restores)
    checks.append((f"bytes read from the durable tier by the restores: {durable_read}",
                   durable_read == 0))
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

    st_m, st_p, st_d = (per_step("reference", w) for w in WRITERS)
    stall_steps = sorted(st_m)
    # Bytes on disk: the manager's durable copy of its last persisted step (a plain pyckpt
    # checkpoint) against DCP's checkpoint of the same step.
    last = max(s for s in stall_steps if s % size.persist_every == 0)
    ref_root = work / "ref"
    summary: dict[str, Any] = {
        "params": r0["params"],
        "save_every": size.save_every,
        "persist_every": size.persist_every,
        "kill_at": size.kill_at,
        "resumed_from": resumed_from,
        "durable_newest_at_kill": durable_step,
        "restore_sources": {
            str(r): {k: res[("resume", r)]["restores"][0][k]
                     for k in ("tier", "bytes_local", "bytes_peer", "bytes_durable")}
            for r in range(WORLD_SIZE)},
        "durable_bytes_read": durable_read,
        "stall_steps": stall_steps,
        "stall_manager_s": [st_m[s] for s in stall_steps],
        "stall_pyckpt_s": [st_p[s] for s in stall_steps],
        "stall_dcp_s": [st_d[s] for s in stall_steps],
        "bytes_step": last,
        "bytes_pyckpt": dir_bytes(ref_root / "durable" / f"step-{last}"),
        "bytes_dcp": dir_bytes(ref_root / "dcp" / step_name(last)),
        # fp32 model + AdamW exp_avg + exp_avg_sq (the step counters are a few bytes more)
        "bytes_raw": r0["params"] * 4 * 3,
        "load_pyckpt_s": max(res[("resume", r)]["load_pyckpt_s"] for r in range(WORLD_SIZE)),
        "load_dcp_s": max(res[("resume", r)]["load_dcp_s"] for r in range(WORLD_SIZE)),
        "export_pyckpt_s": r0["export_pyckpt_s"],
        "export_torch_s": r0["export_torch_s"],
        "export_pyckpt_shards_s": r0["export_pyckpt_shards_s"],
        "export_runs_s": {k: r0[f"export_{k}_runs_s"] for k in ("pyckpt", "pyckpt_shards", "torch")},
        "export_first_pyckpt_s": r0["export_first_pyckpt_s"],
        "export_first_torch_s": r0["export_first_torch_s"],
        "export_torch_call_s": r0["export_torch_call_s"],
        "export_torch_call_runs_s": r0["export_torch_call_runs_s"],
        "export_first_torch_call_s": r0["export_first_torch_call_s"],
        "export_save_pyckpt_s": r0["export_save_pyckpt_s"],
        "export_save_torch_s": r0["export_save_torch_s"],
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

    med_m, med_p, med_d = (statistics.median(summary[f"stall_{w}_s"]) for w in WRITERS)
    first_p = summary["export_save_pyckpt_s"] + summary["export_first_pyckpt_s"]
    first_t = summary["export_save_torch_s"] + summary["export_first_torch_s"]
    rows = [
        ("", "pyckpt", "DCP / torch", "DCP / pyckpt"),
        (f"stall per save, median of {len(stall_steps)}: CheckpointManager.save",
         f"{med_m * 1e3:.1f} ms", f"{med_d * 1e3:.1f} ms", ratio(med_m, med_d)),
        ("  the same: pyckpt async_save (no replicas)", f"{med_p * 1e3:.1f} ms",
         f"{med_d * 1e3:.1f} ms", ratio(med_p, med_d)),
        (f"bytes on disk (durable step {last}; raw {summary['bytes_raw'] / 2**20:.1f} MiB)",
         f"{summary['bytes_pyckpt'] / 2**20:.1f} MiB", f"{summary['bytes_dcp'] / 2**20:.1f} MiB",
         ratio(summary["bytes_pyckpt"], summary["bytes_dcp"])),
        ("time to resume (restore + set_state_dict)", f"{summary['load_pyckpt_s']:.3f} s",
         f"{summary['load_dcp_s']:.3f} s", ratio(summary["load_pyckpt_s"], summary["load_dcp_s"])),
        (f"export to safetensors ({summary['export_bytes'] / 2**20:.1f} MiB), median of "
         f"{EXPORT_REPEATS}", f"{summary['export_pyckpt_s']:.3f} s",
         f"{summary['export_torch_s']:.3f} s",
         ratio(summary["export_pyckpt_s"], summary["export_torch_s"])),
        ("  the same, from torch's input (its DCP-HF shards)",
         f"{summary['export_pyckpt_shards_s']:.3f} s", f"{summary['export_torch_s']:.3f} s",
         ratio(summary["export_pyckpt_shards_s"], summary["export_torch_s"])),
        ("  save for export + first export (1 run)", f"{first_p:.3f} s", f"{first_t:.3f} s",
         ratio(first_p, first_t)),
    ]
    print()
    for r in range(WORLD_SIZE):
        src = summary["restore_sources"][str(r)]
        print(f"restore sources, rank {r} (node {r}): local {src['bytes_local']} B, peer "
              f"{src['bytes_peer']} B, durable {src['bytes_durable']} B ({src['tier']} tier)")
    print(f"durable bytes read: {durable_read}")
    print()
    print(_table(rows))
    print("  pyckpt: CheckpointManager(compression='zstd', replicas=1) save / restore (node 0's "
          "fast tier + its replica of node 1's files), pyckpt.Writer(compression='zstd') "
          f"async_save, pyckpt.consolidate on {WORLD_SIZE} ranks from its zstd checkpoint "
          "(decoded and verified) and from torch's input; DCP: async_save into "
          "FileSystemWriter() defaults / FileSystemReader / torch's consolidate_safetensors_files "
          "on a HuggingFaceStorageWriter save (1 process).")
    runs = summary["export_runs_s"]

    def span(values: list[float]) -> str:
        return f"{min(values):.3f}-{max(values):.3f} s"

    print(f"  Exports: no fsync on either side (torch's consolidator never fsyncs); each run from "
          f"its input in the page cache; {EXPORT_REPEATS} runs each, order rotating: pyckpt "
          f"{span(runs['pyckpt'])}, from torch's input {span(runs['pyckpt_shards'])}, torch "
          f"{span(runs['torch'])}. The first export follows its own save: pyckpt "
          f"{summary['export_save_pyckpt_s']:.3f} s + {summary['export_first_pyckpt_s']:.3f} s "
          "(reading its checkpoint from the disk: its saves use O_DIRECT and leave nothing in the "
          f"page cache), DCP {summary['export_save_torch_s']:.3f} s + "
          f"{summary['export_first_torch_s']:.3f} s (its input in the page cache).")
    call = summary["export_torch_call_s"]
    print(f"  torch's export times run to the barrier after its call, the step a 2-rank job runs "
          f"(pyckpt's end when every rank has heard the commit). Its call alone, on rank 0: "
          f"{call:.3f} s ({span(summary['export_torch_call_runs_s'])}; pyckpt "
          f"{ratio(summary['export_pyckpt_s'], call)} of that, from torch's input "
          f"{ratio(summary['export_pyckpt_shards_s'], call)}), first export "
          f"{summary['export_first_torch_call_s']:.3f} s.")
    print(f"  Everything else measured once. Same run, on a machine with {os.cpu_count()} CPUs.")
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
