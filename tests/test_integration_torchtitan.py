"""pyckpt.integrations.torchtitan against the real torchtitan: a tiny FSDP2 decoder on 2 gloo
ranks, trained, checkpointed by torchtitan's manager machinery, restarted, resumed.

See tests/_torchtitan_workers.py for how the job is assembled (torchtitan's Trainer itself needs
an accelerator, its model modules need triton).
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import warnings
from typing import Any

import pytest

pytest.importorskip("torchtitan")

import torch
from dist_utils import run_distributed

pytestmark = pytest.mark.distributed

_HERE = os.path.dirname(os.path.abspath(__file__))


def _quiet() -> None:
    # torchtitan logs config notes as warnings and torch's scheduler warns on CPU; the parent
    # process' filterwarnings=error does not reach the ranks, these keep their logs readable.
    warnings.filterwarnings("ignore", category=UserWarning)


def _full_model(job: Any) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in job.model.state_dict().items()}


def _save_restart_resume(config: Any, tmp: str, stop: int, end: int) -> list[float]:
    """Trains to step ``stop`` checkpointing through ``config``, restarts with fresh objects,
    loads and trains on to ``end``; returns every step's loss."""
    from _torchtitan_workers import Job

    job = Job(config, tmp)
    got: list[float] = job.train(stop)
    job.close()
    job = Job(config, tmp)
    assert job.checkpointer.load()
    got += job.train(end)
    job.close()
    return got


def _resume_worker(rank: int, world: int, tmp: str, mode: str) -> dict[str, Any]:
    """An uninterrupted run, then torchtitan's own checkpointing and pyckpt's, each saving at
    steps 2 and 4, restarted after step 4 (fresh objects) and resumed to step 6."""
    _quiet()
    from _torchtitan_workers import Job
    from torchtitan.components.checkpoint import CheckpointManager

    import pyckpt
    from pyckpt import _savedrive
    from pyckpt.integrations.torchtitan import PyckptCheckpointManager

    reference = Job(CheckpointManager.Config(enable=False), tmp)
    want = reference.train(6)
    out: dict[str, Any] = {"want": want}
    for name, cls in (("torchtitan", CheckpointManager), ("pyckpt", PyckptCheckpointManager)):
        extra = {"compression": "zstd"} if cls is PyckptCheckpointManager else {}
        config = cls.Config(enable=True, folder=name, interval=2, async_mode=mode,
                            keep_latest_k=0, **extra)
        job = Job(config, tmp)
        planned = dict(_savedrive.stats)
        before = job.train(4)
        step4 = _full_model(job)
        job.close()  # waits for an async save in flight
        out[f"{name}_plans"] = {k: _savedrive.stats[k] - planned[k] for k in planned}
        job = Job(config, tmp)
        assert job.checkpointer.load()
        assert job.train_state.step == 4 and job.dataloader.position == 4
        out[name] = before + job.train(6)
        job.close()
        out[f"{name}_files"] = sorted(os.listdir(os.path.join(tmp, name, "step-4")))
    # The pyckpt checkpoint loads with plain pyckpt.load (model entries at the top level).
    fresh = Job(CheckpointManager.Config(enable=False), tmp)
    sd = fresh.model.state_dict()
    pyckpt.load(sd, os.path.join(tmp, "pyckpt", "step-4"))
    out["plain_load_equal"] = all(
        torch.equal(sd[k].full_tensor(), step4[k]) for k in step4)
    # overwrite=False onto the existing step-4: the writer's FileExistsError reaches the job.
    config = PyckptCheckpointManager.Config(
        enable=True, folder="pyckpt", interval=4, async_mode=mode, keep_latest_k=0,
        overwrite=False)
    job = Job(config, tmp)
    try:
        job.train(4)
        job.close()
        out["error"] = None
    except BaseException as e:
        out["error"] = type(e).__name__
    return out


@pytest.mark.parametrize("mode", ["disabled", pytest.param("async", marks=pytest.mark.slow)])
def test_resume_is_bit_exact_and_errors_typed(tmp_path: Any, mode: str) -> None:
    results = run_distributed(_resume_worker, 2, str(tmp_path), mode)
    for r in results:
        assert r["pyckpt"] == r["want"]  # losses after resume, == on floats
        assert r["torchtitan"] == r["want"]
        assert r["plain_load_equal"]
        assert r["error"] == "FileExistsError"
        # pyckpt.save / pyckpt.async_save: step 4's save reuses step 2's plans
        assert r["pyckpt_plans"] == {"planned": 1, "cached": 1}, r["pyckpt_plans"]
    # pyckpt wrote step-4 (not DCP's default writer), torchtitan its own format.
    assert "pyckpt.json" in results[0]["pyckpt_files"]
    assert not any(f.endswith(".distcp") for f in results[0]["pyckpt_files"])
    assert ".metadata" in results[0]["torchtitan_files"]


