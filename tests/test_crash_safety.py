"""Crash safety: a process saving a checkpoint is SIGKILLed at seeded random points.

Whatever the point (encoding, writing, fsync, the data file's rename, the metadata's temp file,
its rename), afterwards a directory that held a checkpoint loads bit-exact as that previous
checkpoint or as the new one, and a fresh directory loads bit-exact as the new one or raises a
typed error (FileNotFoundError or CheckpointFormatError). A later save into the same directory
succeeds. Sync and async (dcp.async_save) saves alike.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _crash_worker import make_state_dict
from _crash_worker import save as child_save

import pyckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SMALL, LARGE = 24 << 20, 100 << 20
POINTS = 56


def _ctx() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "pyckpt.storage",
                                "_crash_worker"])
    return ctx


_cache: dict[tuple[int, int], dict[str, Any]] = {}


def _expected(seed: int, nbytes: int) -> dict[str, Any]:
    key = (seed, nbytes)
    if key not in _cache:
        _cache.clear()  # keep memory bounded: only the latest few are needed
        _cache[key] = make_state_dict(seed, nbytes)
    return _cache[key]


def _load(path: Path, seed_size: tuple[int, int]) -> dict[str, Any]:
    like = make_state_dict(0, 0) if seed_size[1] == 0 else _expected(*seed_size)
    out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in
           like.items()}
    pyckpt.load(out, path)  # raises the typed error itself, not DCP's wrapper
    return out


def _equal(out: dict[str, Any], seed: int, nbytes: int) -> bool:
    ref = _expected(seed, nbytes)
    if out["step"] != ref["step"]:
        return False
    return all(torch.equal(out[k].view(torch.uint8), ref[k].view(torch.uint8))
               for k in ref if isinstance(ref[k], torch.Tensor))


def _run_child(ctx: Any, path: Path, seed: int, nbytes: int, mode: str, pause: str,
               kill_after: float | None) -> tuple[bool, float]:
    """Runs one save; kills it ``kill_after`` s after it started saving (or once paused).
    Returns (whether it reported done before the kill, seconds from start to done/kill)."""
    q = ctx.Queue()
    p = ctx.Process(target=child_save, args=(str(path), seed, nbytes, mode, pause, q))
    p.start()
    try:
        assert q.get(timeout=120) == "start"
        t0 = time.monotonic()
        if pause:
            msg = q.get(timeout=120)
            assert msg == "paused", msg
            done = False
        else:
            try:
                msg = q.get(timeout=kill_after if kill_after is not None else 300)
                assert msg == "done", msg
                done = True
            except queue.Empty:
                done = False
        elapsed = time.monotonic() - t0
    finally:
        p.kill()
        p.join(30)
    assert not p.is_alive()
    return done, elapsed


def _check_dir(path: Path, previous: tuple[int, int] | None, new: tuple[int, int],
               done: bool) -> tuple[int, int] | None:
    """Verifies ``path`` after a killed save; returns what it now holds."""
    try:
        out = _load(path, new)
    except (FileNotFoundError, pyckpt.CheckpointFormatError) as e:
        assert previous is None, f"the previous checkpoint in {path} does not load: {e!r}"
        assert not done, f"a save that reported success does not load: {e!r}"
        return None
    if _equal(out, *new):
        return new
    assert not done, "a save that reported success loads other data"
    assert previous is not None and previous[1] == new[1] and _equal(out, *previous), (
        f"{path} loads neither the previous nor the new checkpoint bit-exact"
    )
    return previous


@pytest.mark.slow
def test_sigkill_at_random_points_never_loses_or_mixes(tmp_path: Path) -> None:
    ctx = _ctx()
    rng = np.random.default_rng(20261123)
    # Calibrate: how long a whole save takes here, per size and mode.
    # Every save that completes adds its duration, and kill points scale with the median, so a
    # machine that is slower (or faster) during the loop than at calibration still spreads the
    # kills over the whole save.
    calib: dict[tuple[int, str], list[float]] = {}
    for nbytes in (SMALL, LARGE):
        for mode in ("sync", "async"):
            done, elapsed = _run_child(ctx, tmp_path / f"calib-{nbytes}-{mode}", 1, nbytes, mode,
                                       "", None)
            assert done
            calib[(nbytes, mode)] = [elapsed]
    # Kill points as fractions of a save's duration, stratified over [0, 1.5) so that about a
    # third fall after the save's end whatever the draw: a pure uniform draw left the count of
    # completed saves to chance.
    fractions = (np.arange(POINTS) + rng.uniform(size=POINTS)) * (1.5 / POINTS)
    rng.shuffle(fractions)
    # A checkpoint that no kill may touch.
    untouched = tmp_path / "untouched"
    _run_child(ctx, untouched, 7, SMALL, "sync", "", None)

    same: dict[int, tuple[int, int] | None] = {SMALL: None, LARGE: None}
    outcomes = {"killed_before": 0, "completed": 0, "previous_kept": 0, "paused": 0}
    for point in range(POINTS):
        nbytes = LARGE if point % 8 == 7 else SMALL
        mode = "async" if point % 2 else "sync"
        fresh = point % 3 == 0
        pause = ("finish", "metadata")[point % 2] if point % 5 == 4 else ""
        seed = 100 + point
        path = tmp_path / (f"fresh-{point}" if fresh else f"same-{nbytes}")
        previous = None if fresh else same[nbytes]
        kill_after = None if pause else float(fractions[point] *
                                               np.median(calib[(nbytes, mode)]))
        done, elapsed = _run_child(ctx, path, seed, nbytes, mode, pause, kill_after)
        if done:
            calib[(nbytes, mode)].append(elapsed)
        now = _check_dir(path, previous, (seed, nbytes), done)
        outcomes["paused"] += bool(pause)
        outcomes["completed"] += now == (seed, nbytes)
        outcomes["previous_kept"] += now is not None and now == previous
        outcomes["killed_before"] += now is None
        if not fresh:
            same[nbytes] = now
    # The spread of kill points really covered both outcomes.
    assert outcomes["completed"] >= 5 and outcomes["previous_kept"] + outcomes[
        "killed_before"] >= 10, outcomes
    assert _equal(_load(untouched, (7, SMALL)), 7, SMALL)
    # A killed save never blocks the next one (its lock died with it) and the directory is
    # cleaned up: only the new checkpoint's data file is left.
    for nbytes, label in ((SMALL, "same-" + str(SMALL)), (LARGE, "same-" + str(LARGE))):
        done, _ = _run_child(ctx, tmp_path / label, 999, nbytes, "sync", "", None)
        assert done and _equal(_load(tmp_path / label, (999, nbytes)), 999, nbytes)
        names = [p.name for p in (tmp_path / label).iterdir()]
        assert sorted(n for n in names if n.endswith(".pyckpt") or ".tmp-" in n) == [
            n for n in names if n.endswith(".pyckpt")
        ] and len([n for n in names if n.endswith(".pyckpt")]) == 1, names


def test_killed_save_leftovers_are_reported_then_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A save SIGKILLed with pyckpt.json's temp file written (before its rename) leaves that
    # temp file (`pyckpt.json.tmp-<pid>-<n>`) and its own data file beside the checkpoint
    # it did not replace. `pyckpt verify` used to say only "OK"; it names each leftover, and
    # the next save into the directory removes them.
    from pyckpt import tools
    from pyckpt.cli import main

    path = tmp_path / "ckpt"
    pyckpt.save(make_state_dict(1, 1 << 16), path)
    before = set(os.listdir(path))
    done, _ = _run_child(_ctx(), path, 2, 1 << 16, "sync", "metadata", None)
    assert not done
    left = set(os.listdir(path)) - before
    assert any(".tmp-" in n and n.startswith("pyckpt.json") for n in left), left
    assert main(["verify", str(path)]) == 0  # the previous checkpoint is intact
    out = capsys.readouterr().out
    for name in left:
        assert f"LEFTOVER {name}: " in out, out
    assert "killed mid-write" in out and "leftover file(s)" in out.splitlines()[-1]
    pyckpt.save(make_state_dict(3, 1 << 16), path)
    assert tools.leftovers(path, tools.open_backend(path).read_index()) == {}
    assert not any(".tmp-" in n for n in os.listdir(path))


def test_refused_save_leaves_no_directory(tmp_path: Path) -> None:
    # A save refused after its set-up (a tensor it cannot store) used to leave a directory
    # holding only `.pyckpt.lock`; `verify` of such a directory names what is in it.
    from pyckpt.cli import main

    path = tmp_path / "new"
    with pytest.raises(pyckpt.UnsupportedDtypeError):
        pyckpt.save({"w": torch.zeros(2, 2).to_sparse()}, path)
    assert not path.exists()
    # An existing directory is the caller's: it stays, with nothing of the save's left.
    path.mkdir()
    with pytest.raises(pyckpt.UnsupportedDtypeError):
        pyckpt.save({"w": torch.zeros(2, 2).to_sparse()}, path)
    assert os.listdir(path) == [".pyckpt.lock"]
    assert main(["verify", str(path)]) == 1
    # What an older version left: the message names it and what removes it.
    from pyckpt import tools

    assert tools.leftovers(path) == {".pyckpt.lock": "lock file of a save that committed nothing"}


def _coordinator_fails_first(rank: int, world: int, root: str) -> list[str]:
    """Rank 0's writes fail at once (a stand-in for a tensor it cannot store, a full disk); rank
    1 opens its data file up to 2 s later, in the directory rank 0's save made."""
    import pyckpt
    from pyckpt.storage import Writer

    real = Writer._write_data

    def failing(self: Any, *args: Any) -> Any:
        if rank == 0:
            raise ValueError("rank 0 cannot store this")
        deadline = time.monotonic() + 2.0  # rank 0 has failed by then (or took the directory)
        while os.path.isdir(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return real(self, *args)

    path = os.path.join(root, "new_dir")
    sd = {"w": torch.arange(100_000, dtype=torch.float32)}  # replicated: both ranks write
    Writer._write_data = failing  # type: ignore[method-assign]
    try:
        pyckpt.save(sd, path)
    except Exception as e:
        seen = [type(e).__name__, str(e)]
    finally:
        Writer._write_data = real  # type: ignore[method-assign]
    pyckpt.save(sd, path)  # the retry into the same directory commits
    out = {"w": torch.zeros(100_000)}
    pyckpt.load(out, path)
    return [*seen, "same" if torch.equal(out["w"], sd["w"]) else "differs"]


def test_a_failing_coordinator_leaves_the_directory_to_the_other_ranks_writes(
        tmp_path: Path) -> None:
    # The coordinator used to remove the directory its save made as soon as its own writes
    # failed: a rank still opening its file there failed with FileNotFoundError instead of
    # reporting the coordinator's error.
    from dist_utils import run_distributed

    results = run_distributed(_coordinator_fails_first, 2, str(tmp_path))
    for kind, message, loaded in results:
        assert kind == "ValueError" and "rank 0 cannot store this" in message, results
        assert loaded == "same"
