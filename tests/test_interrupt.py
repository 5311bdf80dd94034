"""Ctrl-C during long native work: the save stops between chunks, cleans up, and raises
KeyboardInterrupt; the previous checkpoint in the directory still loads."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _child_env import child_env

# The child saves a small checkpoint, then starts a long one into the same directory (zstd at
# level 19 on one thread: tens of seconds of native work for 96 MiB, in 256 KiB chunks, so the
# chunk being encoded when the signal lands is short) and reports the monotonic time at which
# KeyboardInterrupt reached Python. It then checks what a user relies on.
_CHILD = textwrap.dedent(
    """
    import glob, os, signal, sys, time
    import torch
    import pyckpt

    # Python turns SIGINT into KeyboardInterrupt only if the parent did not ignore it, and a
    # job started in the background by a non-interactive shell (`cmd &`, as CI runners do)
    # inherits SIGINT ignored: install Python's own handler, as an interactive start has it.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    path = sys.argv[1]
    torch.manual_seed(0)
    small = {"w": torch.randn(1000, 37)}
    pyckpt.save(small, path)
    big = {f"t{i}": torch.randn(4096, 4096, dtype=torch.bfloat16) for i in range(3)}
    print("SAVING", flush=True)
    try:
        pyckpt.save(big, path, compression="zstd", level=19, threads=1,
                    chunk_bytes=256 << 10)
    except KeyboardInterrupt:
        print(f"INTERRUPTED {time.monotonic():.6f}", flush=True)
    else:
        print("COMPLETED", flush=True)
        sys.exit(3)
    back = {"w": torch.zeros(1000, 37)}
    pyckpt.load(back, path)
    assert torch.equal(back["w"], small["w"]), "previous checkpoint changed"
    left = [p for p in os.listdir(path) if ".tmp" in p]
    assert not left, f"temp files left behind: {left}"
    print("PREVIOUS OK", flush=True)
    """
)


def _wait_for_temp(path: Path, proc: subprocess.Popen[str], deadline: float) -> None:
    """Waits until the long save has a temp data file with bytes in it (native work running)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"child exited early ({proc.returncode}):\n{out}\n{err}")
        for p in path.glob("*.tmp*") if path.is_dir() else []:
            try:
                if p.stat().st_size > 0:
                    return
            except FileNotFoundError:
                continue
        time.sleep(0.02)
    proc.kill()
    pytest.fail("the long save never started writing its data file")


def test_sigint_during_native_save_raises_keyboard_interrupt_quickly(tmp_path):
    ckpt = tmp_path / "ckpt"
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ckpt)], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        # Generous deadline: it detects a child that hangs before saving, not a slow machine.
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "SAVING", line + proc.stderr.read() if proc.stderr else ""
        _wait_for_temp(ckpt, proc, time.monotonic() + 600)
        time.sleep(0.2)  # well inside the native encode loop
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = out.splitlines()
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{out}\n{err}"
    interrupted = [ln for ln in lines if ln.startswith("INTERRUPTED ")]
    assert interrupted, out
    latency = float(interrupted[0].split()[1]) - sent
    # The save had tens of seconds of work left; the interrupt must land between chunks.
    print(f"KeyboardInterrupt {latency:.3f} s after SIGINT")
    assert latency < 1.0, f"KeyboardInterrupt arrived {latency:.2f} s after SIGINT"
    assert "PREVIOUS OK" in lines, out + err