def _policies_worker(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """keep_latest_k, the model-only last save exported to HF, load_step, exclude_from_loading."""
    _quiet()
    from _torchtitan_workers import Job, hf_name, write_hf_assets

    from pyckpt.integrations.torchtitan import PyckptCheckpointManager

    assets = os.path.join(tmp, "assets")
    if rank == 0:
        write_hf_assets(assets)
    torch.distributed.barrier()
    config = PyckptCheckpointManager.Config(
        enable=True, folder="ckpt", interval=1, keep_latest_k=3, last_save_model_only=True,
        last_save_in_hf=True, export_dtype="bfloat16", compression="zstd")
    job = Job(config, tmp, hf_assets=assets)
    job.train(5, last=5)
    final = {hf_name(k): v.to(torch.bfloat16) for k, v in _full_model(job).items()}
    job.close()
    torch.distributed.barrier()
    if rank == 0:  # tensors do not cross the result queue once the rank exits: a file does
        torch.save(final, os.path.join(tmp, "final.pt"))
    out: dict[str, Any] = {}
    folder = os.path.join(tmp, "ckpt")
    out["steps"] = sorted(os.listdir(folder))
    out["hf_files"] = sorted(os.listdir(os.path.join(folder, "step-5")))
    # load_step=3 with the data loader excluded: step 3's state, the loader's own position.
    config = PyckptCheckpointManager.Config(
        enable=True, folder="ckpt", load_step=3, exclude_from_loading=["dataloader"],
        keep_latest_k=0)
    job = Job(config, tmp, hf_assets=assets)
    assert job.checkpointer.load(step=3)
    out["loaded"] = (job.train_state.step, job.dataloader.position)
    job.close()
    return out


@pytest.mark.slow
def test_keep_latest_k_hf_export_load_step_and_exclude(tmp_path: Any) -> None:
    results = run_distributed(_policies_worker, 2, str(tmp_path))
    for r in results:
        # keep_latest_k=3: the save of step 4 purged step 1; torchtitan's last save (the HF
        # export of step 5) returns before purging.
        assert r["steps"] == ["step-2", "step-3", "step-4", "step-5"]
        # The files the adapter's index names (no hidden export source left behind).
        assert r["hf_files"] == ["model-00001-of-00002.safetensors",
                                 "model-00002-of-00002.safetensors",
                                 "model.safetensors.index.json"]
        assert r["loaded"] == (3, 0)
    # The export loads in transformers (with the model's config.json next to it, as torchtitan
    # users copy it from hf_assets_path), bit-exact in the export dtype.
    from transformers import LlamaForCausalLM

    export = os.path.join(tmp_path, "ckpt", "step-5")
    shutil.copy(os.path.join(tmp_path, "assets", "config.json"), export)
    model = LlamaForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
    got = model.state_dict()
    final = torch.load(os.path.join(tmp_path, "final.pt"))
    assert set(got) == set(final)
    for name, tensor in final.items():
        assert torch.equal(got[name], tensor), name


def _incomplete_worker(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Step 4's save did not commit (no pyckpt.json): the latest load takes step 2, and
    ``load_step=4`` fails with the reader's typed error."""
    _quiet()
    from _torchtitan_workers import Job

    from pyckpt.integrations.torchtitan import PyckptCheckpointManager

    config = PyckptCheckpointManager.Config(enable=True, folder="ckpt", interval=2,
                                            keep_latest_k=0)
    job = Job(config, tmp)
    job.train(4)
    job.close()
    torch.distributed.barrier()
    if rank == 0:
        os.unlink(os.path.join(tmp, "ckpt", "step-4", "pyckpt.json"))
    torch.distributed.barrier()
    out: dict[str, Any] = {}
    job = Job(config, tmp)
    assert job.checkpointer.load()
    out["latest"] = job.train_state.step
    job.close()
    job = Job(PyckptCheckpointManager.Config(enable=True, folder="ckpt", load_step=4), tmp)
    try:
        job.checkpointer.load(step=4)
        out["step4"] = "loaded"
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        out["step4"] = f"{type(e).__name__}: {e}"
    job.close()
    return out


def test_an_incomplete_save_is_skipped_or_refused_typed(tmp_path: Any) -> None:
    """It was read as DCP's format instead: CheckpointException naming DCP's .metadata."""
    for r in run_distributed(_incomplete_worker, 2, str(tmp_path)):
        assert r["latest"] == 2
        assert r["step4"].startswith("FileNotFoundError") and "pyckpt.json" in r["step4"], r


def _s3_worker(rank: int, world: int, tmp: str, url: str, env: dict[str, str]) -> dict[str, Any]:
    _quiet()
    os.environ.update(env)  # the server's endpoint and keys (ranks start from a forkserver)
    from _torchtitan_workers import Job
    from torchtitan.components.checkpoint import CheckpointManager

    from pyckpt.integrations.torchtitan import PyckptCheckpointManager

    want = Job(CheckpointManager.Config(enable=False), tmp).train(4)
    config = PyckptCheckpointManager.Config(enable=True, folder=url, interval=1, keep_latest_k=2)
    got = _save_restart_resume(config, tmp, 2, 4)
    from fsspec.core import url_to_fs
    from torchtitan.tools import filesystem

    url_to_fs(url)[0].invalidate_cache()  # fsspec's listing cache predates the last saves
    return {"want": want, "got": got, "steps": sorted(filesystem.listdir(url))}


@pytest.mark.slow
def test_s3_folder(tmp_path: Any) -> None:
    pytest.importorskip("s3fs")
    from _s3server import started

    srv = started("titan")
    try:
        results = run_distributed(_s3_worker, 2, str(tmp_path), "s3://titan/run", srv.env())
    finally:
        srv.close()
    for r in results:
        assert r["got"] == r["want"]
    # The purge ran on the bucket too (keep_latest_k=2; the purge is asynchronous, so the last
    # listing may still show a step being deleted).
    assert {"step-3", "step-4"} <= set(results[0]["steps"])
    assert "step-1" not in results[0]["steps"]


def test_writer_pickles_for_the_process_based_save(tmp_path: Any) -> None:
    """DCP's process-based async save (async_with_pinned_mem) pickles the writer into its
    checkpoint process: the pickled writer keeps its settings and saves."""
    import pyckpt

    writer = pyckpt.Writer(str(tmp_path / "a"), "zstd", level=3, overwrite=False)
    clone = pickle.loads(pickle.dumps(writer))
    assert (clone.compression, clone.level, clone.overwrite) == ("zstd", 3, False)
    sd = {"w": torch.arange(1000, dtype=torch.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, storage_writer=clone, planner=pyckpt.SavePlanner(), no_dist=True)
    back = {"w": torch.zeros(1000)}
    pyckpt.load(back, str(tmp_path / "a"))
    assert torch.equal(back["w"], sd["w"])


def test_untested_version_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyckpt.integrations import torchtitan as integration

    monkeypatch.setattr(integration, "_version_warned", False)
    monkeypatch.setattr(integration, "_installed_version", lambda: "0.3.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integration._check_version()  # inside the tested range: silent
    monkeypatch.setattr(integration, "_installed_version", lambda: "0.4.0")
    with pytest.warns(integration.UntestedVersionWarning, match=r">=0\.3\.0,<0\.4") as seen:
        integration._check_version()
        integration._check_version()
    assert len(seen) == 1


def test_import_without_torchtitan_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['torchtitan'] = None\n"
        "try:\n"
        "    import pyckpt.integrations.torchtitan\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=os.environ.copy())
    assert "ImportError:" in out.stdout, out.stderr
    assert "pip install pyckpt[torchtitan]" in out.stdout


def _pinned_worker(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """async_with_pinned_mem on a GPU: torchtitan's own DefaultStager (pinned memory,
    non-blocking copies) and DCP's checkpoint process with the pickled pyckpt writer."""
    _quiet()
    from _torchtitan_workers import Job
    from torchtitan.components.checkpoint import CheckpointManager

    from pyckpt.integrations.torchtitan import PyckptCheckpointManager

    want = Job(CheckpointManager.Config(enable=False), tmp).train(4)
    config = PyckptCheckpointManager.Config(enable=True, folder="ckpt", interval=2,
                                            async_mode="async_with_pinned_mem",
                                            keep_latest_k=0)
    got = _save_restart_resume(config, tmp, 2, 4)
    return {"want": want, "got": got,
            "files": sorted(os.listdir(os.path.join(tmp, "ckpt", "step-2")))}


@pytest.mark.gpu
def test_async_with_pinned_mem_on_gpu(tmp_path: Any) -> None:
    results = run_distributed(_pinned_worker, 2, str(tmp_path))
    for r in results:
        assert r["got"] == r["want"]
        assert "pyckpt.json" in r["files"]


def test_the_compression_setting_offers_the_formats_codecs() -> None:
    """The config's ``compression`` spells out pyckpt's codec table for torchtitan's parser,
    and its check uses that table: a codec added to the format must be added here."""
    import typing

    from pyckpt import _format
    from pyckpt.integrations.torchtitan import PyckptCheckpointManager

    config = PyckptCheckpointManager.Config
    assert typing.get_args(typing.get_type_hints(config)["compression"]) == _format.CODECS
    assert config(compression="ZSTD").compression == "zstd"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Invalid compression: 'lz4' \(none or zstd\)"):
        config(compression="lz4")  # type: ignore[arg-type]
