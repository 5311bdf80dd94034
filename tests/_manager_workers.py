"""Rank bodies for tests/test_manager.py: a CheckpointManager on several "nodes" of one machine.

Each rank is its own process, started by :func:`launch` with torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) set, so the manager finds its node from ``GROUP_RANK``. The ranks are forked
from the tests' forkserver, which has already imported torch (:class:`dist_utils.RankProcess`):
a new interpreter per rank imported torch again, seconds of CPU each on 2 cores for each of the
4 ranks of every launch. With mount namespaces (the normal test environment: root in a
container) each rank first enters a private mount namespace (:mod:`_mountns`, what ``unshare -m
--propagation private`` + ``mount`` do) where its node's directory ``root/nodes/n<k>`` is bind
mounted on ``root/local`` (the same fast-tier path on every node) and ``root/nodes`` is hidden
under an empty tmpfs, so no rank can reach another node's fast tier by any path. Deleting
``root/nodes/n<k>`` between runs loses that node's fast tier; the durable tier
``root/durable`` (or an ``s3://`` URL) is shared.

Run as a script: ``python _manager_workers.py <spec.json>`` (no namespace); the result of each
rank is written to ``<root>/results/<tag>-<rank>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import warnings
from typing import Any

import torch
from _mountns import bind_and_hide, namespace_refusal, unshare_mounts

__all__ = ["launch", "log_of", "namespace_refusal", "result", "main"]


# ----------------------------------------------------------------------------- state


def expected(step: int, world: int, rank: int) -> dict[str, torch.Tensor]:
    """The values every rank's state holds at ``step`` (its shards of the full tensors)."""
    g = torch.Generator().manual_seed(1000 + step)
    w = torch.randn(64, 33, generator=g)
    h = torch.randn(16, 48, generator=g).to(torch.bfloat16)
    r = torch.randint(-(1 << 30), 1 << 30, (300,), generator=g, dtype=torch.int32)
    return {"w": w.chunk(world, 0)[rank].clone(), "h": h.chunk(world, 1)[rank].clone(), "r": r}


