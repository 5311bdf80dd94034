"""Smoke run of bench_recovery.py (restore after losing a node vs from durable; save blocking
time against async_save) and bench_train_overlap.py (training steps with a save in flight), at
tiny sizes: both scripts run end to end and report what their tables claim."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import bench_recovery  # noqa: E402
import bench_train_overlap  # noqa: E402
from _s3server import find_weed  # noqa: E402

MIB = 1 << 20


def test_recovery_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Both durable tiers in one run; a local directory only without the SeaweedFS binary.
    durable = "dir,s3" if find_weed() is not None else "dir"
    out = tmp_path / "r.json"
    assert bench_recovery.main(["--size-mib", "1", "--repeats", "1", "--durable", durable,
                                "--work", str(tmp_path), "--json", str(out),
                                "--timeout", "300"]) == 0
    report = json.loads(out.read_text())
    assert report["ranks"] == 4 and report["size_mib_per_rank"] == 1
    assert list(report["durable"]) == durable.split(",")
    for row in report["durable"].values():
        assert row["bit_exact"] is True
        # The restore after losing node 1 read nothing from the durable tier (the script stops
        # otherwise); node 1's ranks got their bytes from node 0.
        assert row["restore_after_losing_node1_bytes_from_durable"] == [0]
        assert row["restore_after_losing_node1_bytes_from_peers"]["median"] > 0
        stored = row["restore_from_durable_bytes"]["median"]
        # bf16 weights compress to about 2/3 of the 4 MiB of state.
        assert 0.5 * 4 * MIB < stored < 4 * MIB
        # Every file has one replica on the other node: as many bytes on the wire as stored.
        assert row["replica_bytes_on_wire"]["median"] == stored
        for key in ("async_save_blocking_s", "save_blocking_s", "replication_s",
                    "restore_after_losing_node1_s", "restore_from_durable_s"):
            assert row[key]["min"] <= row[key]["median"] <= row[key]["max"]
            assert row[key]["min"] > 0 and len(row[key]["samples"]) == 1
    assert os.listdir(tmp_path) == ["r.json"]  # the work directory was removed
    text = capsys.readouterr().out
    assert "| CheckpointManager.save blocking, s |" in text
    assert "|   bytes from durable (must be 0) | 0 |" in text


def test_train_overlap_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    assert bench_train_overlap.main([
        "--dim", "64", "--layers", "2", "--batch", "2", "--seq", "16", "--steps", "4",
        "--warmup", "1", "--repeats", "1", "--writer-threads", "1,2",
        "--work", str(tmp_path), "--json", str(out), "--timeout", "300"]) == 0
    report = json.loads(out.read_text())
    assert list(report["modes"]) == ["none", "async_save/t1", "async_save/t2", "manager/t1",
                                     "manager/t2"]
    none = report["modes"]["none"]
    assert none["step_s"]["n"] == 4 and none["saves"] == 0 and none["blocking_s"] is None
    assert none["slowdown"] == 0.0
    for name, row in report["modes"].items():
        s = row["step_s"]
        assert 0 < s["min"] <= s["median"] <= s["p90"] <= s["max"]
        if name != "none":
            assert row["saves"] >= 1 and 1 <= s["n"] <= 4
            assert row["blocking_s"]["min"] > 0
    assert report["state_bytes_per_rank"] > 0
    assert os.listdir(tmp_path) == ["t.json"]
    assert "| manager/t2 |" in capsys.readouterr().out
