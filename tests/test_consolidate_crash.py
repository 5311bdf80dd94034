"""Crash safety of consolidate's outputs: a consolidating process is SIGKILLed at seeded points.

After any kill, an export directory either holds no ``model.safetensors.index.json`` (not a
complete export) or every file that index names loads, with ``safetensors``, bit-exact as ONE
export: the previous one (re-export into the same directory) or the new one -- never a mix of
old and new shards under an index. The child slows each ``os.replace`` by a few milliseconds so
that kills land inside the commit (renames, then the index) as well as in the copying.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pyckpt
from pyckpt._consolidate import INDEX_NAME

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.slow]  # the slow lane: SIGKILLs a consolidating process at many points

POINTS = 16
_CHILD = r"""
import os, sys, time
import pyckpt
_replace = os.replace
def _slow_replace(a, b):  # widen the commit window for the kill
    time.sleep(0.02)
    _replace(a, b)
os.replace = _slow_replace
print("start", flush=True)
pyckpt.consolidate(sys.argv[1], sys.argv[2], max_file_bytes=int(sys.argv[3]))
print("done", flush=True)
"""


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(512, 1024, generator=g) for i in range(8)}  # 16 MiB


def _export_of(dst: Path) -> dict[str, torch.Tensor] | None:
    index = dst / INDEX_NAME
    if not index.exists():
        return None
    weight_map = json.loads(index.read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        out.update(load_file(str(dst / name)))
    assert set(out) == set(weight_map), "the index and its files disagree"
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _run(src: Path, dst: Path, kill_after: float | None,
         max_file_bytes: int = 4 << 20) -> tuple[bool, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(dst), str(max_file_bytes)],
                         stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    try:
        assert p.stdout.readline().strip() == "start"
        t0 = time.monotonic()
        if kill_after is None:
            assert p.stdout.readline().strip() == "done"
            # The export's duration ends at "done": the interpreter's exit after it (seconds
            # on a loaded machine) is not export time, and counted in it moved every kill
            # past the end of the export.
            duration = time.monotonic() - t0
            p.wait(120)
            return True, duration
        time.sleep(kill_after)
        p.send_signal(signal.SIGKILL)
        p.wait(60)
        return p.returncode == 0, time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(60)
        p.stdout.close()


def test_sigkill_during_consolidate_never_leaves_a_mixed_export(tmp_path: Path) -> None:
    old, new = _state(1), _state(2)
    pyckpt.save(old, tmp_path / "old")
    pyckpt.save(new, tmp_path / "new")
    _, duration = _run(tmp_path / "new", tmp_path / "calibrate", None)
    assert _same(_export_of(tmp_path / "calibrate") or {}, new)
    durations = [duration]  # and every unkilled export below: kills scale with the median
    rng = random.Random(20261123)
    # Kill points as fractions of an export's duration, stratified over [0, 1.5): about a third
    # land after its end whatever the draw, so both outcomes are covered by construction.
    fractions = [(i + rng.random()) * 1.5 / POINTS for i in range(POINTS)]
    rng.shuffle(fractions)
    outcomes = {"old": 0, "new": 0, "none": 0}

    def kill_at(point: int, fraction: float) -> None:
        dst = tmp_path / f"out{point}"
        reexport = point % 2 == 0
        if reexport:
            # A complete earlier export in the same directory, in 8 files where the new one
            # writes 4: its other 8 names are removed during the commit.
            durations.append(_run(tmp_path / "old", dst, None, 2 << 20)[1])
        done, _ = _run(tmp_path / "new", dst, fraction * statistics.median(durations))
        got = _export_of(dst)
        if got is None:
            assert not done, f"point {point}: a finished export has no index"
            outcomes["none"] += 1
        elif _same(got, new):
            outcomes["new"] += 1
            shards = sorted(n for n in os.listdir(dst) if n.endswith(".safetensors"))
            assert shards == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)], (
                f"point {point}: files of the earlier export left next to the new one: {shards}"
            )
        else:
            assert reexport and not done and _same(got, old), (
                f"point {point}: the index names a mix of the previous and the new export"
            )
            outcomes["old"] += 1

    for point in range(POINTS):
        kill_at(point, fractions[point])
    # The strata cover both outcomes when the exports take about as long as the median says.
    # On a machine whose load changes under the test they may not (a slow calibration, then
    # fast exports: every kill lands after the end); then more kills at the uncovered end,
    # checked the same way, until it is covered.
    extra = POINTS
    for _ in range(6):
        if outcomes["none"] + outcomes["old"] == 0:
            kill_at(extra, 0.02)
        elif outcomes["new"] == 0:
            kill_at(extra, 4.0)
        else:
            break
        extra += 1
    assert outcomes["new"] > 0 and outcomes["none"] + outcomes["old"] > 0, outcomes
