"""Rank processes for tests/test_peer_faults.py: node-local operations with a rank killed.

One process per rank: :func:`main` forked from the tests' preloaded server
(``dist_utils.RankProcess``), or the script run by hand::

    python _peer_fault_workers.py OP RANK WORLD PORT ROOT

``OP`` is ``save`` (a node-local save of :func:`state`), ``load`` (a node-local load of it at
another sharding) or ``consolidate``. Each rank sees only its own node's directories (see
tests/_nodelocal_workers.py). A rank prints ``ready`` once its process group is up and it is
about to start the operation, then one JSON line: ``{"ok": true, "seconds": ...}`` or
``{"ok": false, "type": ..., "message": ..., "rank": ..., "seconds": ...}``, and exits at
stays alive (as a trainer that handles the error would) until the test kills it: a survivor
must not depend on the other survivors exiting.

The read batches of a load and the exchange batches of a consolidation are made small, so an
operation runs many exchange rounds and a kill lands inside one.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _nodelocal_workers import isolate

# The process group's own timeout: far longer than pyckpt's bound on its exchanges, so a
# survivor that returns in time did so because of pyckpt's bound, not gloo's.
GROUP_TIMEOUT_S = 900
TENSORS = 16
ROWS, COLS = 64, 256  # 64 KiB of float32 per tensor


def state(world: int, zeros: bool, dim: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    sd: dict[str, Any] = {}
    for i in range(TENSORS):
        full = torch.randn(ROWS, COLS, generator=g)
        src = torch.zeros_like(full) if zeros else full
        sd[f"layers.{i}.w"] = distribute_tensor(src, mesh, [Shard(dim)], src_data_rank=None)
    return sd


def _prepare(op: str, rank: int, world: int, root: str) -> Any:
    """Everything before the operation itself (imports, the state to load into), so that the
    operation starts right after ``ready`` and kill points fall inside it."""
    import pyckpt
    import pyckpt.storage

    if op == "save":
        sd = state(world, zeros=False, dim=0)
        return lambda: pyckpt.save(sd, os.path.join(root, "ckpt"), shared_filesystem=False,
                                   compression="zstd")
    if op == "load":
        pyckpt.storage._READ_BATCH_BYTES = 16 << 10  # type: ignore[attr-defined]
        sd = state(world, zeros=True, dim=1)  # another sharding than the save's
        return lambda: pyckpt.load(sd, os.path.join(root, "ckpt"), shared_filesystem=False)
    if op == "consolidate":
        return lambda: pyckpt.consolidate(
            os.path.join(root, "ckpt"), os.path.join(root, "export"), shared_filesystem=False,
            fsync=False, batch_bytes=8 << 10, max_file_bytes=256 << 10)
    raise ValueError(op)


def busy_rank_worker(rank: int, world: int, busy_s: float) -> Any:
    """Rank 1 works ``busy_s`` seconds (longer than the peer timeout) between two collectives;
    rank 0 waits for it in the second. Returns what each rank got, the seconds it spent from the
    first collective's end to the second's, and the ``time.monotonic()`` (one clock for every
    process of the machine) at which the second ended, and on rank 1 its work ended."""
    from pyckpt import _knobs
    from pyckpt._collective import all_gather, group_info

    group = group_info(None)
    out: dict[str, Any] = {}
    with _knobs.override(peer_timeout=2):
        all_gather(rank, group)
        t0 = time.monotonic()
        if rank == 1:
            time.sleep(busy_s)  # local work; this rank's heartbeat keeps beating
            out["busy_end"] = time.monotonic()
        out["got"] = all_gather(rank * 10, group)
    out["end"] = time.monotonic()
    out["waited"] = out["end"] - t0
    return out


def joins_during_the_check_worker(rank: int, world: int) -> Any:
    """Rank 1 stops beating (as a rank does whose job ends), then joins rank 0's collective
    while rank 0 is checking the heartbeats (it waited past the 2 s peer timeout) and leaves;
    rank 0 must see the collective complete, not a lost rank. Returns what
    :func:`busy_rank_worker` returns."""
    from pyckpt import _daemons, _knobs
    from pyckpt._collective import all_gather, group_info

    group = group_info(None)
    out: dict[str, Any] = {}
    with _knobs.override(peer_timeout=2):
        all_gather(rank, group)  # starts this rank's heartbeat
        t0 = time.monotonic()
        if rank == 1:
            _daemons.stopping.set()  # its heartbeat thread ends at once
            # Rank 0 polls every second: past the 2 s bound it reads the heartbeats, waits
            # 2.5 beats (5 s) and reads them again; join in the middle of that.
            time.sleep(4.0)
            out["busy_end"] = time.monotonic()
        out["got"] = all_gather(rank * 10, group)
    out["end"] = time.monotonic()
    out["waited"] = out["end"] - t0
    return out


def _step_then_commit(step: Any, commit: Any, group: Any, what: str = "operation",
                      root: int = 0) -> tuple[Any, Any]:
    """An export's agreement: every rank's step agreed, then ``root``'s commit (its result on
    ``root``, None on the others)."""
    from pyckpt._collective import agree

    value, _ = agree(step, group, what=what)
    done, _ = agree(commit, group, ranks="root", what="commit", root=root)
    return value, done if group.rank == root else None


def report_busy_worker(rank: int, world: int, busy_s: float) -> Any:
    """An export's agreement (its copy, then its commit) where rank 1's step works ``busy_s``
    seconds, longer than the peer timeout: rank 0 waits for it. Returns what
    each rank got, the seconds the call took and, on rank 1, when its work ended."""
    from pyckpt import _knobs
    from pyckpt._collective import all_gather, group_info

    group = group_info(None)
    out: dict[str, Any] = {}

    def step() -> int:
        if rank == 1:
            time.sleep(busy_s)  # local work; this rank's heartbeat keeps beating
            out["busy_end"] = time.monotonic()
        return rank * 10

    with _knobs.override(peer_timeout=2):
        all_gather(rank, group)
        t0 = time.monotonic()
        value, root_value = _step_then_commit(step, lambda: "committed", group)
    out["end"] = time.monotonic()
    out["waited"] = out["end"] - t0
    out["got"] = (value, root_value)
    return out


def report_silent_worker(rank: int, world: int, root: int = 0) -> Any:
    """The rank that is not ``root`` stops beating (as a stopped or wedged process does) and
    never reports; the root, waiting for it in an export's agreement, must raise
    PeerLostError naming it, within the peer timeout and the checks after it. Returns the
    root's error and how long it waited (an export roots at its last rank, rank 1 here)."""
    from pyckpt import _daemons, _knobs
    from pyckpt._collective import all_gather, group_info
    from pyckpt.errors import PeerLostError

    group = group_info(None)
    out: dict[str, Any] = {}
    with _knobs.override(peer_timeout=2):
        all_gather(rank, group)  # starts both heartbeats
        if rank != root:
            _daemons.stopping.set()  # its heartbeat ends: silent from now on
            time.sleep(25.0)  # past the root's bound (2 s), beat check (5 s) and check-in (5 s)
            return out
        t0 = time.monotonic()
        try:
            _step_then_commit(lambda: 0, lambda: "committed", group, what="consolidation",
                              root=root)
            out["error"] = None
        except PeerLostError as e:
            out["error"] = (str(e), e.rank, e.operation)
        out["waited"] = time.monotonic() - t0
    return out


