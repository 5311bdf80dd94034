"""Rank bodies for tests/test_nodelocal.py: node-local checkpoints with no shared filesystem.

Layout under the test's ``root``: ``nodes/n<k>/`` is node k's local disk. A rank on node k sees
only that directory, and sees it under the same path as every other rank (``root/ckpt``, or
``root/export`` for consolidation outputs):

* With mount namespaces (root in a Linux container, the normal test environment), each rank
  process unshares its mount namespace, bind-mounts its node's directories onto the common
  paths, then mounts an empty tmpfs over ``root/nodes``: no path reaches another node's files.
* Every rank also records every file it opens from Python (an audit hook on ``open``), and the
  test asserts that none lies in another node's directory.

If mount namespaces are refused, :func:`isolate` falls back to giving each rank its node
directory by its real path (``mode == "paths"``); the audit-hook check still runs, and the test
that needs the namespace skips with the reason.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from _mountns import bind_and_hide, mount_tmpfs, namespace_refusal, unshare_mounts

__all__ = ["namespace_refusal", "isolate", "foreign_opens", "other_nodes_visible"]

_opened: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.path.abspath(os.fsdecode(args[0])))


def isolate(root: str, node: int, names: tuple[str, ...] = ("ckpt",)) -> tuple[dict[str, str], str]:
    """Gives this rank node ``node``'s directories only; returns ({name: path}, mode).

    Each ``name`` maps to ``root/<name>`` (namespace mode, the same path on every rank) or to
    ``root/nodes/n<node>/<name>`` (paths mode). Starts recording opened files.
    """
    sys.addaudithook(_audit)
    own = {n: os.path.join(root, "nodes", f"n{node}", n) for n in names}
    for path in own.values():
        os.makedirs(path, exist_ok=True)
    if os.environ.get("PYCKPT_TEST_NO_NAMESPACE") == "1":
        return own, "paths"
    try:
        unshare_mounts()
    except OSError:
        return own, "paths"
    common = {n: os.path.join(root, n) for n in own}
    bind_and_hide([(own[n], common[n]) for n in own], os.path.join(root, "nodes"))
    return common, "namespace"


def foreign_opens(root: str, node: int) -> list[str]:
    """Files this rank opened from another node's directory (must stay empty)."""
    mine = os.path.join(root, "nodes", f"n{node}") + os.sep
    nodes = os.path.join(root, "nodes") + os.sep
    return [p for p in _opened if p.startswith(nodes) and not p.startswith(mine)]


def other_nodes_visible(root: str, node: int, nnodes: int) -> list[str]:
    """Files of other nodes this rank can list (empty in namespace mode)."""
    seen = []
    for k in range(nnodes):
        if k == node:
            continue
        d = os.path.join(root, "nodes", f"n{k}")
        if os.path.isdir(d):
            for dirpath, _, files in os.walk(d):
                seen.extend(os.path.join(dirpath, f) for f in files)
    return seen


# ----------------------------------------------------------------------------- state


ROWS, COLS = 24, 10


def full_state(seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(ROWS, COLS, generator=g),
        "h": torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16),
        "v": torch.randint(-1000, 1000, (37,), generator=g, dtype=torch.int32),
        "c": torch.randn(3, 4, 5, generator=g).to(torch.float16),
    }


_PLACEMENT_DIM = {"w": 0, "h": 1, "v": 0, "c": 2}


def sharded(world: int, zeros: bool, dims: dict[str, int] | None = None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dims = dims or _PLACEMENT_DIM
    sd: dict[str, Any] = {}
    for k, v in full_state().items():
        src = torch.zeros_like(v) if zeros else v
        sd[k] = distribute_tensor(src, mesh, [Shard(dims[k])], src_data_rank=None)
    sd["step"] = 7
    return sd


def _check_loaded(sd: dict[str, Any], world: int, dims: dict[str, int]) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    bad = []
    for k, v in full_state().items():
        want = distribute_tensor(v, mesh, [Shard(dims[k])], src_data_rank=None).to_local()
        got = sd[k].to_local()
        if got.dtype != want.dtype or not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            bad.append(k)
    if sd["step"] != 7:
        bad.append("step")
    return bad


# ----------------------------------------------------------------------------- rank bodies


def save_worker(rank: int, world: int, root: str, per_node: int, compression: str | None) -> Any:
    import pyckpt

    node = rank // per_node
    paths, mode = isolate(root, node)
    sd = sharded(world, zeros=False)
    pyckpt.save(sd, paths["ckpt"], shared_filesystem=False, compression=compression)
    return {"mode": mode, "foreign": foreign_opens(root, node),
            "visible": other_nodes_visible(root, node, world)}


def load_worker(rank: int, world: int, root: str, per_node: int) -> Any:
    import pyckpt

    node = rank // per_node
    paths, mode = isolate(root, node)
    dims = {"w": 1, "h": 0, "v": 0, "c": 1}  # another sharding than the save's
    sd = sharded(world, zeros=True, dims=dims)
    sd["step"] = 0
    pyckpt.load(sd, paths["ckpt"], shared_filesystem=False)
    return {"mode": mode, "bad": _check_loaded(sd, world, dims),
            "foreign": foreign_opens(root, node)}


def shared_save_worker(rank: int, world: int, root: str) -> Any:
    """Saves the same state as :func:`save_worker` into one directory every rank sees."""
    import pyckpt

    pyckpt.save(sharded(world, zeros=False), os.path.join(root, "shared"), compression="zstd")


def auto_load_worker(rank: int, world: int, root: str, per_node: int, isolated: bool) -> Any:
    """``pyckpt.load(..., shared_filesystem="auto")`` of the node-local checkpoint (isolated
    ranks) or of :func:`shared_save_worker`'s; counts the rounds of transfers between ranks."""
    import pyckpt
    from pyckpt.backends import peer as _peer

    node = rank // per_node
    if isolated:
        paths, _ = isolate(root, node)
        path = paths["ckpt"]
    else:
        path = os.path.join(root, "shared")
    exchanges = []
    made = _peer.Exchange.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        exchanges.append(1)
        made(self, *args, **kwargs)

    _peer.Exchange.__init__ = counting  # type: ignore[method-assign]
    dims = {"w": 1, "h": 0, "v": 0, "c": 1}  # another sharding than the save's
    sd = sharded(world, zeros=True, dims=dims)
    sd["step"] = 0
    # cooperative=False: counts the node-local transfers only (a cooperative load of the shared
    # chunks would run its own rounds, on a shared directory too).
    pyckpt.load(sd, path, shared_filesystem="auto", cooperative=False)
    return {"bad": _check_loaded(sd, world, dims), "exchanges": len(exchanges),
            "foreign": foreign_opens(root, node) if isolated else []}


def load_error_worker(rank: int, world: int, root: str, per_node: int) -> Any:
    import pyckpt

    node = rank // per_node
    paths, _ = isolate(root, node)
    sd = sharded(world, zeros=True)
    try:
        pyckpt.load(sd, paths["ckpt"], shared_filesystem=False)
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e),
                "filename": getattr(e, "filename", None)}
    return {"type": None}


