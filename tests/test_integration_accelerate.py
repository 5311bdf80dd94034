"""pyckpt.integrations.accelerate against the real accelerate package (CPU, gloo, 2 ranks).

Accelerate 1.15 turns an FSDP plugin into FSDP only on GPUs (``MULTI_CPU`` is not among the
types that take it): ``Accelerator.save_state`` with FSDP is tested on the GPU machine
(``gpu`` marker). On CPU the FSDP functions are called the way the HF ``Trainer`` calls them
(``accelerate.utils.save_fsdp_model(plugin, accelerator, ...)``) on an FSDP2 model sharded with
``fully_shard`` over gloo, and ``save_state`` / ``load_state`` run under DDP (``MULTI_CPU``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

from dist_utils import run_distributed

pytestmark = pytest.mark.distributed

STEPS, SAVE_AT = 6, 3


def _model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _batch(step: int, rank: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)


def _train(acc: Any, model: Any, opt: Any, sched: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step, acc.process_index)
        loss = ((model(x) - y) ** 2).mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _prepared(acc: Any, seed: int) -> tuple[Any, Any, Any]:
    import torch

    acc.free_memory()  # new objects: the accelerator forgets the previous run's
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return acc.prepare(model, opt, sched)


def _ddp_worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    import pyckpt
    from pyckpt.integrations import accelerate as integ

    acc = Accelerator(cpu=True)
    assert acc.num_processes == 2 and acc.distributed_type.value == "MULTI_CPU"
    out: dict[str, Any] = {}

    # Uninterrupted run.
    model, opt, sched = _prepared(acc, seed=0)
    out["straight"] = _train(acc, model, opt, sched, range(STEPS))

    # Through pyckpt: save at SAVE_AT, resume into objects built from another seed.
    mine = os.path.join(tmp, "pyckpt")
    with integ.install(acc, compression="zstd") as handle:
        model, opt, sched = _prepared(acc, seed=0)
        first = _train(acc, model, opt, sched, range(SAVE_AT))
        saved = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        acc.save_state(mine)
        model, opt, sched = _prepared(acc, seed=1)
        acc.load_state(mine)
        out["pyckpt"] = first + _train(acc, model, opt, sched, range(SAVE_AT, STEPS))
        assert handle.active
    assert not handle.active
    out["pyckpt_files"] = sorted(os.listdir(mine))

    # The checkpoint loads with plain pyckpt.load (DCP stores DDP's weights without "module.").
    plain = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    pyckpt.load(plain, os.path.join(mine, integ.STATE_DIR))
    out["plain_equal"] = all(torch.equal(plain["model"][k], v)
                             for k, v in saved.items())

    # Accelerate's own checkpointing, after uninstall.
    theirs = os.path.join(tmp, "accelerate")
    model, opt, sched = _prepared(acc, seed=0)
    first = _train(acc, model, opt, sched, range(SAVE_AT))
    acc.save_state(theirs)
    model, opt, sched = _prepared(acc, seed=1)
    acc.load_state(theirs)
    out["accelerate"] = first + _train(acc, model, opt, sched, range(SAVE_AT, STEPS))
    out["accelerate_files"] = sorted(os.listdir(theirs))

    # A pyckpt error inside save_state reaches the caller typed (not CheckpointException).
    with integ.install(acc, overwrite=False):
        try:
            acc.save_state(mine)
        except FileExistsError as exc:
            out["error"] = type(exc).__name__
    return out


def test_ddp_save_state_resume_bit_exact(tmp_path: Path) -> None:
    results = run_distributed(_ddp_worker, 2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["pyckpt"] == r["straight"], rank  # bit-exact: == on floats
        assert r["accelerate"] == r["straight"], rank
        assert r["plain_equal"], rank
        assert r["error"] == "FileExistsError", rank
    r = results[0]
    assert "pyckpt_state" in r["pyckpt_files"]
    assert "model.safetensors" not in r["pyckpt_files"] and "optimizer.bin" not in r["pyckpt_files"]
    assert "scheduler.bin" in r["pyckpt_files"]  # the rest stays accelerate's
    assert {"model.safetensors", "optimizer.bin"} <= set(r["accelerate_files"])
    assert "pyckpt_state" not in r["accelerate_files"]
    assert (tmp_path / "pyckpt" / "pyckpt_state" / "pyckpt.json").is_file()


def _fresh_optimizer_worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """save_state before the first optimizer step (a step-0 checkpoint), then training on; and
    a resume from that checkpoint."""
    from accelerate import Accelerator

    from pyckpt.integrations import accelerate as integ

    acc = Accelerator(cpu=True)
    out: dict[str, Any] = {}
    model, opt, sched = _prepared(acc, seed=0)
    out["straight"] = _train(acc, model, opt, sched, range(STEPS))
    path = os.path.join(tmp, "step0")
    with integ.install(acc):
        model, opt, sched = _prepared(acc, seed=0)
        acc.save_state(path)
        out["saved_at_0"] = _train(acc, model, opt, sched, range(STEPS))
        model, opt, sched = _prepared(acc, seed=1)
        acc.load_state(path)
        out["resumed_from_0"] = _train(acc, model, opt, sched, range(STEPS))
    return out


def test_save_state_before_the_first_step_leaves_the_optimizer_as_it_was(tmp_path: Path) -> None:
    """The save must not step the optimizer (torch's get_optimizer_state_dict makes a fresh
    optimizer's state with a step at lr 0: Adam's bias correction then counts one step more)."""
    for r in run_distributed(_fresh_optimizer_worker, 2, str(tmp_path)):
        assert r["saved_at_0"] == r["straight"]  # bit-exact: == on floats
        assert r["resumed_from_0"] == r["straight"]


def _unused_parameter_worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """A model with a parameter that never gets a gradient (no optimizer state): saved at
    SAVE_AT, resumed into fresh objects."""
    import torch
    from accelerate import Accelerator, DistributedDataParallelKwargs

    from pyckpt.integrations import accelerate as integ

    class WithUnused(torch.nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.net = _model(seed)
            self.unused = torch.nn.Linear(3, 3)

        def forward(self, x: Any) -> Any:
            return self.net(x)

    def prepared(seed: int) -> tuple[Any, Any, Any]:
        acc.free_memory()
        model = WithUnused(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return acc.prepare(model, opt, sched)

    acc = Accelerator(cpu=True, kwargs_handlers=[
        DistributedDataParallelKwargs(find_unused_parameters=True)])
    out: dict[str, Any] = {"straight": _train(acc, *prepared(0), range(STEPS))}
    path = os.path.join(tmp, "ckpt")
    with integ.install(acc):
        model, opt, sched = prepared(0)
        first = _train(acc, model, opt, sched, range(SAVE_AT))
        acc.save_state(path)
        model, opt, sched = prepared(1)
        acc.load_state(path)
        out["resumed"] = first + _train(acc, model, opt, sched, range(SAVE_AT, STEPS))
        out["states"] = len(opt.optimizer.state)
    return out


def test_resume_with_a_parameter_that_has_no_optimizer_state(tmp_path: Path) -> None:
    """A parameter without moments (it never had a gradient) resumes without them, as with
    accelerate's own optimizer.bin; the load used to fail asking for its moments."""
    for r in run_distributed(_unused_parameter_worker, 2, str(tmp_path)):
        assert r["resumed"] == r["straight"]  # bit-exact: == on floats
        assert r["states"] == 4  # the net's two weights and biases; none for `unused`