def make_state(step: int, world: int, zeros: bool = False,
               device: str = "cpu") -> dict[str, Any]:
    """The state at ``step``; ``device="cuda"`` puts every tensor (and the mesh) on the GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device, (world,))
    g = torch.Generator().manual_seed(1000 + step)
    w = torch.randn(64, 33, generator=g)
    h = torch.randn(16, 48, generator=g).to(torch.bfloat16)
    r = torch.randint(-(1 << 30), 1 << 30, (300,), generator=g, dtype=torch.int32)
    if zeros:
        w, h, r = torch.zeros_like(w), torch.zeros_like(h), torch.zeros_like(r)
    w, h, r = w.to(device), h.to(device), r.to(device)
    return {
        "w": distribute_tensor(w, mesh, [Shard(0)], src_data_rank=None),
        "h": distribute_tensor(h, mesh, [Shard(1)], src_data_rank=None),
        "r": r,  # replicated: every rank holds it whole; the save spreads it over the ranks
        "extra": {"step": step},
    }


def check(state: dict[str, Any], step: int, world: int, rank: int) -> list[str]:
    want = expected(step, world, rank)
    bad = []
    for k in ("w", "h"):
        got = state[k].to_local().cpu()
        if got.dtype != want[k].dtype or not torch.equal(got.view(torch.uint8),
                                                          want[k].view(torch.uint8)):
            bad.append(k)
    if not torch.equal(state["r"].cpu(), want["r"]):
        bad.append("r")
    if state["extra"]["step"] != step:
        bad.append(f"extra.step={state['extra']['step']}")
    return bad


# ----------------------------------------------------------------------------- isolation


def _rank(spec_path: str, mounts: tuple[str, str, str] | None) -> None:
    """One rank, in a child of the forkserver (:func:`launch`)."""
    if mounts is not None:
        node_dir, local, nodes = mounts
        unshare_mounts()
        bind_and_hide([(node_dir, local)], nodes)
    main(spec_path)


def launch(root: str, nnodes: int, per_node: int, spec: dict[str, Any], *,
           timeout: float = 240.0, grace: float = 45.0) -> list[int]:
    """Starts ``nnodes * per_node`` ranks running ``spec``; returns their exit codes.

    When a rank exits with a failure (an injected crash), the others get ``grace`` seconds to
    notice and exit, then are killed (their process groups), so a crash never hangs the test.
    """
    from _child_env import child_env
    from _ports import free_port
    from dist_utils import RankProcess

    world = nnodes * per_node
    os.makedirs(os.path.join(root, "local"), exist_ok=True)
    os.makedirs(os.path.join(root, "results"), exist_ok=True)
    spec_path = os.path.join(root, f"spec-{spec['tag']}.json")
    with open(spec_path, "w") as fh:
        json.dump(dict(spec, root=root), fh)
    port = free_port()
    env_base = child_env()
    procs = []
    for rank in range(world):
        node = rank // per_node
        node_dir = os.path.join(root, "nodes", f"n{node}")
        os.makedirs(node_dir, exist_ok=True)
        env = dict(env_base, RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
                   GROUP_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        mounts = None
        if spec.get("namespace", True):
            mounts = (node_dir, os.path.join(root, "local"), os.path.join(root, "nodes"))
        else:
            env["PYCKPT_TEST_LOCAL"] = node_dir
        log = os.path.join(root, "results", f"{spec['tag']}-{rank}.log")
        procs.append(RankProcess(_rank, spec_path, mounts, env=env, log=log))
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if first_failure is None and any(c not in (None, 0) for c in codes):
            first_failure = time.monotonic()
        if first_failure is not None and time.monotonic() - first_failure > grace:
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # it had not made its own group yet
                p.send_signal(signal.SIGKILL)
    return [p.wait() for p in procs]


def result(root: str, tag: str, rank: int) -> dict[str, Any]:
    with open(os.path.join(root, "results", f"{tag}-{rank}.json")) as fh:
        out: dict[str, Any] = json.load(fh)
    return out


def log_of(root: str, tag: str, rank: int) -> str:
    try:
        with open(os.path.join(root, "results", f"{tag}-{rank}.log"), errors="replace") as fh:
            return fh.read()[-6000:]
    except FileNotFoundError:
        return ""


# ----------------------------------------------------------------------------- rank body


def _inject_crash(crash: dict[str, Any], rank: int) -> None:
    """Makes this rank die (``os._exit``) in the middle of replication or persistence of a
    given step: after it committed one replica file / uploaded one data file."""
    if crash.get("rank") != rank:
        return
    from pyckpt import _tier_io

    tag = f"step-{crash['step']}"
    if crash["at"] == "replicate":
        original_commit = _tier_io.ReplicaFile.commit

        def commit(self: Any) -> None:
            original_commit(self)
            if tag in self.path:
                os._exit(17)

        _tier_io.ReplicaFile.commit = commit  # type: ignore[method-assign]
    elif crash["at"] == "replace":  # a node's move of a step saved again, not begun
        def replace(self: Any, step: int, work: Any) -> None:
            if step == crash["step"]:
                os._exit(19)

        _tier_io.LocalTier.replace = replace  # type: ignore[method-assign]
    elif crash["at"] == "persist":
        for cls in (_tier_io.DurableTier,):
            original_put = cls.put_file

            def put_file(self: Any, step: int, src: str, _orig: Any = original_put) -> int:
                n = int(_orig(self, step, src))
                if step == crash["step"]:
                    os._exit(18)
                return n

            cls.put_file = put_file  # type: ignore[method-assign]


def main(spec_path: str) -> None:
    import torch.distributed as dist

    import pyckpt

    with open(spec_path) as fh:
        spec = json.load(fh)
    if spec.get("entry"):  # another module's rank body (same launch, spec and results)
        import importlib

        importlib.import_module(spec["entry"]).main(spec_path)
        return
    root = spec["root"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    local = os.environ.get("PYCKPT_TEST_LOCAL", os.path.join(root, "local"))
    if spec.get("local_per_node"):  # one path for every rank; the manager puts in the node id
        local = os.path.join(root, "nodes", "n{node}")
    if spec.get("crash"):
        _inject_crash(spec["crash"], rank)
    durable = spec.get("durable") or os.path.join(root, "durable")
    options = spec.get("manager", {})
    device = spec.get("device", "cpu")
    if device == "cuda":  # every rank shares the one GPU (before the mesh picks LOCAL_RANK's)
        torch.cuda.set_device(0)
    out: dict[str, Any] = {"rank": rank}
    # Which fast-tier paths this rank can see (the namespace hides the other nodes).
    nodes = os.path.join(root, "nodes")
    out["visible_nodes"] = sorted(os.listdir(nodes)) if os.path.isdir(nodes) else []
    mgr = pyckpt.CheckpointManager(durable, local=local if spec.get("fast", True) else None,
                                   storage_options=spec.get("storage_options"), **options)
    if spec["action"] == "train":
        futures = []
        try:
            for step in spec["steps"]:
                fut = mgr.save(step, make_state(step, world, device=device))
                futures.append(None if fut is None else step)
                if fut is not None and step % mgr.persist_every == 0:
                    mgr.wait()  # every due step reaches the durable tier (none superseded)
            mgr.wait()
        except Exception as e:
            if not spec.get("record_error"):
                raise
            out["error"] = {"type": type(e).__name__, "errno": getattr(e, "errno", None),
                            "filename": getattr(e, "filename", None), "text": str(e)}
            mgr.close()
            with open(os.path.join(root, "results", f"{spec['tag']}-{rank}.json"), "w") as fh:
                json.dump(out, fh)
            dist.destroy_process_group()
            return
        out["saved"] = [s for s in futures if s is not None]
        out["footprint"] = mgr.footprint()
        out["last_save"] = vars(mgr.last_save) if mgr.last_save else None
        mgr.close()
        # A later manager in the same process (a restart of the loop) reuses the groups.
        mgr = pyckpt.CheckpointManager(durable, local=local if spec.get("fast", True) else None,
                                       storage_options=spec.get("storage_options"), **options)
        out["steps_seen"] = mgr.steps()
    elif spec["action"] == "restore":
        state = make_state(0, world, zeros=True, device=device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = mgr.restore(state)
        out["step"] = step
        out["devices"] = sorted({(v.to_local() if hasattr(v, "to_local") else v).device.type
                                 for v in state.values() if isinstance(v, torch.Tensor)})
        out["bad"] = [] if step is None else check(state, step, world, rank)
        out["info"] = vars(mgr.last_restore) if mgr.last_restore else None
        out["warnings"] = [(type(w.message).__name__, str(w.message)) for w in caught]
        out["durable_data_bytes_read"] = mgr.store.data_bytes_read
        out["durable_data_files_fetched"] = mgr.store.data_files_fetched
        out["durable_direct_loads"] = mgr.store.direct_loads
        out["durable_metadata_reads"] = mgr.store.metadata_reads
        if spec.get("restore_again"):  # the same layout again: the cached load plan
            from pyckpt import _loaddrive

            before = dict(_loaddrive.stats)
            again = make_state(0, world, zeros=True, device=device)
            out["step_again"] = mgr.restore(again)
            out["bad_again"] = check(again, out["step_again"], world, rank)
            out["restore_again"] = [k for k, v in _loaddrive.stats.items() if v != before[k]]
    mgr.close()
    with open(os.path.join(root, "results", f"{spec['tag']}-{rank}.json"), "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
