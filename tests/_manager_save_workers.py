"""Rank bodies for the save-side tests of tests/test_manager.py that need more than "train"
and "restore" (:mod:`_manager_workers`, which launches them: ``spec["entry"]`` names this
module). Each rank writes ``<root>/results/<tag>-<rank>.json``.

Actions:
    ``mismatch``: every rank saves ``spec["good"]``, then saves its own ``spec["steps"][rank]``
        (its shards of that step; the replicated tensor the same on every rank, so only the
        steps differ) and records what ``wait()`` raised.
    ``partial_marker``: saves ``spec["steps"]``; on rank ``spec["fail_rank"]`` writing the
        completion marker of ``spec["fail_step"]`` fails (a full disk); records the failures.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from _manager_workers import make_state

__all__ = ["main"]


def _error(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "message": str(e),
            "notes": list(getattr(e, "__notes__", [])),
            "steps": {str(k): v for k, v in getattr(e, "steps", {}).items()}}


def main(spec_path: str) -> None:
    import torch.distributed as dist

    import pyckpt

    with open(spec_path) as fh:
        spec = json.load(fh)
    root = spec["root"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    local = os.path.join(root, "local") if spec.get("fast", True) else None
    if spec["action"] == "partial_marker" and rank == spec["fail_rank"]:
        from pyckpt import _tier_io

        real = _tier_io.LocalTier.write_marker

        def write_marker(self: Any, step: int, doc: Any) -> None:
            if step == spec["fail_step"]:
                raise OSError(28, "No space left on device (injected)", self.step_dir(step))
            real(self, step, doc)

        _tier_io.LocalTier.write_marker = write_marker  # type: ignore[method-assign]
    out: dict[str, Any] = {"rank": rank, "errors": []}
    mgr = pyckpt.CheckpointManager(os.path.join(root, "durable"), local=local,
                                   **spec.get("manager", {}))
    if spec["action"] == "mismatch":
        mgr.save(spec["good"], make_state(spec["good"], world))
        mgr.wait()
        mine = spec["steps"][rank]
        state = make_state(mine, world)
        state["r"] = make_state(spec["good"], world)["r"]  # replicated: the same on every rank
        fut = mgr.save(mine, state)
        assert fut is not None
        try:
            mgr.wait()
        except Exception as e:
            out["errors"].append(_error(e))
        out["future_failed"] = fut.exception() is not None
    elif spec["action"] == "partial_marker":
        for step in spec["steps"]:
            mgr.save(step, make_state(step, world))
            try:
                mgr.wait()
            except Exception as e:
                out["errors"].append(dict(_error(e), step=step))
    mgr.close()
    with open(os.path.join(root, "results", f"{spec['tag']}-{rank}.json"), "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()
