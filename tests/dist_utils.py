"""Runs a test function on several CPU ranks (gloo on 127.0.0.1, one process per rank).

Workers stay in the test modules: the parent passes the worker's file path and name, and each
child imports that file by path, so nothing has to be importable by module name.

    def _worker(rank, world_size, tmp):        # in tests/test_x.py, at module level
        ...
    def test_x(tmp_path):
        run_distributed(_worker, 2, str(tmp_path))
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp
from _ports import free_port

__all__ = ["run_distributed", "free_port"]

_TIMEOUT_S = 300


def _child(
    rank: int, path: str, name: str, world_size: int, port: int, args: tuple[Any, ...], q: Any
) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        spec = importlib.util.spec_from_file_location(f"_pyckpt_dist_{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=_TIMEOUT_S),
        )
        try:
            result = getattr(module, name)(rank, world_size, *args)
            q.put((rank, "ok", result))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure to the parent, then fail the child
        q.put((rank, "error", traceback.format_exc()))
        raise


def _context() -> Any:
    # A forkserver that has already imported torch starts ranks in a fraction of the time of
    # "spawn" (each spawned child would import torch again); children still never inherit the
    # test process's threads or state.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "pyckpt.storage"])
    return ctx


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns the results.

    Raises:
        AssertionError: with every failing rank's traceback, if any rank failed.
    """
    path = sys.modules[fn.__module__].__file__
    assert path is not None
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, path, fn.__name__, world_size, port, args, q))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + _TIMEOUT_S
    # Collect results; once a rank fails, the others may block in a collective: stop them.
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = q.get(timeout=0.2)
            outcomes[rank] = (status, payload)
            if status != "ok":
                break
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(5 if len(outcomes) == world_size else 0.5)
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f"rank {r}:\n{payload}" for r, (s, payload) in sorted(outcomes.items()) if s != "ok"]
    missing = [r for r in range(world_size) if r not in outcomes]
    if errors or missing:
        raise AssertionError(
            "distributed test failed\n" + "\n".join(errors)
            + (f"\nranks without a result: {missing}" if missing else "")
        )
    return [outcomes[r][1] for r in range(world_size)]
