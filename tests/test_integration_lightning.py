"""pyckpt.integrations.lightning against the real Lightning package (CPU, gloo, 2 ranks).

Each distributed test trains a tiny model for two epochs with a checkpoint per epoch, resumes a
new Trainer from the first checkpoint, and compares the losses with ``==``: the resumed run
against the uninterrupted one and against the same resume through Lightning's own
checkpointing. Ranks are separate processes (tests/_lightning_workers.py) launched the way
torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so Lightning does not
launch its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch
from _child_env import child_env
from _ports import free_port

import pyckpt

lightning_mod = pytest.importorskip("pyckpt.integrations.lightning")

pytestmark = pytest.mark.filterwarnings(
    # Lightning's own imports, not this module's.
    "ignore::DeprecationWarning",
)

_WORKER = Path(__file__).with_name("_lightning_workers.py")


def _launch(scenario: str, out: Path, world: int = 2, accelerator: str = "cpu",
            timeout: float = 240) -> list[dict[str, Any]]:
    port = free_port()
    procs = []
    for rank in range(world):
        # The pyckpt this test imported (the installed one in CI, never the checkout's copy
        # without its built extension).
        env = child_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                        PYCKPT_TEST_ACCELERATOR=accelerator, CUBLAS_WORKSPACE_CONFIG=":4096:8",
                        NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.pop("PYTHONDEVMODE", None)
        procs.append(subprocess.Popen([sys.executable, str(_WORKER), scenario, str(out)],
                                      env=env, cwd=out, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-6000:]
    return [json.loads((out / f"{scenario}-{r}.json").read_text()) for r in range(world)]


def _check_resume(results: list[dict[str, Any]]) -> None:
    for res in results:
        ours, theirs = res["pyckpt"], res["lightning"]
        steps = len(ours["resumed"])  # one epoch
        assert steps > 0 and len(ours["full"]) == 2 * steps
        # Bit-identical: resumed == uninterrupted (the second epoch), and == Lightning's own.
        assert ours["resumed"] == ours["full"][steps:]
        assert ours["full"] == theirs["full"]
        assert ours["resumed"] == theirs["resumed"]
        # A tensor the model put in the checkpoint (on_save_checkpoint) comes back as saved.
        assert ours["extra"] == theirs["extra"] == [0.0, 1.0, 2.0]
        # The checkpoint went through pyckpt, not Lightning's writer.
        assert res["stored"]["pyckpt"] and not res["stored"]["meta_pt"]


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_checkpoint_io_resume(tmp_path: Path) -> None:
    results = _launch("ddp", tmp_path)
    _check_resume(results)
    keys = results[0]["stored"]["keys"]
    assert "lightning" in keys and "state_dict.net.0.weight" in keys
    assert "optimizer_states.0.state.0.exp_avg" in keys  # the moments are stored as tensors
    rank0 = results[0]
    assert rank0["equal_to_lightning"] and rank0["opt_equal"] and rank0["meta_equal"]
    assert rank0["plain_load"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fsdp_sharded_resume(tmp_path: Path) -> None:
    # Lightning's FSDPStrategy wraps with FSDP1, which refuses CPU-only processes ("FSDP needs
    # a non-CPU accelerator device"): one rank on one GPU (FULL_SHARD over a world of 1).
    results = _launch("fsdp", tmp_path, world=1, accelerator="gpu")
    _check_resume(results)
    keys = results[0]["stored"]["keys"]
    assert "model.net.0.weight" in keys and "optimizer_0.state.net.0.weight.exp_avg" in keys
    assert all(r["plain_load"] for r in results)


def test_checkpoint_io_round_trip(tmp_path: Path) -> None:
    """Every kind of value of a Lightning checkpoint dict comes back, with its type."""
    from collections import OrderedDict

    io_ = lightning_mod.PyckptCheckpointIO(compression="zstd")
    ck = {"state_dict": OrderedDict(w=torch.randn(3, 4), b=torch.arange(5)),
          "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}},
                                "param_groups": [{"lr": 0.1, "params": [0]}]}],
          "epoch": 2, "global_step": 7, "loops": {"fit_loop": {"state_dict": {}}},
          "hyper_parameters": {"lr": 0.1, "name": "x", "sizes": (1, 2)},
          "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(1.5)}}}
    path = tmp_path / "ck"
    io_.save_checkpoint(ck, path)
    assert (path / "pyckpt.json").is_file()
    back = io_.load_checkpoint(path)
    assert type(back["state_dict"]) is OrderedDict
    assert back["loops"] == ck["loops"] and back["hyper_parameters"] == ck["hyper_parameters"]
    assert torch.equal(back["state_dict"]["w"], ck["state_dict"]["w"])
    assert torch.equal(back["state_dict"]["b"], ck["state_dict"]["b"])
    assert back["optimizer_states"][0]["state"][0]["step"] == 3.0
    assert back["callbacks"]["ModelCheckpoint{'monitor': None}"]["best_model_score"] == 1.5
    # Plain pyckpt.load of the weights, no Lightning.
    sd = {"state_dict": {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.long)}}
    pyckpt.load(sd, path)
    assert torch.equal(sd["state_dict"]["w"], ck["state_dict"]["w"])
    io_.remove_checkpoint(path)
    assert not path.exists()


def test_checkpoint_io_errors_are_typed(tmp_path: Path) -> None:
    """The writer's own error reaches the caller, not DCP's CheckpointException."""
    io_ = lightning_mod.PyckptCheckpointIO(writer_options={"overwrite": False})
    ck = {"state_dict": {"w": torch.ones(2)}, "epoch": 0}
    io_.save_checkpoint(ck, tmp_path / "ck")
    with pytest.raises(FileExistsError):
        io_.save_checkpoint(ck, tmp_path / "ck")
    afile = tmp_path / "file"
    afile.write_bytes(b"x")
    with pytest.raises(OSError) as info:
        lightning_mod.PyckptCheckpointIO().save_checkpoint(ck, afile / "ck")
    assert type(info.value).__module__ == "builtins"  # NotADirectoryError / FileExistsError
    with pytest.raises(FileNotFoundError):
        io_.load_checkpoint(tmp_path / "missing")
    with pytest.raises(ValueError, match="compression"):
        lightning_mod.PyckptCheckpointIO(compression="lz77")


def test_checkpoint_io_replaces_lightnings_checkpoint_file(tmp_path: Path) -> None:
    """A run moved onto pyckpt saves over Lightning's own ``last.ckpt`` file, as Lightning does
    (it failed with NotADirectoryError); a failed save leaves the file as it was."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    path = tmp_path / "last.ckpt"
    TorchCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 0}, path)
    io_ = lightning_mod.PyckptCheckpointIO()
    with pytest.raises(pyckpt.UnsupportedDtypeError):
        io_.save_checkpoint({"state_dict": {"w": torch.ones(2).to_sparse()}, "epoch": 1}, path)
    assert path.is_file() and io_.load_checkpoint(path)["epoch"] == 0
    with pytest.raises(FileExistsError):  # as onto a pyckpt checkpoint
        lightning_mod.PyckptCheckpointIO(writer_options={"overwrite": False}).save_checkpoint(
            {"state_dict": {"w": torch.ones(2)}, "epoch": 1}, path)
    assert path.is_file()
    io_.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, path)
    back = io_.load_checkpoint(path)
    assert back["epoch"] == 1 and torch.equal(back["state_dict"]["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_version_outside_tested_range_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning

    monkeypatch.setattr(lightning, "__version__", "2.5.3")
    monkeypatch.setattr(lightning_mod, "_version_checked", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lightning_mod.PyckptCheckpointIO()
        lightning_mod.PyckptCheckpointIO()
    ours = [w for w in seen if issubclass(w.category, lightning_mod.LightningVersionWarning)]
    assert len(ours) == 1 and ">=2.6,<2.7" in str(ours[0].message)
    assert "2.5.3" in str(ours[0].message)
    monkeypatch.setattr(lightning, "__version__", "2.6.6")
    monkeypatch.setattr(lightning_mod, "_version_checked", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lightning_mod.PyckptCheckpointIO()


@pytest.mark.parametrize("version,inside", [("2.6.0", True), ("2.6.6", True), ("2.7.0rc1", False),
                                            ("2.5.9", False), ("3.0", False)])
def test_release_parse(version: str, inside: bool) -> None:
    low, high = (lightning_mod._release(v) for v in lightning_mod.TESTED_VERSIONS)
    assert (low <= lightning_mod._release(version) < high) == inside


def test_import_without_lightning_names_the_extra() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["lightning"] = None
        try:
            import pyckpt.integrations.lightning
        except ImportError as e:
            print("ERR", e)
        else:
            print("imported")
    """)
    env = child_env()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "ERR" in out and "pip install pyckpt[lightning]" in out


@pytest.mark.slow
@pytest.mark.distributed
def test_model_parallel_resume(tmp_path: Path) -> None:
    results = _launch("model_parallel", tmp_path)
    _check_resume(results)
    keys = results[0]["stored"]["keys"]
    assert "state_dict.net.0.weight" in keys and "optimizer_0.state.net.0.weight.exp_avg" in keys
    # overwrite=False onto an existing checkpoint: the writer's FileExistsError on every rank,
    # through Trainer.save_checkpoint, not DCP's CheckpointException.
    assert [r["pyckpt"].get("refused") for r in results] == ["FileExistsError"] * 2
