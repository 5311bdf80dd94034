"""Lightning checkpoints: pyckpt against Lightning's own checkpointing, in the same run.

Two paths, each with a small MLP trained one step (so AdamW's moments exist) on CPU:

* ``--path io`` (one process, the default strategy): ``trainer.save_checkpoint`` with
  Lightning's ``TorchCheckpointIO`` (one ``torch.save`` file) against
  :class:`pyckpt.integrations.lightning.PyckptCheckpointIO` (raw and zstd), by switching the
  trainer's ``checkpoint_io`` between saves;
* ``--path model_parallel`` (``--ranks`` CPU ranks, gloo, FSDP2 over the data-parallel mesh):
  ``ModelParallelStrategy``'s distributed checkpoint (DCP's ``FileSystemWriter``) against
  :class:`~pyckpt.integrations.lightning.PyckptModelParallelStrategy` (raw and zstd), both
  called on the same strategy with a freshly dumped checkpoint dict.

Reported per writer: the blocking time of a save (``trainer.save_checkpoint``: the checkpoint
dict is dumped and written; every save here is synchronous, so blocking = whole save; the
slowest rank's) and the bytes on disk, median [min-max] over ``--repeats`` rounds whose order
of writers rotates. pyckpt fsyncs its files (``PYCKPT_FSYNC``, default on); Lightning's and
DCP's writers do not fsync by default, so pyckpt's times include work the baselines skip.

    python benchmarks/integration_lightning.py                          # ~1 min on 2 cores
    python benchmarks/integration_lightning.py --path model_parallel --hidden 2048
    python benchmarks/integration_lightning.py --hidden 4096 --repeats 5 --json out.json
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
import warnings
from typing import Any

WRITERS = ("lightning", "pyckpt", "pyckpt-zstd")


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _model(hidden: int, parallel: bool) -> Any:
    import lightning.pytorch as pl
    import torch

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                           torch.nn.Linear(hidden, hidden))

        def configure_model(self) -> None:
            if parallel:
                from torch.distributed.fsdp import fully_shard

                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, idx: int) -> Any:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return MLP()


def _train_one_step(hidden: int, strategy: Any, devices: int, parallel: bool) -> Any:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.randn(8 * devices, hidden)), batch_size=8)
    trainer.fit(_model(hidden, parallel), data)
    return trainer


def _bench_io(args: argparse.Namespace, work: str) -> dict[str, Any]:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from pyckpt.integrations.lightning import PyckptCheckpointIO

    trainer = _train_one_step(args.hidden, "auto", 1, False)
    ios = {"lightning": TorchCheckpointIO(), "pyckpt": PyckptCheckpointIO(),
           "pyckpt-zstd": PyckptCheckpointIO(compression="zstd")}
    times: dict[str, list[float]] = {w: [] for w in WRITERS}
    sizes: dict[str, list[float]] = {w: [] for w in WRITERS}
    for r in range(args.repeats):
        for w in WRITERS[r % 3:] + WRITERS[:r % 3]:
            trainer.strategy.checkpoint_io = ios[w]
            path = os.path.join(work, f"{w}-{r}.ckpt")
            start = time.perf_counter()
            trainer.save_checkpoint(path, weights_only=False)
            times[w].append(time.perf_counter() - start)
            sizes[w].append(_du(path))
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    return {"times": times, "sizes": sizes}


def _bench_model_parallel_rank(args: argparse.Namespace, work: str) -> dict[str, Any]:
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    from pyckpt.integrations.lightning import PyckptModelParallelStrategy

    ranks = int(os.environ["WORLD_SIZE"])
    strategy = PyckptModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1)
    trainer = _train_one_step(args.hidden, strategy, ranks, True)

    def save(writer: str, path: str) -> None:
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(False)
        if writer == "lightning":
            ModelParallelStrategy.save_checkpoint(strategy, checkpoint, path)
        else:
            strategy.writer_options = {"compression": "zstd"} if writer == "pyckpt-zstd" else {}
            strategy.save_checkpoint(checkpoint, path)
        strategy.barrier("bench")

    times: dict[str, list[float]] = {w: [] for w in WRITERS}
    sizes: dict[str, list[float]] = {w: [] for w in WRITERS}
    for r in range(args.repeats):
        for w in WRITERS[r % 3:] + WRITERS[:r % 3]:
            path = os.path.join(work, f"{w}-{r}")
            strategy.barrier("bench")
            start = time.perf_counter()
            save(w, path)
            elapsed = [0.0] * ranks
            dist.all_gather_object(elapsed, time.perf_counter() - start)
            times[w].append(max(elapsed))
            if strategy.global_rank == 0:
                sizes[w].append(_du(path))
                shutil.rmtree(path)
            strategy.barrier("bench")
    return {"times": times, "sizes": sizes}


def _launch_ranks(args: argparse.Namespace, work: str, argv: list[str]) -> dict[str, Any]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from _ports import free_port

    port = free_port()
    out = os.path.join(work, "result.json")
    procs = []
    for rank in range(args.ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                   NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYCKPT_BENCH_RANK_OUT=out, PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv,
                                       "--work", work], env=env))
    try:
        for p in procs:
            if p.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"a rank failed (exit {p.returncode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    with open(out) as f:
        result: dict[str, Any] = json.load(f)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", choices=("io", "model_parallel"), default="io")
    parser.add_argument("--hidden", type=int, default=1024,
                        help="MLP width: 2 hidden x hidden layers (default 1024: 8 MiB of "
                             "weights, 24 MiB with AdamW's moments)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of --path model_parallel")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", default=None, help="directory for the checkpoints")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    rank_out = os.environ.get("PYCKPT_BENCH_RANK_OUT")
    if rank_out is not None:  # one rank of --path model_parallel
        assert args.work is not None
        result = _bench_model_parallel_rank(args, args.work)
        if int(os.environ["RANK"]) == 0:
            with open(rank_out, "w") as f:
                json.dump(result, f)
        return 0

    own_work = args.work is None
    work = args.work or tempfile.mkdtemp(prefix="pyckpt-bench-lightning-")
    try:
        if args.path == "io":
            result = _bench_io(args, work)
        else:
            child_argv = [a for a in (argv if argv is not None else sys.argv[1:])]
            result = _launch_ranks(args, work, child_argv)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    report = {"path": args.path, "hidden": args.hidden, "repeats": args.repeats,
              "ranks": args.ranks if args.path == "model_parallel" else 1,
              "blocking_s": {w: _summary(result["times"][w]) for w in WRITERS},
              "bytes": {w: _summary(result["sizes"][w]) for w in WRITERS}}
    print(f"Lightning {args.path}, hidden={args.hidden}, ranks={report['ranks']}, "
          f"{args.repeats} rounds: median [min-max]")
    for w in WRITERS:
        t, b = report["blocking_s"][w], report["bytes"][w]
        print(f"  {w:12s} blocking {t['median'] * 1e3:8.1f} ms [{t['min'] * 1e3:.1f}-"
              f"{t['max'] * 1e3:.1f}]   on disk {b['median'] / 2**20:8.2f} MiB "
              f"[{b['min'] / 2**20:.2f}-{b['max'] / 2**20:.2f}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
