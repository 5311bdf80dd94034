"""pyckpt._collective's object collectives and agree(): one collective when the pickle fits the
inline buffer, a second one for the rest, and agree's failure rules either way (the rounds of
an export, a manager save, a replica check)."""

from __future__ import annotations

from typing import Any

import pytest
from dist_utils import run_distributed

from pyckpt import _collective as coll
from pyckpt._collective import group_info

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def rounds_worker(rank: int, world: int) -> dict[str, Any]:
    group = group_info(None)
    out: dict[str, Any] = {}
    big = bytes(range(256)) * (coll.BROADCAST_INLINE // 128)  # past both kinds' inline bytes
    # Small and large outcomes, from every rank and from rank 0.
    _, out["small_all"] = coll.agree(lambda: rank * 10, group)
    _, out["large_all"] = coll.agree(lambda: big[: rank * 3000 + 1], group)
    out["small_root"], _ = coll.agree(lambda: {"plan": rank}, group, ranks="root")
    out["large_root"], _ = coll.agree(lambda: (big, rank), group, ranks="root")
    # A broadcast from another rank than 0, small and large.
    out["from_1"] = coll.broadcast(("s", rank), group, src=1)
    out["large_from_1"] = coll.broadcast((big, rank), group, src=1, what="large")
    # A failure on rank 1 with a message longer than the inline bytes: every rank cleans up and
    # raises its type; rank 0's copy names the failing rank.
    cleaned: list[int] = []

    def fail_on_one() -> int:
        if rank == 1:
            raise KeyError("x" * (2 * coll.GATHER_INLINE))
        return rank

    try:
        coll.agree(fail_on_one, group, on_failure=lambda: cleaned.append(rank), what="step")
    except KeyError as e:
        out["raised"] = ("KeyError", len(str(e)), list(getattr(e, "__notes__", [])))
    # A failure of the root's step reaches every rank.
    try:
        coll.agree(lambda: 1 // 0, group, ranks="root", on_failure=lambda: cleaned.append(rank),
                     what="planning")
    except ZeroDivisionError as e:
        out["root_raised"] = ("ZeroDivisionError", list(getattr(e, "__notes__", [])))
    out["cleaned"] = cleaned
    # The group is still in step afterwards.
    _, out["after"] = coll.agree(lambda: rank, group)
    return out


def test_rounds_move_small_and_large_outcomes_and_failures() -> None:
    results = run_distributed(rounds_worker, 2)
    big = bytes(range(256)) * (coll.BROADCAST_INLINE // 128)
    for rank, r in enumerate(results):
        assert r["small_all"] == [0, 10]
        assert r["large_all"] == [big[:1], big[:3001]]
        assert r["small_root"] == {"plan": 0}
        assert r["large_root"] == (big, 0)
        assert r["from_1"] == ("s", 1) and r["large_from_1"] == (big, 1)
        assert r["raised"][:2] == ("KeyError", 2 * coll.GATHER_INLINE + 2), r["raised"]
        assert r["root_raised"][0] == "ZeroDivisionError"
        assert r["cleaned"] == [rank, rank]
        assert r["after"] == [0, 1]
    assert "pyckpt: step failed on rank 1" in results[0]["raised"][2]
    assert results[1]["raised"][2] == []  # its own failure, raised as it was
    assert "pyckpt: planning failed on rank 0" in results[1]["root_raised"][1]


def test_rounds_in_one_process() -> None:
    group = group_info(None)
    assert coll.agree(lambda: 5, group) == (5, [5])
    assert coll.agree(lambda: 6, group, ranks="root") == (6, [6])
    cleaned = []
    with pytest.raises(KeyError):
        coll.agree(lambda: {}["k"], group, on_failure=lambda: cleaned.append(1))
    assert cleaned == [1]
    with pytest.raises(ValueError, match="ranks must be"):
        coll.agree(lambda: 1, group, ranks="some")


def test_gather_inline_bytes_shrink_in_large_groups() -> None:
    # A first collective moves world x inline bytes to every rank: bounded for thousands of ranks.
    assert coll.gather_inline(2) == coll.gather_inline(512) == coll.GATHER_INLINE == 512
    assert coll.gather_inline(1024) == 256
    assert coll.gather_inline(4096) == coll.gather_inline(100_000) == coll.GATHER_INLINE_MIN
    for world in (2, 64, 513, 4096, 8192):
        assert world * coll.gather_inline(world) <= max(coll.GATHER_INLINE_TOTAL,
                                                        world * coll.GATHER_INLINE_MIN)


def small_inline_worker(rank: int, world: int) -> list[Any]:
    # Inline bytes as small as a 4096-rank group gets: short and long outcomes mixed.
    group = group_info(None)
    return coll.all_gather("r" * (rank * 100), group, inline=coll.GATHER_INLINE_MIN)


def test_all_gather_with_the_smallest_inline_bytes() -> None:
    for r in run_distributed(small_inline_worker, 3):
        assert r == ["", "r" * 100, "r" * 200]
