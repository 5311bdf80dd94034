"""A process whose pyckpt daemon threads are inside a native store call when the interpreter
exits must exit normally, not die of SIGABRT ("terminate called without an active exception",
from the store binding's noexcept destructor unwound by CPython's pthread_exit)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch.distributed")

# The heartbeat beats back to back (HEARTBEAT_S = 0): without the exit handler its thread is
# almost always inside store.add when the interpreter finalizes, and the process aborts.
_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from pyckpt import _collective

    _collective.HEARTBEAT_S = 0.0
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = _collective.group_info(None)
    _collective._start_heartbeat(group)
    beats = _collective._pg(group).get_group_store()
    while beats.add("pyckpt/peer-beat/0", 0) < 200:  # the thread is beating
        pass
    print("done", flush=True)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.mark.parametrize("code", [0, 3])
def test_exit_while_heartbeat_is_inside_a_store_call_does_not_abort(code: int) -> None:
    for _ in range(5):
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(code)],
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ.copy(),
        )
        assert "terminate called" not in proc.stderr, proc.stderr
        assert proc.returncode == code, (proc.returncode, proc.stderr)
        assert proc.stdout.strip() == "done"