def _batchnorm_worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """DDP with BatchNorm: each rank's running statistics are its own batches' between DDP's
    buffer broadcasts. Saved at SAVE_AT, resumed into fresh objects, trained on."""
    import torch
    from accelerate import Accelerator

    from pyckpt.integrations import accelerate as integ

    def prepared(seed: int) -> tuple[Any, Any, Any]:
        acc.free_memory()
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                    torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return acc.prepare(model, opt, sched)

    acc = Accelerator(cpu=True)
    out: dict[str, Any] = {"straight": _train(acc, *prepared(0), range(STEPS))}
    for name in ("accelerate", "pyckpt"):
        path = os.path.join(tmp, name)
        handle = integ.install(acc) if name == "pyckpt" else None
        model, opt, sched = prepared(0)
        first = _train(acc, model, opt, sched, range(SAVE_AT))
        acc.save_state(path)
        model, opt, sched = prepared(1)
        acc.load_state(path)
        out[name] = first + _train(acc, model, opt, sched, range(SAVE_AT, STEPS))
        out[f"{name}_mean"] = model.module[1].running_mean.tolist()
        if handle is not None:
            handle.uninstall()
    return out


def test_ddp_batchnorm_buffers_are_saved_as_the_main_process_holds_them(tmp_path: Path) -> None:
    """As accelerate saves them (the main process's); the save failed with
    ReplicaMismatchError, the ranks' running statistics differing."""
    for r in run_distributed(_batchnorm_worker, 2, str(tmp_path)):
        assert r["accelerate"] == r["straight"]
        assert r["pyckpt"] == r["straight"]  # bit-exact: == on floats
        assert r["pyckpt_mean"] == r["accelerate_mean"]


