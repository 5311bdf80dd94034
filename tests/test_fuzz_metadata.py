"""Structure-aware fuzzing of pyckpt.json: seeded, time-bounded, run in a sandboxed worker.

``tests/attacks/fuzz_metadata.py`` mutates the metadata of a real checkpoint (set / delete /
duplicate / retype keys, boundary values), re-computes the metadata checksum, and checks that
``read_index`` and ``pyckpt.load`` end in a typed error or a bit-identical load: no crash, no hang
(watchdog per iteration), no untyped exception, never a silently different result.

Knobs (environment): ``PYCKPT_FUZZ_SECONDS`` (default 60), ``PYCKPT_FUZZ_SEED`` (default 0).
A finding prints the seed and the mutations, so it reproduces with::

    python tests/attacks/fuzz_metadata.py WORKDIR SECONDS SEED
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the slow lane: a minute of fuzzing (test_fuzz_harnesses.py runs the corpus)

_WORKER = Path(__file__).parent / "attacks" / "fuzz_metadata.py"


def test_metadata_fuzz(tmp_path: Path) -> None:
    seconds = float(os.environ.get("PYCKPT_FUZZ_SECONDS", "60"))
    seed = int(os.environ.get("PYCKPT_FUZZ_SEED", "0"))
    proc = subprocess.run(
        [sys.executable, str(_WORKER), str(tmp_path), str(seconds), str(seed)],
        capture_output=True, text=True, timeout=seconds + 180,
    )
    lines = proc.stdout.splitlines()
    findings = [ln[8:] for ln in lines if ln.startswith("FINDING ")]
    done = [ln for ln in lines if ln.startswith("DONE ")]
    last = next((ln for ln in reversed(lines) if ln.startswith("ITER ")), "no iteration")
    assert proc.returncode != 70, f"an iteration hung (watchdog); last: {last}\n{proc.stderr[-3000:]}"
    assert proc.returncode >= 0, f"worker killed by signal {-proc.returncode}; last: {last}"
    assert done, f"worker exited {proc.returncode} without finishing; last: {last}\n" \
        f"{proc.stderr[-3000:]}"
    assert int(done[0].split()[1]) > 0, "the fuzzer ran no iteration"
    assert not findings, f"{len(findings)} finding(s) (seed {seed}); first ones:\n" + "\n".join(
        findings[:15])
    assert proc.returncode == 0, proc.stderr[-3000:]
