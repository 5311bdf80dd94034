"""Smoke run of bench_replicated.py's replica-check report (one process, a few MiB).

The multi-rank runs spawn gloo ranks and take minutes; here the same code paths produce the
check table at world size 1, where the check is timed but does not run inside the save.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_replicated import main


def test_check_cost_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    argv = ["--check-cost", "--worlds", "1", "--size-gib", "0.01", "--repeats", "2"]
    assert main([*argv, "--dir", str(tmp_path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "replica check per rank" in text
    report = json.loads(out.read_text())
    rows = {row["mode"]: row for row in report["checks"]}
    assert list(rows) == ["off", "sample", "full"]
    assert all(len(row["save_s_samples"]) == 2 for row in rows.values())
    assert len(rows["sample"]["check_s_samples"]) == 2
    # The sample reads at most 1 MiB per tensor, the full check every byte.
    assert 0 < rows["sample"]["read_bytes_per_rank"] < rows["full"]["read_bytes_per_rank"]
    assert rows["full"]["read_bytes_per_rank"] == report["state_dict_bytes"]
    assert {s["planner"] for s in report["saves"]} == {"pyckpt", "pyckpt-full", "pyckpt-nocheck"}
