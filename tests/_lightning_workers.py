"""One rank of the Lightning tests (tests/test_integration_lightning.py), launched as a script.

    python _lightning_workers.py SCENARIO OUT_DIR     # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* set

Each scenario trains a tiny model for two epochs with a checkpoint after every epoch, then
resumes a new Trainer from the first epoch's checkpoint, for pyckpt and for Lightning's own
checkpointing, and writes ``OUT_DIR/<scenario>-<rank>.json``: the losses of every run and what
the checkpoints hold.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")  # Lightning's advice on CPU runs (num_workers, ...)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy  # noqa: E402

import pyckpt  # noqa: E402
from pyckpt.integrations.lightning import (  # noqa: E402
    PyckptCheckpointIO,
    PyckptFSDPStrategy,
    PyckptModelParallelStrategy,
)

EPOCHS = 2
# Read once: Lightning's teardown removes WORLD_SIZE from the environment.
WORLD = int(os.environ["WORLD_SIZE"])
RANK = int(os.environ["RANK"])


def data() -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 16, generator=gen)  # 2 steps per epoch on each of 2 ranks
    y = x @ torch.randn(16, 4, generator=gen) + 0.1 * torch.randn(32, 4, generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


class Tiny(pl.LightningModule):
    def __init__(self, parallel: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.parallel = parallel
        torch.manual_seed(0)
        # The sharded runs hold a BatchNorm: FSDP2 leaves its running statistics to each rank.
        norm = [torch.nn.BatchNorm1d(32)] if parallel else []
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), *norm, torch.nn.Tanh(),
                                       torch.nn.Linear(32, 4))
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.parallel:  # ModelParallelStrategy: shard with FSDP2 over the data-parallel mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A user's tensor beside the model and optimizers: it must come back as saved.
        checkpoint["extra"] = torch.arange(3.0) + self.current_epoch

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        extra = checkpoint["extra"]
        self.loaded_extra = repr(extra) if extra.is_meta else extra.tolist()


def trainer(strategy: Any, ckpt_dir: str | None, plugins: list[Any] | None = None) -> pl.Trainer:
    callbacks = [] if ckpt_dir is None else [
        ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)]
    return pl.Trainer(accelerator=os.environ.get("PYCKPT_TEST_ACCELERATOR", "cpu"),
                      devices=WORLD, strategy=strategy, plugins=plugins,
                      max_epochs=EPOCHS, callbacks=callbacks, logger=False,
                      enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)


def run(make_strategy: Any, ckpt_dir: str, plugins: Any = None, parallel: bool = False
        ) -> dict[str, Any]:
    """Two epochs with a checkpoint per epoch, then a new Trainer resumed from the first."""
    full = Tiny(parallel)
    trainer(make_strategy(), ckpt_dir, plugins() if plugins else None).fit(full, data())
    first = os.path.join(ckpt_dir, sorted(os.listdir(ckpt_dir))[0])
    resumed = Tiny(parallel)
    again = trainer(make_strategy(), None, plugins() if plugins else None)
    again.fit(resumed, data(), ckpt_path=first)
    out = {"full": full.losses, "resumed": resumed.losses, "first": first,
           "extra": getattr(resumed, "loaded_extra", None)}
    options = getattr(again.strategy, "writer_options", None)
    if options is not None:  # a pyckpt strategy: a save refused by the writer, as the user sees it
        options["overwrite"] = False
        try:
            again.save_checkpoint(first)
        except Exception as e:
            out["refused"] = type(e).__name__
    return out


def stored(path: str) -> dict[str, Any]:
    """What a plain pyckpt.load of the checkpoint (no Lightning) finds in it."""
    is_pyckpt = os.path.isfile(os.path.join(path, "pyckpt.json"))
    out: dict[str, Any] = {"pyckpt": is_pyckpt,
                           "meta_pt": os.path.isfile(os.path.join(path, "meta.pt"))}
    if is_pyckpt:
        reader = pyckpt.Reader(path)
        keys = sorted(reader.read_metadata().state_dict_metadata)
        out["keys"] = keys
    return out


def ddp() -> dict[str, Any]:
    out_dir = sys.argv[2]
    res = {"pyckpt": run(DDPStrategy, os.path.join(out_dir, "ddp-pyckpt"),
                         plugins=lambda: [PyckptCheckpointIO(compression="zstd")]),
           "lightning": run(DDPStrategy, os.path.join(out_dir, "ddp-lightning"))}
    first = res["pyckpt"]["first"]
    res["stored"] = stored(first)
    # A plain pyckpt.load (one process) of weights and optimizer moments.
    if RANK == 0:
        model = Tiny()
        sd = {"state_dict": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
        ref = torch.load(os.path.join(res["lightning"]["first"]), weights_only=True)
        pyckpt_ck = PyckptCheckpointIO().load_checkpoint(first)
        res["equal_to_lightning"] = all(
            torch.equal(pyckpt_ck["state_dict"][k], ref["state_dict"][k]) for k in sd["state_dict"])
        res["opt_equal"] = all(
            torch.equal(pyckpt_ck["optimizer_states"][0]["state"][i][m],
                        ref["optimizer_states"][0]["state"][i][m])
            for i in ref["optimizer_states"][0]["state"] for m in ("exp_avg", "exp_avg_sq"))
        res["meta_equal"] = (pyckpt_ck["epoch"], pyckpt_ck["global_step"],
                             sorted(pyckpt_ck)) == (ref["epoch"], ref["global_step"], sorted(ref))
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, storage_reader=pyckpt.Reader(first, cooperative=False),
                     planner=pyckpt.LoadPlanner(), no_dist=True)
        res["plain_load"] = all(torch.equal(sd["state_dict"][k], ref["state_dict"][k])
                                for k in sd["state_dict"])
    return res


def fsdp() -> dict[str, Any]:
    out_dir = sys.argv[2]
    res = {"pyckpt": run(lambda: PyckptFSDPStrategy(compression="zstd"),
                         os.path.join(out_dir, "fsdp-pyckpt")),
           "lightning": run(lambda: FSDPStrategy(state_dict_type="sharded"),
                            os.path.join(out_dir, "fsdp-lightning"))}
    first = res["pyckpt"]["first"]
    res["stored"] = stored(first)
    # The collective plain pyckpt.load on both ranks: the whole model, unsharded, from the
    # FSDP shards of both ranks; equal to Lightning's own sharded checkpoint read by DCP.
    model = Tiny()
    mine = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    theirs = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    pyckpt.load(mine, first)
    import torch.distributed.checkpoint as dcp
    dcp.load(theirs, checkpoint_id=res["lightning"]["first"])
    res["plain_load"] = all(torch.equal(mine["model"][k], theirs["model"][k])
                            for k in mine["model"])
    return res


def model_parallel() -> dict[str, Any]:
    out_dir = sys.argv[2]
    res = {"pyckpt": run(lambda: PyckptModelParallelStrategy(data_parallel_size=2,
                                                             tensor_parallel_size=1),
                         os.path.join(out_dir, "mp-pyckpt"), parallel=True),
           "lightning": run(lambda: ModelParallelStrategy(data_parallel_size=2,
                                                          tensor_parallel_size=1),
                            os.path.join(out_dir, "mp-lightning"), parallel=True)}
    res["stored"] = stored(res["pyckpt"]["first"])
    return res


if __name__ == "__main__":
    scenario = sys.argv[1]
    result = {"ddp": ddp, "fsdp": fsdp, "model_parallel": model_parallel}[scenario]()
    with open(os.path.join(sys.argv[2], f"{scenario}-{RANK}.json"), "w") as f:
        json.dump(result, f)
