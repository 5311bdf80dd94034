"""Several pyckpt.CheckpointManagers over the same ranks (say one for the training state and one
for EMA weights): their background saves and persistences use the same gloo groups, so they
must take turns, in the order the training called them, or the ranks pair one manager's
collectives with the other's (a hang until the group's timeout, or plans of one save in the
other). Each rank waits at most WAIT_S for a future: a hang fails the test instead of waiting
for the group's timeout."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dist_utils import run_distributed

WAIT_S = 60


def _states(step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    a = {"w": torch.arange(100_000, dtype=torch.float32) * step, "k": step}
    b = {"ema": torch.full((300, 7), float(-step), dtype=torch.bfloat16),
         "n": torch.arange(50_000) * step}
    if step % 3 == 0:  # a structure change: that save plans again
        b["extra"] = torch.ones(11) * step
    return a, b


def _same(saved: dict[str, Any], got: dict[str, Any]) -> bool:
    import torch

    return saved.keys() == got.keys() and all(
        torch.equal(v, got[k]) and v.dtype == got[k].dtype if isinstance(v, torch.Tensor)
        else v == got[k] for k, v in saved.items())


def _fresh(sd: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in sd.items()}


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    import pyckpt

    # A: durable only (its saves on the "fast" group's lane); B: a fast tier per rank, copied
    # to its durable tier in the background (the "persist" group's lane too).
    ma = pyckpt.CheckpointManager(os.path.join(root, "A"), keep_durable=10, fsync=False)
    mb = pyckpt.CheckpointManager(os.path.join(root, "B"),
                                  local=os.path.join(root, "local-{node}"), node=str(rank),
                                  replicas=0, persist_every=2, keep_local=10, keep_durable=10,
                                  fsync=False)
    futures = []
    for step in range(1, 7):  # never waiting in between: A's save and B's are in flight at once
        a, b = _states(step)
        futures += [ma.save(step, a), mb.save(step, b)]
    done = [f.result(timeout=WAIT_S) for f in futures]
    # a restore and a new manager while the other manager's save is in flight
    pending = ma.save(7, _states(7)[0])
    b6 = _states(6)[1]
    got_b = _fresh(b6)
    restored_b = mb.restore(got_b)
    mc = pyckpt.CheckpointManager(os.path.join(root, "C"), fsync=False)
    pending.result(timeout=WAIT_S)
    a7 = _states(7)[0]
    got_a = _fresh(a7)
    restored_a = ma.restore(got_a)
    for m in (ma, mb, mc):
        m.close()
    # every durable step of A and B loads back exactly as saved (B's fast-tier copies persisted)
    exact = []
    for step in range(1, 8):
        for name, sd in zip("AB", _states(step)):
            path = os.path.join(root, name, f"step-{step}")
            if os.path.isdir(path):
                got = _fresh(sd)
                pyckpt.load(got, path)
                exact.append((name, step, _same(sd, got)))
    return {"done": done, "restored": (restored_a, restored_b), "a": _same(a7, got_a),
            "b": _same(b6, got_b), "exact": exact}


def test_two_managers_over_the_same_ranks_take_turns(tmp_path: Path) -> None:
    for res in run_distributed(_worker, 2, str(tmp_path)):
        assert res["done"] == [s for s in range(1, 7) for _ in "AB"], res
        assert res["restored"] == (7, 6) and res["a"] and res["b"], res
        assert all(ok for _, _, ok in res["exact"]), res["exact"]
        assert {(n, s) for n, s, _ in res["exact"]} >= {("A", s) for s in range(1, 8)}, res
        assert any(n == "B" for n, _, _ in res["exact"]), res