def failing_save_worker(rank: int, world: int, root: str) -> Any:
    """Rank 1's disk is full (a 16 KiB tmpfs): its write_data fails after rank 0 wrote."""
    import pyckpt

    paths, mode = isolate(root, rank)
    assert mode == "namespace"
    if rank == 1:
        mount_tmpfs(paths["ckpt"], "size=16k")
    sd = sharded(world, zeros=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    big = torch.ones(256 << 10, dtype=torch.uint8)  # 128 KiB per rank
    sd["big"] = distribute_tensor(big, mesh, [Shard(0)], src_data_rank=None)
    try:
        pyckpt.save(sd, paths["ckpt"], shared_filesystem=False, direct_io="off")
    except Exception as e:
        return {"type": type(e).__name__, "listing": sorted(os.listdir(paths["ckpt"]))}
    return {"type": None}


def consolidate_worker(rank: int, world: int, root: str, per_node: int, kwargs: dict) -> Any:
    import pyckpt

    node = rank // per_node
    paths, mode = isolate(root, node, ("ckpt", "export"))
    res = pyckpt.consolidate(paths["ckpt"], paths["export"], shared_filesystem=False,
                             fsync=False, **kwargs)
    return {"mode": mode, "files": [os.path.basename(f) for f in res.files],
            "rank_bytes": res.rank_bytes, "total": res.total_bytes,
            "phases": res.phases, "seconds": res.seconds,
            "foreign": foreign_opens(root, node)}


def consolidate_error_worker(rank: int, world: int, root: str, per_node: int,
                             kwargs: dict) -> Any:
    """As :func:`consolidate_worker`, returning the error (type, message) instead of raising."""
    import pyckpt

    node = rank // per_node
    paths, _ = isolate(root, node, ("ckpt", "export"))
    try:
        pyckpt.consolidate(paths["ckpt"], paths["export"], shared_filesystem=False,
                           fsync=False, **kwargs)
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


def agree_worker(rank: int, world: int) -> Any:
    """pyckpt._collective.agree: rank 1 fails; every rank cleans up and raises its type."""
    from pyckpt._collective import agree, group_info

    group = group_info(None)
    cleaned = []

    def work() -> int:
        if rank == 1:
            raise KeyError("boom on rank 1")
        return rank * 10

    out: dict[str, Any] = {}
    try:
        agree(work, group, on_failure=lambda: cleaned.append(rank), what="test step")
    except KeyError as e:
        out["raised"] = "KeyError"
        out["notes"] = list(getattr(e, "__notes__", []))
    value, values = agree(lambda: rank * 10, group)
    out["value"], out["values"] = value, values
    root_value, _ = agree(lambda: {"plan": 42}, group, ranks="root")
    out["root"] = root_value
    out["cleaned"] = cleaned
    return out


def consolidate_kill_main(rank: int, world: int, port: int, root: str) -> None:
    """Process body (run as a script): rank 1 dies while copying, before any commit."""
    import datetime

    import torch.distributed as dist

    import pyckpt

    paths, _ = isolate(root, rank, ("ckpt", "export"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))

    def progress(done: int, total: int) -> None:
        if rank == 1 and done > 0:
            os._exit(17)

    try:
        pyckpt.consolidate(paths["ckpt"], paths["export"], shared_filesystem=False,
                           fsync=False, progress=progress, batch_bytes=4096,
                           max_file_bytes=500)
    except Exception as e:
        print(f"ERROR {type(e).__name__}", flush=True)
        os._exit(3)
    print("OK", flush=True)
    os._exit(0)


if __name__ == "__main__":
    consolidate_kill_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
