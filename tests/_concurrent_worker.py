"""Helpers of tests/test_concurrent_saves.py that child processes import by name.

pytest imports test modules under package-qualified names (``tests.test_...``) that a spawned or
forkserver child cannot import, so what a child runs lives here (tests/ is on sys.path via
conftest.py), like _crash_worker.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import pyckpt


def _sd(seed: int, mib: int = 8) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    n = (mib << 20) // 4
    return {"w": torch.randn(n, generator=g), "b": torch.randn(1000, generator=g), "step": seed}


def _save_proc(path: str, seed: int, barrier: Any, q: Any) -> None:
    import warnings

    warnings.simplefilter("ignore")
    sd = _sd(seed, 16)
    try:
        barrier.wait(timeout=120)  # a peer that never starts breaks the barrier: reported
        dcp.save(sd, storage_writer=pyckpt.Writer(path), no_dist=True)
        q.put((seed, "ok", ""))
    except BaseException as e:
        failures = getattr(e, "failures", None) or {}
        inner = next(iter(failures.values()))[0] if failures else e
        q.put((seed, type(inner).__name__, str(inner)))
