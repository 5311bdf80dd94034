"""Smoke run of integration_lightning.py at a tiny size: both paths (CheckpointIO in one
process, ModelParallelStrategy on 2 ranks) run end to end and report every writer."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import integration_lightning  # noqa: E402


@pytest.mark.parametrize("path", ["io", "model_parallel"])
def test_lightning_report(path: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert integration_lightning.main(["--path", path, "--hidden", "64", "--repeats", "1",
                                       "--work", str(tmp_path), "--json", str(out),
                                       "--timeout", "300"]) == 0
    report = json.loads(out.read_text())
    assert report["ranks"] == (2 if path == "model_parallel" else 1)
    for writer in integration_lightning.WRITERS:
        assert report["blocking_s"][writer]["median"] > 0
        assert report["bytes"][writer]["median"] > 64 * 64 * 4 * 2  # weights and moments
