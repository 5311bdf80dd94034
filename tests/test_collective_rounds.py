"""pyckpt._collective's object collectives and agree(): one collective when the pickle fits the
inline buffer, a second one for the rest, and agree's failure rules either way (the rounds of
an export, a manager save, a replica check)."""

from __future__ import annotations

from typing import Any

import pytest
from dist_utils import run_distributed

from pyckpt import _collective as coll
from pyckpt._collective import group_info, transport

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def rounds_worker(rank: int, world: int) -> dict[str, Any]:
    group = group_info(None)
    out: dict[str, Any] = {}
    big = bytes(range(256)) * (transport.BROADCAST_INLINE // 128)  # past both kinds' inline bytes
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
            raise KeyError("x" * (2 * transport.GATHER_INLINE))
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
    big = bytes(range(256)) * (transport.BROADCAST_INLINE // 128)
    for rank, r in enumerate(results):
        assert r["small_all"] == [0, 10]
        assert r["large_all"] == [big[:1], big[:3001]]
        assert r["small_root"] == {"plan": 0}
        assert r["large_root"] == (big, 0)
        assert r["from_1"] == ("s", 1) and r["large_from_1"] == (big, 1)
        assert r["raised"][:2] == ("KeyError", 2 * transport.GATHER_INLINE + 2), r["raised"]
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
    assert transport.gather_inline(2) == transport.gather_inline(512) == transport.GATHER_INLINE == 512
    assert transport.gather_inline(1024) == 256
    assert transport.gather_inline(4096) == transport.gather_inline(100_000) == transport.GATHER_INLINE_MIN
    for world in (2, 64, 513, 4096, 8192):
        assert world * transport.gather_inline(world) <= max(transport.GATHER_INLINE_TOTAL,
                                                        world * transport.GATHER_INLINE_MIN)


def small_inline_worker(rank: int, world: int) -> list[Any]:
    # Inline bytes as small as a 4096-rank group gets: short and long outcomes mixed.
    group = group_info(None)
    return coll.all_gather("r" * (rank * 100), group, inline=transport.GATHER_INLINE_MIN)


def test_all_gather_with_the_smallest_inline_bytes() -> None:
    for r in run_distributed(small_inline_worker, 3):
        assert r == ["", "r" * 100, "r" * 200]


def commit_worker(rank: int, world: int, root_rank: int) -> dict[str, Any]:
    """An export's agreement on 3 ranks: every rank's step agreed with ``agree``, then
    ``root_rank``'s commit with ``agree(ranks="root")``. Successes, failures of a rank's step
    (short and past the inline bytes, one rank and two), failures of the root's step
    (likewise), each followed by a round that shows the group still in step."""
    group = group_info(None)

    def agree_then_commit(fn: Any, root_fn: Any, *, on_failure: Any = None) -> Any:
        value, _ = coll.agree(fn, group, on_failure=on_failure, what="step")
        done, _ = coll.agree(root_fn, group, ranks="root", on_failure=on_failure,
                             what="commit", root=root_rank)
        return value, done

    out: dict[str, Any] = {"cleaned": [], "root_ran": []}
    long = "y" * (3 * transport.GATHER_INLINE)

    def root(tag: str, fail: BaseException | None = None) -> Any:
        def run() -> Any:
            out["root_ran"].append(tag)
            if fail is not None:
                raise fail
            return {"committed": tag}
        return run

    def cleanup(tag: str) -> Any:
        return lambda: out["cleaned"].append(tag)

    out["ok"] = agree_then_commit(lambda: rank * 10, root("ok"))
    cases: list[tuple[str, Any, Any]] = [
        ("one rank", {2}, None),
        ("one rank, long", {2}, long),
        ("two ranks", {1, 2}, None),
        ("root", set(), ZeroDivisionError("commit broke")),
        ("root, long", set(), ZeroDivisionError(long)),
    ]
    for tag, failing, root_error in cases:
        def step(tag: str = tag, failing: set[int] = failing) -> int:
            if rank in failing:
                raise KeyError(f"{tag} on rank {rank} " + (long if "long" in tag else ""))
            return rank
        try:
            agree_then_commit(step, root(tag, root_error), on_failure=cleanup(tag))
            out[tag] = "no error"
        except (KeyError, ZeroDivisionError) as e:
            out[tag] = (type(e).__name__, str(e)[:40], len(str(e)),
                        list(getattr(e, "__notes__", [])))
        _, out[f"after {tag}"] = coll.agree(lambda: rank, group)
    return out


@pytest.mark.parametrize("root", [0, 2])
def test_a_step_then_a_root_commit_has_the_same_outcomes_on_every_rank(root: int) -> None:
    results = run_distributed(commit_worker, 3, root)
    tags = ["one rank", "one rank, long", "two ranks", "root", "root, long"]
    long = 3 * transport.GATHER_INLINE
    for rank, r in enumerate(results):
        value, root_value = r["ok"]
        assert value == rank * 10
        assert root_value == {"committed": "ok"}  # the root's result, on every rank
        # The commit ran on the root only, and only when every rank's step succeeded.
        assert r["root_ran"] == (["ok", "root", "root, long"] if rank == root else [])
        assert r["cleaned"] == tags  # every failure cleaned up on every rank
        for tag in tags:
            assert r[f"after {tag}"] == [0, 1, 2]
        # A failing rank raises its own error as it was; the others the lowest failing rank's,
        # with a note naming it and the step.
        for tag in ("one rank", "one rank, long"):
            kind, text, size, notes = r[tag]
            assert kind == "KeyError" and text.startswith(f"'{tag} on rank 2"), r[tag]
            assert size > long if "long" in tag else size < 100
            assert notes == ([] if rank == 2 else ["pyckpt: step failed on rank 2"])
        kind, text, _, notes = r["two ranks"]
        assert text.startswith(f"'two ranks on rank {1 if rank != 2 else 2}"), r["two ranks"]
        assert notes == ([] if rank in (1, 2) else ["pyckpt: step failed on rank 1"])
        for tag in ("root", "root, long"):
            kind, text, size, notes = r[tag]
            assert kind == "ZeroDivisionError", r[tag]
            assert size == (long if "long" in tag else len("commit broke"))
            assert notes == ([] if rank == root else [f"pyckpt: commit failed on rank {root}"])


def test_a_root_outside_the_group_is_refused() -> None:
    ran: list[str] = []
    for root in (1, -1):
        with pytest.raises(ValueError, match=r"root must be a rank of the group \(0\.\.0\)"):
            coll.agree(lambda: ran.append("fn"), group_info(None), ranks="root", root=root)
    assert ran == []  # refused before any step ran
