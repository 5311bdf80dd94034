"""Issue 24 item 8: two processes saving into one directory, overlapping in time, never both
report success; the directory then loads bit-exact as the save that did."""

from __future__ import annotations

import multiprocessing
import queue
from pathlib import Path

import pytest
import torch
from _backend_workers import save_overlapping, sd

import pyckpt


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "no-flock"])
def test_overlapping_saves_into_one_directory_never_both_succeed(tmp_path: Path,
                                                                 flock: bool) -> None:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "pyckpt.storage",
                                "_backend_workers"])
    for trial, previous in enumerate([False, True]):
        path = str(tmp_path / f"t{trial}")
        if previous:  # a checkpoint is there before both saves start
            pyckpt.save(sd(99), path)
        barrier, q = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=save_overlapping, args=(path, 10 * trial + i, barrier, q,
                                                            flock)) for i in range(2)]
        for p in procs:
            p.start()
        try:
            outcomes = [q.get(timeout=180) for _ in procs]
        except queue.Empty:
            for p in procs:
                p.kill()
            raise AssertionError(f"trial {trial}: a saver never reported") from None
        for p in procs:
            p.join(60)
        ok = [seed for seed, status, _ in outcomes if status == "ok"]
        assert len(ok) == 1, outcomes
        (loser,) = [o for o in outcomes if o[1] != "ok"]
        expected = "BlockingIOError" if flock else "ConcurrentSaveError"
        assert loser[1] == expected, outcomes
        assert path in loser[2] or "pyckpt.json" in loser[2], loser
        out = {"w": torch.zeros((4 << 20) // 4), "step": -1}
        pyckpt.load(out, path)
        assert out["step"] == ok[0]
        assert torch.equal(out["w"].view(torch.int32), sd(ok[0])["w"].view(torch.int32))
        names = {p.name for p in Path(path).iterdir() if p.name.endswith(".pyckpt")}
        assert len(names) == 1  # only the winner's data file


def test_a_temp_file_removed_by_another_save_fails_the_commit_as_a_concurrent_save(
        tmp_path: Path) -> None:
    # Without flock, the save that commits first removes the files its checkpoint does not name,
    # the other save's temp data file among them; that save's rename then finds nothing. It
    # must fail as a concurrent save (what happened), not with rename's bare ENOENT.
    from pyckpt.backends import open_backend

    path = tmp_path / "ckpt"
    path.mkdir()
    name = "0-0.0123456789ab.pyckpt"
    with open_backend(str(path)).data_sink(name, {}) as sink:
        sink.append(b"x" * 8192)
        (temp,) = [p for p in path.iterdir() if p.name.startswith(name + ".tmp")]
        temp.unlink()  # what the other save's clean-up does
        with pytest.raises(pyckpt.ConcurrentSaveError, match="another save") as info:
            sink.commit()
    assert isinstance(info.value.__cause__, FileNotFoundError)
    assert name in str(info.value)
    assert not list(path.iterdir())  # nothing of this save is left


@pytest.mark.parametrize("previous", [True, False], ids=["over-a-checkpoint", "empty"])
def test_without_flock_a_save_begun_after_anothers_commit_survives_its_clean_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, previous: bool) -> None:
    """Without flock, save B sets up after save A committed (B's condition is A's metadata)
    and completes before A's clean-up lists the directory. B's commit is legitimate; A's
    clean-up must not remove B's data file, which B's committed metadata names (before: it
    did, and B's checkpoint, the only one left, failed to load with FileNotFoundError)."""
    import errno
    import fcntl

    from pyckpt.backends import base

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    path = str(tmp_path / "ckpt")
    if previous:
        pyckpt.save(sd(99), path)
    real_clean_up = base.clean_up
    raced: list[bool] = []

    def b_before_a_cleans_up(*args: object, **kwargs: object) -> list[str]:
        if not raced:
            raced.append(True)
            pyckpt.save(sd(2), path)  # B: set up after A's commit, write, commit, clean up
        return real_clean_up(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(base, "clean_up", b_before_a_cleans_up)
    pyckpt.save(sd(1), path)  # A
    monkeypatch.setattr(base, "clean_up", real_clean_up)
    assert raced
    out = {"w": torch.zeros((4 << 20) // 4), "step": -1}
    pyckpt.load(out, path)
    assert out["step"] == 2
    assert torch.equal(out["w"].view(torch.int32), sd(2)["w"].view(torch.int32))
