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
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp
from _ports import free_port

__all__ = ["run_distributed", "free_port", "RankProcess"]

_TIMEOUT_S = 300


def _load(path: str, name: str) -> Callable[..., Any]:
    """Function ``name`` of the file ``path``, imported by path (a child of the forkserver)."""
    spec = importlib.util.spec_from_file_location(f"_pyckpt_rank_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fn: Callable[..., Any] = getattr(module, name)
    return fn


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
        fn = _load(path, name)
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=_TIMEOUT_S),
        )
        try:
            result = fn(rank, world_size, *args)
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


def _redirected(path: str, name: str, args: tuple[Any, ...], env: dict[str, str],
                out: Any, err: Any) -> None:
    os.environ.update(env)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    _load(path, name)(*args)


def _logged(path: str, name: str, args: tuple[Any, ...], env: dict[str, str], log: str) -> None:
    os.setsid()  # its own process group, as Popen(start_new_session=True): killpg reaches it
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    _load(path, name)(*args)


class RankProcess:
    """``fn(*args)`` in a child of the forkserver that has already imported torch, with the
    child's stdout and stderr on pipes read here as text (the parts of ``subprocess.Popen(...,
    stdout=PIPE, stderr=PIPE, text=True)`` that tests which kill ranks one by one use). A new
    interpreter per rank imported torch again: seconds of CPU each on 2 cores, for every rank of
    every kill point. ``fn`` is a module-level function of a file in tests/; ``env`` is added to
    the child's environment. With ``log`` (a file path) the child's stdout and stderr go to that
    file instead (``stdout``/``stderr`` are then None) and the child leads a new session (its
    own process group, as ``Popen(..., start_new_session=True)``)."""

    def __init__(self, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None,
                 log: str | None = None):
        path = sys.modules[fn.__module__].__file__
        assert path is not None
        ctx = _context()
        self.stdout: Any = None
        self.stderr: Any = None
        if log is not None:
            self._proc = ctx.Process(target=_logged,
                                     args=(path, fn.__name__, args, dict(env or {}), log))
            self._proc.start()
            self.pid = self._proc.pid
            return
        out_r, out_w = ctx.Pipe(duplex=False)
        err_r, err_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_redirected,
                                 args=(path, fn.__name__, args, dict(env or {}), out_w, err_w))
        self._proc.start()
        out_w.close()
        err_w.close()
        self.pid = self._proc.pid
        self.stdout = os.fdopen(os.dup(out_r.fileno()), "r")
        self.stderr = os.fdopen(os.dup(err_r.fileno()), "r")
        out_r.close()
        err_r.close()

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0)
        return self._proc.exitcode


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
