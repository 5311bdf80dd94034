"""The collective byte counter (benchmarks/_collective_bytes.py) on real gloo ranks, and a smoke
run of bench_coord_bytes.py at a tiny size."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from bench_coord_bytes import METHODS, SAVES, main  # noqa: E402
from dist_utils import run_distributed  # noqa: E402

pytestmark = pytest.mark.distributed


def _counted(rank: int, world: int) -> dict[str, Any]:
    """Known collectives on 3 ranks, each counted by itself."""
    import torch
    import torch.distributed as dist
    from _collective_bytes import count_collective_bytes

    from pyckpt import _collective

    out: dict[str, Any] = {}

    def count(name: str, fn: Any) -> None:
        with count_collective_bytes() as c:
            fn()
        out[name] = c.as_dict()

    x = torch.zeros(10, dtype=torch.float32)  # 40 bytes
    count("all_gather", lambda: dist.all_gather([torch.empty_like(x) for _ in range(world)], x))
    count("broadcast", lambda: dist.broadcast(x, src=1))
    count("gather", lambda: dist.gather(
        x, [torch.empty_like(x) for _ in range(world)] if rank == 0 else None, dst=0))
    count("scatter", lambda: dist.scatter(
        x, [torch.ones(10) for _ in range(world)] if rank == 2 else None, src=2))
    count("all_reduce", lambda: dist.all_reduce(x))
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    count("into_tensor", lambda: gather_single(torch.empty(10 * world), x))
    # rank r sends r + 1 int64 rows of 2 to each other rank
    send = torch.zeros(((rank + 1) * world, 2), dtype=torch.int64)
    recv_rows = [r + 1 for r in range(world)]
    count("all_to_all", lambda: dist.all_to_all_single(
        torch.empty((sum(recv_rows), 2), dtype=torch.int64), send,
        output_split_sizes=recv_rows, input_split_sizes=[rank + 1] * world))

    def p2p() -> None:
        if rank == 0:
            dist.send(torch.zeros(3, dtype=torch.float64), dst=1)
        elif rank == 1:
            dist.recv(torch.empty(3, dtype=torch.float64), src=0)

    count("p2p", p2p)
    count("object", lambda: dist.all_gather_object([None] * world, "x" * (100 * (rank + 1))))
    group = _collective.group_info(None)
    count("pyckpt", lambda: _collective.all_gather(rank, group))
    out["restored"] = (dist.all_gather.__name__ == "all_gather"
                       and dist.group.WORLD.allgather.__name__ == "allgather")
    return out


def test_counts_per_collective() -> None:
    res = run_distributed(_counted, 3)
    W, n = 3, 40
    for rank, r in enumerate(res):
        assert r["all_gather"]["sent"] == {"allgather": n * (W - 1)}
        assert r["all_gather"]["received"] == {"allgather": n * (W - 1)}
        assert r["all_gather"]["by_api"] == {"all_gather": 2 * n * (W - 1)}
        assert r["broadcast"]["sent_total"] == (n * (W - 1) if rank == 1 else 0)
        assert r["broadcast"]["received_total"] == (0 if rank == 1 else n)
        assert r["gather"]["sent_total"] == (0 if rank == 0 else n)
        assert r["gather"]["received_total"] == (n * (W - 1) if rank == 0 else 0)
        assert r["scatter"]["sent_total"] == (n * (W - 1) if rank == 2 else 0)
        assert r["scatter"]["received_total"] == (0 if rank == 2 else n)
        assert r["all_reduce"]["sent"] == {"allreduce": n * (W - 1)}
        assert r["into_tensor"]["sent_total"] == r["into_tensor"]["received_total"] == n * (W - 1)
        rows = rank + 1
        assert r["all_to_all"]["sent_total"] == rows * 16 * (W - 1)
        assert r["all_to_all"]["received_total"] == sum((q + 1) * 16 for q in range(W) if q != rank)
        assert r["p2p"]["sent_total"] == (24 if rank == 0 else 0)
        assert r["p2p"]["received_total"] == (24 if rank == 1 else 0)
        # all_gather_object: sizes, then the pickles padded to the longest, each via allgather
        obj = r["object"]
        assert set(obj["by_api"]) == {"all_gather_object"} and obj["calls"] == {"allgather": 2}
        assert obj["received_total"] > 100 * (W - 1)
        # pyckpt's own exchange calls the ProcessGroup directly
        assert set(r["pyckpt"]["by_api"]) == {"ProcessGroup.allgather"}
        assert r["pyckpt"]["sent_total"] > 0
        assert all(not v["uncounted"] for k, v in r.items() if isinstance(v, dict))
        assert r["restored"]


def test_bench_coord_bytes_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "coord.json"
    assert main(["--ranks", "4", "--layers", "3", "--reshard", "2", "--dir", str(tmp_path),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bit_exact"] and report["reshard"] == 2
    rows = report["rows"]
    assert set(rows) == {f"{m}-{k}" for m in METHODS for k in range(1, SAVES + 1)} | {
        "pyckpt-load-1", "pyckpt-load-2", "dcp-load"}
    for row in rows.values():
        # The coordinator gathers every rank's plan, probe or results: it receives something.
        assert row["rank0_received"] > 0 and row["sent_max"] >= row["sent_median"] > 0
    # a second load of the same layout exchanges no plan: less than the first
    assert rows["pyckpt-load-2"]["rank0_received"] < rows["pyckpt-load-1"]["rank0_received"]
    assert "reshard 4 -> 2 -> 4: bit-exact" in capsys.readouterr().out
