"""Smoke run of bench_scale.py (planning and metadata vs world size) at a tiny size."""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scale import PHASES, local_plans, main, model


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The benchmark collects garbage before every timed phase; inside pytest each collection
    also walks the test session's own objects (5-8x the script's time in CI's dev mode). Freezing
    them leaves the collections with what the benchmark allocates."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_scale_report(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                      frozen_heap: None) -> None:
    out, table = tmp_path / "s.json", tmp_path / "s.md"
    argv = ["--ranks", "2", "8", "--tensors", "6", "--repeats", "2", "--model-gib", "0.01",
            "--max-items", "100", "--dir", str(tmp_path), "--json", str(out),
            "--markdown", str(table)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    cells = {(r["workload"], r["ranks"]) for r in report["rows"]}
    assert cells == {(w, n) for w in ("sharded", "replicated", "mixed") for n in (2, 8)}
    assert report["skipped"] == []
    for row in report["rows"]:
        for system in ("pyckpt", "dcp"):
            assert all(len(row["samples"][system][p]) == 2 for p in PHASES)
            assert row["sizes"][system]["bytes"] > 0
        # The last rank's load plan reads its shard of every sharded tensor (one stored piece
        # each at the same world size), every replicated tensor and the non-tensor item.
        assert row["read_items"] >= 6 + 1
    sharded = {r["ranks"]: r for r in report["rows"] if r["workload"] == "sharded"}
    # One stored piece per rank and tensor: the metadata grows with N for both systems.
    for system in ("pyckpt", "dcp"):
        assert sharded[8]["sizes"][system]["bytes"] > sharded[2]["sizes"][system]["bytes"]
    lines = table.read_text().splitlines()
    assert len(lines) == 2 + 6 and lines[2].startswith("| sharded | 2 | 6 | ")
    assert "steady" in capsys.readouterr().out
    # Cells over --max-items are skipped and reported as such.
    assert main(["--ranks", "2", "8", "--tensors", "6", "--repeats", "1", "--model-gib", "0.01",
                 "--workloads", "sharded", "--max-items", "20", "--dir", str(tmp_path),
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["skipped"] == [
        {"workload": "sharded", "ranks": 8, "tensors": 6}]


def test_plot(tmp_path: Path, frozen_heap: None) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "s.png"
    assert main(["--ranks", "2", "4", "--tensors", "4", "--repeats", "1", "--model-gib", "0.01",
                 "--workloads", "mixed", "--dir", str(tmp_path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synthetic_plans_shapes() -> None:
    spec = model("mixed", 4, 8, 1 << 24)
    assert [t.sharded for t in spec] == [True, True, True, False] * 2
    assert all(t.rows % 4 == 0 for t in spec if t.sharded)
    plans = local_plans(spec, 4)
    # Each rank: its shard of the 6 sharded tensors, the 2 replicated ones and "extra".
    assert [len(p.items) for p in plans] == [9, 9, 9, 9]
    offsets = {tuple(p.items[0].index.offset) for p in plans}
    assert len(offsets) == 4  # distinct shards
