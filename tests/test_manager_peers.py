"""A CheckpointManager whose peer freezes (SIGSTOP) or dies (SIGKILL) inside its fast-tier save,
where DCP's own collectives run on the manager's group: the survivor raises ``PeerLostError``
naming the rank within the peer bound (not after torch's 30-minute default, not as gloo's
untyped ``RuntimeError``), and its interpreter then exits promptly.

Each rank is a real interpreter (tests/_manager_peer_workers.py), so the exit measured includes
interpreter shutdown (threads, exit handlers, process groups).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _child_env import child_env
from _ports import free_port

from pyckpt._collective import liveness

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # the slow lane: every case kills or freezes a rank

PEER_TIMEOUT_S = 3
# The bound of the survivor's wait after the fault: the peer bound, the heartbeat check, the
# check-in that names the rank, and slack for 2 shared cores.
BOUND_S = PEER_TIMEOUT_S + 2.5 * liveness.HEARTBEAT_S + liveness.CHECK_IN_S + 15
# How long the survivor's interpreter may take to exit after reporting.
EXIT_S = 20.0
WORKER = str(Path(__file__).with_name("_manager_peer_workers.py"))


def _run(fault: str, root: Path) -> tuple[dict[str, Any], float]:
    """Runs 2 ranks; returns rank 0's report and the seconds its process took to exit after."""
    port = free_port()
    env = child_env(PYCKPT_PEER_TIMEOUT=str(PEER_TIMEOUT_S), PYTHONUNBUFFERED="1",
                    PYCKPT_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, WORKER, fault, str(r), "2", str(port), str(root)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    lines: list[str] = []
    reported = threading.Event()

    def read() -> None:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            if line.startswith("{"):
                lines.append(line)
                reported.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # Start-up (torch imports on 2 cores), then the bounded wait.
        assert reported.wait(90 + BOUND_S), (
            f"rank 0 did not report within {90 + BOUND_S} s: {procs[0].stderr}")
        at = time.monotonic()
        try:
            procs[0].wait(EXIT_S + 30)
        except subprocess.TimeoutExpired:
            pass
        exited = time.monotonic() - at if procs[0].poll() is not None else float("inf")
        return json.loads(lines[0]), exited
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(30)
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()


@pytest.mark.parametrize("fault", ["stop-write", "kill-write", "stop-prepare"])
def test_survivor_raises_peer_lost_naming_the_rank_and_exits(tmp_path: Path, fault: str) -> None:
    report, exited = _run(fault, tmp_path)
    assert report["type"] == "PeerLostError", report
    assert "RuntimeError" in report["mro"], report
    assert report["rank"] == 1 and "rank 1 of 2" in report["message"], report
    assert report["seconds"] <= BOUND_S, report
    assert exited <= EXIT_S, (exited, report)
