"""CheckpointManager.save holds the caller only for the staging copy: the ranks exchange their
staging outcome in the background, and a staging failure on one rank still writes nothing on
any rank and is raised on every rank at the same call."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_distributed

from pyckpt._tier_io import MARKER_FILE


def _state(step: int) -> dict[str, Any]:
    """Replicated state (the same on every rank)."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 33, generator=g).to(torch.bfloat16),
            "i": torch.arange(step, step + 10)}


def _staging_failure(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    import pyckpt

    mgr = pyckpt.CheckpointManager(os.path.join(root, "durable"),
                                   local=os.path.join(root, "n{node}"), node=str(rank),
                                   replicas=1, save_every=1, persist_every=100, fsync=False)
    writer = mgr._fast_writer
    assert writer is not None
    stage = writer.stage

    def failing_stage(sd: Any) -> Any:
        raise pyckpt.CudaError("cudaMemcpyAsync failed staging 'w' (injected)")

    # A save does no collective before it returns: count the manager's collectives made from
    # the calling thread (the background work makes its own on the save thread).
    import threading

    from pyckpt import manager as manager_module
    from pyckpt._manager import persist, restore, save

    caller = threading.get_ident()
    collectives: list[str] = []
    modules = [manager_module, save, persist, restore]
    real = {(m, name): getattr(m, name) for m in modules for name in ("all_gather", "agree")
            if hasattr(m, name)}

    def counting(key: tuple[Any, str]) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            if threading.get_ident() == caller:
                collectives.append(key[1])
            return real[key](*a, **k)
        return call

    for key in real:
        setattr(key[0], key[1], counting(key))
    try:
        fut = mgr.save(1, _state(1))
        assert fut is not None and fut.result(timeout=120) == 1
        if rank == 1:
            writer.stage = failing_stage  # type: ignore[method-assign]
        out: dict[str, Any] = {}
        fut = mgr.save(2, _state(2))  # returns on every rank, the failing one included
        assert fut is not None
        out["caller_collectives"] = list(collectives)
        exc = fut.exception(timeout=120)
        out["future_error"] = (type(exc).__name__, str(exc), list(getattr(exc, "__notes__", [])))
        writer.stage = stage  # type: ignore[method-assign]
        with pytest.raises(pyckpt.CudaError) as info:  # the next save raises it, on every rank
            mgr.save(3, _state(3))
        out["raised"] = str(info.value)
        out["step2"] = sorted(os.listdir(os.path.join(root, f"n{rank}", "step-2"))) \
            if os.path.isdir(os.path.join(root, f"n{rank}", "step-2")) else None
        fut = mgr.save(4, _state(4))  # and the manager goes on
        assert fut is not None and fut.result(timeout=120) == 4
        mgr.wait()
        out["steps"] = mgr.steps()["local"]
    finally:
        for (module, name), fn in real.items():
            setattr(module, name, fn)
    mgr.close()
    dist.barrier()
    return out


@pytest.mark.distributed
def test_staging_failure_on_one_rank_fails_every_ranks_save_and_writes_nothing(
    tmp_path: Path,
) -> None:
    results = run_distributed(_staging_failure, 2, str(tmp_path))
    for rank, res in enumerate(results):
        name, text, notes = res["future_error"]
        assert name == "CudaError" and "staging 'w' (injected)" in text, res
        if rank == 0:
            assert any("rank 1" in n for n in notes), res
        assert "staging 'w' (injected)" in res["raised"]
        assert res["step2"] is None or MARKER_FILE not in res["step2"], res
        assert res["steps"] == [1, 4], res
        assert res["caller_collectives"] == [], res
