"""``pyckpt.async_save``: returns once the state is copied, writes it in the background with
the plans cached as ``pyckpt.save`` caches them, and fails every rank's future when one rank's
staging fails (nothing written)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _child_env import child_env
from dist_utils import RankProcess, free_port, run_distributed

import pyckpt
from pyckpt import _format

WORLD = 3


def _state(rank: int, world: int, seed: int, rows: int = 12) -> dict[str, Any]:
    """A sharded DTensor, a replicated tensor and a nested non-tensor value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    return {
        "w": distribute_tensor(torch.randn(rows * world, 8, generator=g), mesh, [Shard(0)]),
        "norm": torch.randn(64, generator=g).to(torch.bfloat16),  # the same on every rank
        "extra": {"step": seed, "history": [seed, seed + 1]},
    }


def _snapshot(sd: dict[str, Any]) -> dict[str, Any]:
    return {"w": sd["w"].to_local().clone(), "norm": sd["norm"].clone(),
            "extra": {"step": sd["extra"]["step"], "history": list(sd["extra"]["history"])}}


def _scribble(sd: dict[str, Any]) -> None:
    """What training does to the state after the call returned."""
    sd["w"].to_local().add_(1000.0)
    sd["norm"].fill_(-7.0)
    sd["extra"]["history"].append(99)


def _loads_back(sd: dict[str, Any], want: dict[str, Any], path: str) -> None:
    from torch.distributed.tensor import DTensor

    w = sd["w"]
    dest = {"w": DTensor.from_local(torch.zeros_like(w.to_local()), w.device_mesh, w.placements,
                                    shape=w.shape, stride=w.stride()),
            "norm": torch.zeros_like(sd["norm"]), "extra": {"step": -1, "history": []}}
    pyckpt.load(dest, path)
    assert torch.equal(dest["w"].to_local(), want["w"])
    assert dest["norm"].dtype == torch.bfloat16 and torch.equal(dest["norm"], want["norm"])
    assert dest["extra"] == want["extra"]


def _cycle_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    from pyckpt import _savedrive

    before = dict(_savedrive.stats)
    states, wants, futures = [], [], []
    for i, rows in enumerate((12, 12, 12, 13, 13)):  # the 4th changes a shape: planned again
        sd = _state(rank, world, i + 1, rows)
        wants.append(_snapshot(sd))
        futures.append(pyckpt.async_save(sd, os.path.join(root, f"s{i}")))
        _scribble(sd)  # the future is not done yet, or already: either way the copy is saved
        states.append(sd)
    metadata = [f.result(timeout=120) for f in futures]
    assert all("w" in m.state_dict_metadata for m in metadata)
    counts = {k: _savedrive.stats[k] - before[k] for k in ("planned", "cached")}
    for i, (sd, want) in enumerate(zip(states, wants)):
        _loads_back(sd, want, os.path.join(root, f"s{i}"))
    # A blocking save right after an async one (not waited for) first waits for it: both
    # complete, each with the state as it was at its call.
    sd = _state(rank, world, 50)
    want_a = _snapshot(sd)
    fut = pyckpt.async_save(sd, os.path.join(root, "a"), compression="zstd")
    _scribble(sd)
    want_b = _snapshot(sd)
    pyckpt.save(sd, os.path.join(root, "b"))
    assert fut.done()
    fut.result()
    _loads_back(sd, want_a, os.path.join(root, "a"))
    _loads_back(sd, want_b, os.path.join(root, "b"))
    return counts


def test_async_saves_hold_the_state_at_the_call_and_reuse_plans(tmp_path: Path) -> None:
    results = run_distributed(_cycle_worker, WORLD, str(tmp_path))
    for rank, counts in enumerate(results):
        assert counts == {"planned": 2, "cached": 3}, f"rank {rank}: {counts}"


