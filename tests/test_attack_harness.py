"""The attack harness's deadlines measure a hang, not how busy the machine is.

A worker (or a task) that works slowly, as on a machine shared with many jobs, uses CPU time in
short bursts: it is never declared stuck, however long it takes in wall-clock time. A worker that
stops using CPU (blocked, sleeping) is, after the idle bound. Bounds here are seconds, far below
the defaults, so that the slow cases run longer than the bound they would have failed before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from attacks import harness
from attacks.generate import generate


@pytest.mark.slow
def test_slow_start_up_is_not_a_failure_but_a_stuck_one_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    generate(str(tmp_path), names=["unknown_version"])
    tasks = [("unknown_version", "selftest_ok")]
    # Start-up crawls for 12 s (three times the 4 s bound) before importing torch.
    monkeypatch.setenv("PYCKPT_ATTACK_SELFTEST_START", "slow:12")
    res = harness.run_tasks(str(tmp_path), tasks, timeout=5, jobs=1, startup_idle=4)
    assert res[tasks[0]]["outcome"] == "ok", res
    # A start-up that uses no CPU at all is stuck: reported, after the bound, with the reason.
    monkeypatch.setenv("PYCKPT_ATTACK_SELFTEST_START", "stuck")
    with pytest.raises(RuntimeError, match="did not start: no progress: no CPU time used for 4 s"):
        harness.run_tasks(str(tmp_path), tasks, timeout=5, jobs=1, startup_idle=4)


@pytest.mark.slow
def test_slow_task_is_not_a_hang_but_a_blocked_one_is(tmp_path: Path) -> None:
    generate(str(tmp_path), names=["unknown_version"])
    ops = ["selftest_slow", "selftest_hang", "selftest_ok"]
    # selftest_slow works for 12 s of wall-clock time in bursts, under a 5 s bound.
    res = harness.run_tasks(str(tmp_path), [("unknown_version", op) for op in ops], timeout=5,
                            jobs=1)
    got = {op: res[("unknown_version", op)] for op in ops}
    assert got["selftest_slow"]["outcome"] == "ok" and got["selftest_slow"]["seconds"] >= 12
    assert got["selftest_hang"]["outcome"] == "hang"
    assert got["selftest_hang"]["detail"] == "no progress: no CPU time used for 5 s"
    # In a fresh worker after the hang; on failure, show the detail (the worker's stderr).
    assert got["selftest_ok"]["outcome"] == "ok", got["selftest_ok"]


def test_a_restarted_worker_that_fails_to_start_is_not_a_crash_of_the_next_task(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    generate(str(tmp_path), names=["unknown_version"])
    # The first worker starts; selftest_outside creates this file; selftest_crash kills that
    # worker; its replacement finds the file and aborts during start-up, before any task.
    made = tmp_path / "cases" / "unknown_version" / "outside" / "selftest-read"
    monkeypatch.setenv("PYCKPT_ATTACK_SELFTEST_START", f"abort-if:{made}")
    ops = ["selftest_outside", "selftest_crash", "selftest_ok"]
    with pytest.raises(RuntimeError,
                       match=r"attack worker failed to start \(killed by SIGABRT\)"):
        harness.run_tasks(str(tmp_path), [("unknown_version", op) for op in ops], jobs=1)