def _fsdp2_worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import accelerate.utils as au
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import pyckpt
    from pyckpt.integrations import accelerate as integ

    acc = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    mesh = init_device_mesh("cpu", (world_size,))

    def build(seed: int) -> tuple[Any, Any]:
        model = _model(seed)
        model.insert(1, torch.nn.BatchNorm1d(32))  # buffers FSDP2 leaves to each rank
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model: Any, opt: Any, steps: range) -> list[float]:
        losses = []
        for step in steps:
            x, y = _batch(step, rank)
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def run(path: str) -> list[float]:
        # As the HF Trainer does: the functions by name, from accelerate.utils.
        model, opt = build(0)
        first = train(model, opt, range(SAVE_AT))
        au.save_fsdp_model(plugin, acc, model, path)
        au.save_fsdp_optimizer(plugin, acc, opt, model, path)
        model, opt = build(1)
        au.load_fsdp_model(plugin, acc, model, path)
        au.load_fsdp_optimizer(plugin, acc, opt, model, path)
        return first + train(model, opt, range(SAVE_AT, STEPS))

    out: dict[str, Any] = {"straight": train(*build(0), range(STEPS))}
    handle = integ.install(acc)
    out["pyckpt"] = run(os.path.join(tmp, "pyckpt"))
    handle.uninstall()
    out["accelerate"] = run(os.path.join(tmp, "accelerate"))
    # Both are DCP layouts; only pyckpt's has pyckpt.json (accelerate's has .metadata).
    out["files"] = {name: sorted(os.listdir(os.path.join(tmp, name, "pytorch_model_fsdp_0")))
                    for name in ("pyckpt", "accelerate")}
    # The model checkpoint loads with plain pyckpt.load, resharded into one process's tensors.
    model, _ = build(0)
    full = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    pyckpt.load({"model": full}, os.path.join(tmp, "pyckpt", "pytorch_model_fsdp_0"),
                process_group=None)
    out["plain_nonzero"] = all(bool(t.abs().sum() > 0) for t in full.values())
    # A save that did not commit (no pyckpt.json): pyckpt's typed error, not DCP's reader's.
    torch.distributed.barrier()
    if rank == 0:
        os.unlink(os.path.join(tmp, "pyckpt", "pytorch_model_fsdp_0", "pyckpt.json"))
    torch.distributed.barrier()
    with integ.install(acc):
        try:
            au.load_fsdp_model(plugin, acc, model, os.path.join(tmp, "pyckpt"))
            out["incomplete"] = "loaded"
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            out["incomplete"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.slow
def test_fsdp2_functions_resume_bit_exact(tmp_path: Path) -> None:
    results = run_distributed(_fsdp2_worker, 2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["pyckpt"] == r["straight"], rank
        assert r["accelerate"] == r["straight"], rank
        assert r["plain_nonzero"], rank
        assert r["incomplete"].startswith("FileNotFoundError"), r["incomplete"]
        assert "pyckpt.json" in r["incomplete"]
    files = results[0]["files"]
    assert "pyckpt.json" in files["pyckpt"] and ".metadata" not in files["pyckpt"]
    assert ".metadata" in files["accelerate"] and "pyckpt.json" not in files["accelerate"]


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)


def test_import_without_accelerate_names_the_extra(tmp_path: Path) -> None:
    proc = _python("""
        import sys
        sys.modules["accelerate"] = None  # as if not installed
        try:
            import pyckpt.integrations.accelerate
        except ImportError as exc:
            print("ImportError:", exc)
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "pip install pyckpt[accelerate]" in proc.stdout


@pytest.mark.slow
def test_untested_version_warns_once(tmp_path: Path) -> None:
    proc = _python("""
        import warnings
        import accelerate
        accelerate.__version__ = "1.99.0"
        import accelerate.accelerator as aa
        from accelerate import Accelerator
        from pyckpt.integrations import accelerate as integ
        acc = Accelerator(cpu=True)
        before = (aa.save_fsdp_model, aa.save_accelerator_state, acc.save_state)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            handle = integ.install(acc)
            assert aa.save_fsdp_model is not before[0] and "save_state" in vars(acc)
            handle.uninstall()
            integ.install(acc).uninstall()
        # Uninstalled: accelerate's functions are back where they were looked up.
        assert (aa.save_fsdp_model, aa.save_accelerator_state) == before[:2]
        assert "save_state" not in vars(acc)
        mine = [w for w in seen if issubclass(w.category, integ.UntestedVersionWarning)]
        print(len(mine), mine[0].message if mine else "")
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    count, _, message = proc.stdout.strip().partition(" ")
    assert count == "1" and ">=1.15,<1.16" in message and "1.99.0" in message


def _gpu_script(tmp: Path) -> str:
    return textwrap.dedent(f"""
        import os, torch
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin
        from pyckpt.integrations import accelerate as integ

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
        acc = Accelerator(fsdp_plugin=plugin)
        assert acc.distributed_type.value == "FSDP", acc.distributed_type

        def build(seed):
            acc.free_memory()
            torch.manual_seed(seed)
            m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 1))
            o = torch.optim.AdamW(m.parameters(), lr=1e-2)
            return acc.prepare(m, o)

        def train(m, o, steps):
            out = []
            for s in steps:
                g = torch.Generator().manual_seed(s)
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
                loss = ((m(x.cuda()) - y.cuda()) ** 2).mean()
                acc.backward(loss); o.step(); o.zero_grad(); out.append(loss.item())
            return out

        def run(name):
            path = os.path.join({str(tmp)!r}, name)
            m, o = build(0)
            first = train(m, o, range({SAVE_AT}))
            acc.save_state(path)
            m, o = build(1)
            acc.load_state(path)
            losses = first + train(m, o, range({SAVE_AT}, {STEPS}))
            return losses, sorted(os.listdir(os.path.join(path, "pytorch_model_fsdp_0")))

        straight = train(*build(0), range({STEPS}))
        with integ.install(acc):
            mine, mine_files = run("pyckpt")
        theirs, their_files = run("accelerate")
        assert "pyckpt.json" in mine_files, mine_files
        assert ".metadata" in their_files, their_files
        assert mine == theirs == straight, (mine, theirs, straight)
        print("OK", mine)
        """)


@pytest.mark.gpu
def test_fsdp_save_state_on_gpu(tmp_path: Path) -> None:
    from _ports import free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", _gpu_script(tmp_path)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "OK" in proc.stdout


@pytest.mark.slow
def test_docs_example_runs(tmp_path: Path) -> None:
    import re

    doc = Path(__file__).resolve().parent.parent / "docs" / "integrations" / "accelerate.md"
    blocks = re.findall(r"^```python\n(.*?)^```$", doc.read_text(), re.S | re.M)
    assert len(blocks) == 1
    proc = _python(blocks[0], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    step = tmp_path / "ckpt" / "step-1"
    assert (step / "pyckpt_state" / "pyckpt.json").is_file()
    assert not (step / "model.safetensors").exists()