def _staging_failure_worker(rank: int, world: int, root: str) -> list[Any]:
    out: list[Any] = []
    sd = _state(rank, world, 1)
    pyckpt.async_save(sd, os.path.join(root, "ok")).result(timeout=120)
    bad = dict(sd)
    if rank == 1:
        bad["lock"] = threading.Lock()  # a leaf the staging copy cannot copy
    fut = pyckpt.async_save(bad, os.path.join(root, "bad"))
    with pytest.raises(TypeError) as e:
        fut.result(timeout=120)
    out.append(getattr(e.value, "__notes__", []))
    out.append(os.path.exists(os.path.join(root, "bad", _format.METADATA_FILE)))
    # The next save works, and loads back.
    want = _snapshot(sd)
    pyckpt.async_save(sd, os.path.join(root, "after")).result(timeout=120)
    _loads_back(sd, want, os.path.join(root, "after"))
    return out


def test_a_staging_failure_on_one_rank_fails_every_future_and_writes_nothing(
        tmp_path: Path) -> None:
    results = run_distributed(_staging_failure_worker, WORLD, str(tmp_path))
    for rank, (notes, committed) in enumerate(results):
        assert not committed, rank
        named = any("failed on rank 1" in n for n in notes)
        assert named == (rank != 1), (rank, notes)  # rank 1 raises its own error


def test_single_process_async_save_and_bad_options(tmp_path: Path) -> None:
    sd = {"t": torch.arange(1000, dtype=torch.float32), "meta": {"lr": [0.1, 0.2]}}
    fut = pyckpt.async_save(sd, tmp_path / "c", compression="zstd")
    sd["t"].zero_()
    sd["meta"]["lr"].append(0.3)
    fut.result(timeout=60)
    dest = {"t": torch.zeros(1000), "meta": {"lr": []}}
    pyckpt.load(dest, tmp_path / "c")
    assert torch.equal(dest["t"], torch.arange(1000, dtype=torch.float32))
    assert dest["meta"] == {"lr": [0.1, 0.2]}
    with pytest.raises(ValueError, match="compression"):
        pyckpt.async_save(sd, tmp_path / "d", compression="lz5")
    assert not (tmp_path / "d").exists()


_EXIT_CHILD = """
import sys, torch, pyckpt
pyckpt.async_save({"t": torch.arange(1 << 22, dtype=torch.float32)}, sys.argv[1],
                  compression="zstd")
"""


def test_a_save_in_flight_completes_before_the_interpreter_exits(tmp_path: Path) -> None:
    path = tmp_path / "c"
    subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(path)], env=child_env(),
                   check=True, timeout=300)
    dest = {"t": torch.zeros(1 << 22)}
    pyckpt.load(dest, path)
    assert torch.equal(dest["t"], torch.arange(1 << 22, dtype=torch.float32))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_has_no_save_in_flight(tmp_path: Path, monkeypatch: Any) -> None:
    import multiprocessing as mp

    from pyckpt import _savedrive

    # The parent's save waits in Python (no lock held, no native work) until the child is done:
    # a child that inherited "a save in flight" would wait for it forever.
    parent, entered, release = os.getpid(), threading.Event(), threading.Event()
    save = _savedrive.save

    def held(*args: Any, **kwargs: Any) -> Any:
        if os.getpid() == parent:
            entered.set()
            assert release.wait(120)
        return save(*args, **kwargs)

    monkeypatch.setattr(_savedrive, "save", held)
    fut = pyckpt.async_save({"t": torch.ones(10)}, tmp_path / "parent")
    try:
        assert entered.wait(60)
        p = mp.get_context("fork").Process(target=_child_saves, args=(str(tmp_path / "child"),))
        p.start()
        p.join(120)
        assert p.exitcode == 0
        assert not fut.done()
    finally:
        release.set()
    fut.result(timeout=60)
    for name, value in (("child", 2.0), ("parent", 1.0)):
        dest = {"t": torch.zeros(10)}
        pyckpt.load(dest, tmp_path / name)
        assert torch.equal(dest["t"], torch.full((10,), value)), name


def _child_saves(path: str) -> None:
    pyckpt.async_save({"t": torch.full((10,), 2.0)}, path).result(timeout=60)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated
