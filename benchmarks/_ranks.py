"""Starting a benchmark's ranks as processes with torchrun's variables, on one machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def run_ranks(script: str, spec: Mapping[str, Any], world: int, per_node: int,
              timeout: float, env: Mapping[str, str] | None = None) -> Any:
    """Writes ``spec`` to ``<spec["work"]>/spec.json``, starts ``world`` processes of
    ``script --rank-main <spec.json>`` (``per_node`` ranks per "node": ``GROUP_RANK``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; gloo on 127.0.0.1), waits up to ``timeout`` seconds
    and returns the JSON the ranks wrote to ``spec["result"]``. Ranks still running when it
    returns or raises are killed.

    Raises:
        SystemExit: a rank exited with a non-zero code.
    """
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from _ports import free_port

    spec_path = os.path.join(spec["work"], "spec.json")
    with open(spec_path, "w") as f:
        json.dump(dict(spec), f)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            renv = dict(env if env is not None else os.environ, RANK=str(rank),
                        WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
                        LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(script), "--rank-main", spec_path], env=renv))
        deadline = time.monotonic() + timeout
        codes = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
        if any(codes):
            raise SystemExit(f"ranks failed: exit codes {codes}")
        with open(spec["result"]) as f:
            return json.load(f)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
