"""Rank scripts for tests/test_manager_peers.py: a CheckpointManager whose peer stops or dies.

Run as a real interpreter per rank (the survivor's exit, interpreter shutdown included, is part
of what is tested)::

    python _manager_peer_workers.py FAULT RANK WORLD PORT ROOT

Two ranks, each its own "node" (``node=`` and ``{node}`` in ``local``), ``replicas=1``. The
last rank injects ``FAULT`` at a fixed point inside the fast-tier save, where DCP's own
collectives run on the manager's group: its first ``Writer.write_data`` sends itself
``SIGSTOP`` (``stop``: a frozen process) or ``SIGKILL`` (``kill``). Rank 0 saves, waits, and
prints one JSON line (``{"type", "message", "rank", "seconds"}``), then leaves the script as a
trainer that gives up would: the test measures how long its interpreter takes to exit.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from typing import Any

import torch

# The job's own timeout: far longer than the peer bound (PYCKPT_PEER_TIMEOUT, set small by the
# test), so a survivor that answers in time did so because of pyckpt's bound.
GROUP_TIMEOUT_S = 900


def _inject(fault: str) -> None:
    import pyckpt._tier_io
    import pyckpt.storage

    how, _, where = fault.partition("-")
    sig = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}[how]
    # write: inside DCP's save (its collectives run on the manager's group); prepare: inside
    # the manager's own first agreement of the save (pyckpt's collective).
    cls: Any = pyckpt.storage.Writer if where == "write" else pyckpt._tier_io.LocalTier
    name = "write_data" if where == "write" else "prepare"
    original = getattr(cls, name)

    def injected(self: Any, *args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), sig)
        return original(self, *args, **kwargs)

    setattr(cls, name, injected)


def main(fault: str, rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist

    import pyckpt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    state = {"w": torch.arange(256 * 64, dtype=torch.float32).view(256, 64), "step": 1}
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        with pyckpt.CheckpointManager(os.path.join(root, "durable"),
                                      os.path.join(root, "nodes", "{node}"), replicas=1,
                                      persist_every=100, node=f"n{rank}") as mgr:
            if rank == world - 1:
                _inject(fault)
            print("ready", flush=True)
            t0 = time.monotonic()
            mgr.save(1, state)
            mgr.wait()
        out["type"] = None
    except Exception as e:
        out.update(type=type(e).__name__, message=str(e), rank=getattr(e, "rank", None),
                   mro=[c.__name__ for c in type(e).__mro__])
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