@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
@pytest.mark.parametrize("what", ["sparse", "quantized"])
def test_a_tensor_a_save_cannot_store_is_refused_before_staging_memory_is_leased(
        tmp_path: Path, what: str) -> None:
    # As pyckpt.save refuses it (UnsupportedDtypeError naming the tensor), not with torch's
    # RuntimeError from the staging copy, after leasing the tensor's dense size (here 4 TiB).
    from pyckpt import _pinned

    t = (torch.sparse_coo_tensor([[0, 5]], [1.0, 2.0], (1 << 40,)) if what == "sparse"
         else torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8))
    sd = {"model": {"layers": [{"w": t}]}, "ok": torch.ones(3)}
    before = _pinned.pinned_stats()["total_allocated_bytes"]
    fut = pyckpt.async_save(sd, tmp_path / "c")
    with pytest.raises(pyckpt.UnsupportedDtypeError, match=r"'model\.layers\.0\.w'"):
        fut.result(timeout=60)
    assert _pinned.pinned_stats()["total_allocated_bytes"] == before
    assert not (tmp_path / "c" / _format.METADATA_FILE).exists()


def _save_then_destroy(path: str) -> None:
    """The end of a training script: an async save, then the process group destroyed."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    pyckpt.async_save({"w": torch.full((1 << 20,), 3.0)}, path)
    dist.destroy_process_group()


def test_a_save_stopped_by_destroy_process_group_says_so(tmp_path: Path) -> None:
    # The save thread is joined at exit, but its group is gone: before, the save failed with
    # torch's ValueError in a future nobody held, and the processes exited 0 without a word.
    path = str(tmp_path / "c")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [RankProcess(_save_then_destroy, path, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(2)]
    errs = []
    for p in ranks:
        assert p.wait(120) == 0
        errs.append(p.stderr.read())
        p.stderr.close()
        p.stdout.close()
    for err in errs:
        assert "process group was destroyed while the save was in flight" in err, err
        assert repr(path) in err, err
    assert not os.path.exists(os.path.join(path, _format.METADATA_FILE))


def _save_then_exit(path: str) -> None:
    """A script's last save, not waited for; the ranks' plans estimate compressed sizes (zstd,
    replicated tensors) on the shared executor."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    sd = {"w": torch.full((1 << 20,), 3.0), "v": torch.arange(1 << 20, dtype=torch.float32)}
    pyckpt.async_save(sd, path, compression="zstd")


def test_a_multi_rank_save_in_flight_completes_before_the_interpreter_exits(
        tmp_path: Path) -> None:
    # Before: the save thread's plan submitted to the shared executor after the interpreter's
    # exit had begun, and the save failed ("cannot schedule new futures after interpreter
    # shutdown") in a future nobody held: no checkpoint, exit status 0.
    path = str(tmp_path / "c")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [RankProcess(_save_then_exit, path, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(2)]
    for p in ranks:
        assert p.wait(120) == 0
        p.stderr.close()
        p.stdout.close()
    dest = {"w": torch.zeros(1 << 20), "v": torch.zeros(1 << 20)}
    pyckpt.load(dest, path)
    assert torch.equal(dest["w"], torch.full((1 << 20,), 3.0))
    assert torch.equal(dest["v"], torch.arange(1 << 20, dtype=torch.float32))


def test_a_failed_save_returns_its_staging_memory(tmp_path: Path) -> None:
    # Before, a failed save's staged copy stayed leased while its future lived (its exception's
    # traceback holds the copy), so every later save allocated (page-locked) another extent.
    from pyckpt import _pinned

    _pinned._forget_for_tests()
    (tmp_path / "file").write_text("")
    sd = {"w": torch.randn(1 << 20)}
    failed = []
    for i in range(3):
        failed.append(pyckpt.async_save(sd, tmp_path / "file" / "c"))  # not a directory
        with pytest.raises(NotADirectoryError):
            failed[-1].result(timeout=60)
        pyckpt.async_save(sd, tmp_path / f"ok{i}").result(timeout=60)
    stats = _pinned.pinned_stats()
    assert (stats["extents"], stats["extents_in_use"]) == (1, 0), stats
