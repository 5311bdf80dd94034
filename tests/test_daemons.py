"""A process with daemon threads inside native calls (pyckpt's own, or a torch store's from
pyckpt's heartbeat) when the interpreter exits must exit normally with its own status, not die
of SIGABRT ("terminate called without an active exception": CPython ends such a thread with
pthread_exit as it re-takes the GIL, and the unwind meets a noexcept destructor)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# The heartbeat beats back to back (HEARTBEAT_S = 0): without the exit handler its thread is
# almost always inside store.add when the interpreter finalizes, and the process aborts.
_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from pyckpt import _collective
    from pyckpt._collective import liveness

    liveness.HEARTBEAT_S = 0.0
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = _collective.group_info(None)
    liveness._start_heartbeat(group)
    beats = liveness._pg(group).get_group_store()
    while beats.add("pyckpt/peer-beat/0", 0) < 200:  # the thread is beating
        pass
    print("done", flush=True)
    sys.exit(int(sys.argv[1]))
    """
)


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy())


@pytest.mark.slow
@pytest.mark.parametrize("code", [0, 3])
def test_exit_while_heartbeat_is_inside_a_store_call_does_not_abort(code: int) -> None:
    pytest.importorskip("torch.distributed")
    for _ in range(5):
        proc = _run(_SCRIPT, str(code))
        assert "terminate called" not in proc.stderr, proc.stderr
        assert proc.returncode == code, (proc.returncode, proc.stderr)
        assert proc.stdout.strip() == "done"


# Daemon threads that call a GIL-releasing function of pyckpt._C back to back: at exit they are
# almost always inside it. "raise" ends the main thread with an uncaught exception (status 1).
_NATIVE = textwrap.dedent(
    """
    import sys
    import threading
    import time
    from pyckpt import _C

    buf = bytearray(1 << 20)
    calls = [0]

    def loop():
        while True:
            _C.block_digests([buf], 4096, [0], 1)
            calls[0] += 1

    for _ in range(2):
        threading.Thread(target=loop, daemon=True).start()
    while calls[0] < 20:
        time.sleep(0.01)
    print("done", flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("main thread failed")
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.mark.parametrize(("how", "code"), [("0", 0), ("5", 5), ("raise", 1)])
def test_exit_while_daemon_threads_are_inside_native_calls_does_not_abort(how: str,
                                                                          code: int) -> None:
    for _ in range(5):
        proc = _run(_NATIVE, how)
        assert "terminate called" not in proc.stderr, proc.stderr
        assert proc.returncode == code, (proc.returncode, proc.stderr)
        assert proc.stdout.strip() == "done"
        if how == "raise":
            assert "RuntimeError: main thread failed" in proc.stderr