def _kill_at_round(rank: int) -> None:
    """With ``PYCKPT_TEST_KILL_RANK`` = this rank: SIGKILLs this process as it enters exchange
    round ``PYCKPT_TEST_KILL_ROUND`` (1-based) of a node-local or cooperative load (a kill point
    that does not depend on timing)."""
    if os.environ.get("PYCKPT_TEST_KILL_RANK") != str(rank):
        return
    import signal

    from pyckpt.backends import peer

    at = int(os.environ["PYCKPT_TEST_KILL_ROUND"])
    original = peer.Exchange.fetch
    calls = [0]

    def fetch(self: Any, needs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, needs)

    peer.Exchange.fetch = fetch  # type: ignore[method-assign]


def main(op: str, rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist

    paths, _ = isolate(root, rank, ("ckpt", "export"))
    root_view = os.path.dirname(paths["ckpt"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    run = _prepare(op, rank, world, root_view)
    _kill_at_round(rank)
    dist.barrier()
    print("ready", flush=True)
    t0 = time.monotonic()
    try:
        run()
        out: dict[str, Any] = {"ok": True}
    except Exception as e:
        out = {"ok": False, "type": type(e).__name__, "message": str(e),
               "rank": getattr(e, "rank", None), "operation": getattr(e, "operation", None),
               "mro": [c.__name__ for c in type(e).__mro__]}
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
