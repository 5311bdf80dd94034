"""Save semantics of pyckpt.Writer: overlapping and concurrent saves, overwrite, lazy Reader,
use_collectives=False. Each test asserts that no data is lost or mixed."""

from __future__ import annotations

import multiprocessing
import os
import queue
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _concurrent_worker import _save_proc, _sd
from torch.distributed.checkpoint.api import CheckpointException

import pyckpt
from pyckpt import _format

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _load(path: str | Path, mib: int = 8) -> dict[str, Any]:
    out = {"w": torch.zeros((mib << 20) // 4), "b": torch.zeros(1000), "step": -1}
    dcp.load(out, storage_reader=pyckpt.Reader(path), no_dist=True)
    return out


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"]
    for k in ("w", "b"):
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k


def _data_files(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if _format.is_data_file(p.name)}


# ------------------------------------------------------------ overlapping async saves


@pytest.mark.parametrize("writers", ["one", "two"])
def test_overlapping_async_saves_keep_both_checkpoints(tmp_path: Path, writers: str) -> None:
    w1 = pyckpt.Writer(tmp_path / "unused")
    w2 = w1 if writers == "one" else pyckpt.Writer(tmp_path / "unused2")
    sds = [_sd(1, 24), _sd(2, 24)]
    try:
        for _ in range(2):
            f1 = dcp.async_save(sds[0], storage_writer=w1, checkpoint_id=tmp_path / "a",
                                no_dist=True)
            f2 = dcp.async_save(sds[1], storage_writer=w2, checkpoint_id=tmp_path / "b",
                                no_dist=True)
            f1.result()
            f2.result()
            _assert_same(_load(tmp_path / "a", 24), sds[0])
            _assert_same(_load(tmp_path / "b", 24), sds[1])
            assert len(_data_files(tmp_path / "a")) == len(_data_files(tmp_path / "b")) == 1
    finally:
        w1.close()
        w2.close()


def test_every_save_through_one_writer_gets_its_own_id(tmp_path: Path) -> None:
    # Without checkpoint_id DCP never calls reset(): the second save must not reuse (and
    # rename over) the data file that the first checkpoint's metadata names.
    w = pyckpt.Writer(tmp_path)
    dcp.save(_sd(1, 1), storage_writer=w, no_dist=True)
    first = _data_files(tmp_path)
    dcp.save(_sd(2, 1), storage_writer=w, no_dist=True)
    assert first.isdisjoint(_data_files(tmp_path))
    _assert_same(_load(tmp_path, 1), _sd(2, 1))


# ------------------------------------------------------------ two processes, one directory


@pytest.mark.slow
def test_two_processes_saving_into_one_directory(tmp_path: Path) -> None:
    """Either save may win or be refused, but what the directory holds afterwards always loads
    bit-exact as a save that reported success, and no file of it is missing."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "pyckpt.storage",
                                "_concurrent_worker"])
    refused = 0
    for trial in range(8):
        path = str(tmp_path / f"t{trial}")
        barrier, q = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_save_proc, args=(path, 10 * trial + i, barrier, q))
                 for i in range(2)]
        for p in procs:
            p.start()
        try:
            outcomes = [q.get(timeout=120) for _ in procs]
        except queue.Empty:
            codes = [p.exitcode for p in procs]
            for p in procs:
                p.kill()
            raise AssertionError(
                f"trial {trial}: a saver never reported (exit codes {codes})"
            ) from None
        for p in procs:
            p.join(60)
        ok = [seed for seed, status, _ in outcomes if status == "ok"]
        for _seed, status, msg in outcomes:
            assert status in ("ok", "BlockingIOError"), (status, msg)
            if status == "BlockingIOError":
                refused += 1
                assert "in progress" in msg and path in msg
        assert ok, outcomes
        out = _load(path, 16)
        assert out["step"] in ok, (out["step"], outcomes)
        _assert_same(out, _sd(out["step"], 16))
        # Only the winner's data file is left (the other's was removed by the committed save).
        assert len(_data_files(Path(path))) == 1


def test_second_save_into_a_locked_directory_is_refused(tmp_path: Path) -> None:
    from pyckpt.backends.posix import _DirLock

    dcp.save(_sd(1, 1), storage_writer=pyckpt.Writer(tmp_path), no_dist=True)
    before = sorted(os.listdir(tmp_path))
    lock = _DirLock(str(tmp_path))  # another save in progress
    try:
        with pytest.raises(CheckpointException) as info:
            dcp.save(_sd(2, 1), storage_writer=pyckpt.Writer(tmp_path), no_dist=True)
        (err, _), = info.value.failures.values()
        assert isinstance(err, BlockingIOError)
        assert err.filename == str(tmp_path / ".pyckpt.lock")
    finally:
        lock.release()
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, nothing removed
    _assert_same(_load(tmp_path, 1), _sd(1, 1))
    dcp.save(_sd(3, 1), storage_writer=pyckpt.Writer(tmp_path), no_dist=True)  # lock is free
    _assert_same(_load(tmp_path, 1), _sd(3, 1))


def test_a_failed_dcp_save_leaves_the_directory_free_for_the_next(tmp_path: Path) -> None:
    """A dcp.save refused after its writer took the lock (here a dtype the format cannot
    store) left the lock to an unreachable writer, held in a reference cycle of DCP's error:
    the retry was refused as 'another save ... is in progress' until the next garbage
    collection."""
    dcp.save(_sd(1, 1), storage_writer=pyckpt.Writer(tmp_path), no_dist=True)
    bad = {**_sd(2, 1), "packed": torch.zeros(4, dtype=torch.uint8).view(torch.uint4)}
    with pytest.raises(CheckpointException):
        dcp.save(bad, storage_writer=pyckpt.Writer(tmp_path), no_dist=True)
    dcp.save(_sd(3, 1), storage_writer=pyckpt.Writer(tmp_path), no_dist=True)
    _assert_same(_load(tmp_path, 1), _sd(3, 1))


def test_stale_files_of_a_crashed_save_are_removed_by_the_next_save(tmp_path: Path) -> None:
    dcp.save(_sd(1, 1), storage_writer=pyckpt.Writer(tmp_path), no_dist=True)
    orphan = tmp_path / _format.data_file_name(0, 0, "0123456789ab")
    orphan.write_bytes(b"x" * 100)
    temp = tmp_path / (_format.data_file_name(1, 0, "0123456789ab") + ".tmp-1-0")
    temp.write_bytes(b"y")
    dcp.save(_sd(2, 1), storage_writer=pyckpt.Writer(tmp_path), no_dist=True)
    assert not orphan.exists() and not temp.exists()
    _assert_same(_load(tmp_path, 1), _sd(2, 1))


# ------------------------------------------------------------ overwrite


def test_overwrite_like_filesystem_writer(tmp_path: Path) -> None:
    """The equivalent of DCP's e2e TestCheckpointOrderingAndOverwrite.test_overwrite."""
    t1, t2 = torch.randn(10), torch.randn(10)
    dcp.save({"random": t1}, storage_writer=pyckpt.Writer(tmp_path, overwrite=False),
             no_dist=True)
    dcp.save({"random": t2}, storage_writer=pyckpt.Writer(tmp_path, overwrite=True),
             no_dist=True)
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, storage_reader=pyckpt.Reader(tmp_path), no_dist=True)
    assert torch.equal(sd["random"], t2)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save({"random": t1}, storage_writer=pyckpt.Writer(tmp_path, overwrite=False),
                 no_dist=True)
    with pytest.raises(FileExistsError) as info:
        pyckpt.save({"random": t1}, tmp_path, overwrite=False)
    assert info.value.filename == str(tmp_path / _format.METADATA_FILE)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    dcp.load(sd, storage_reader=pyckpt.Reader(tmp_path), no_dist=True)
    assert torch.equal(sd["random"], t2)


def test_overwrite_false_into_an_incomplete_directory_saves(tmp_path: Path) -> None:
    (tmp_path / "unrelated.txt").write_text("x")
    pyckpt.save({"a": torch.ones(3)}, tmp_path, overwrite=False)
    out = {"a": torch.zeros(3)}
    pyckpt.load(out, tmp_path)
    assert torch.equal(out["a"], torch.ones(3))


# ------------------------------------------------------------ lazy Reader


def test_reader_made_before_the_checkpoint_exists(tmp_path: Path) -> None:
    reader = pyckpt.Reader(tmp_path / "later")  # nothing there yet: no error
    pyckpt.save({"a": torch.arange(4.0)}, tmp_path / "later")
    out = {"a": torch.zeros(4)}
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["a"], torch.arange(4.0))


def test_missing_checkpoint_raises_typed_errors_at_load(tmp_path: Path) -> None:
    reader = pyckpt.Reader(tmp_path / "none")
    with pytest.raises(FileNotFoundError) as info:
        reader.read_metadata()
    assert info.value.filename == str(tmp_path / "none" / _format.METADATA_FILE)
    with pytest.raises(CheckpointException) as dcp_info:
        dcp.load({"a": torch.zeros(2)}, storage_reader=pyckpt.Reader(tmp_path / "none"),
                 no_dist=True)
    (err, _), = dcp_info.value.failures.values()
    assert isinstance(err, FileNotFoundError)  # the rank's failure is the typed error
    with pytest.raises(FileNotFoundError):
        pyckpt.load({"a": torch.zeros(2)}, tmp_path / "none")
    pyckpt.save({"a": torch.ones(2)}, tmp_path / "bad")
    (tmp_path / "bad" / _format.METADATA_FILE).write_text("{not json")
    with pytest.raises(pyckpt.CheckpointFormatError):
        pyckpt.load({"a": torch.zeros(2)}, tmp_path / "bad")


# ------------------------------------------------------------ use_collectives=False


# Several ranks: rank-local metadata, tests/test_ranklocal.py.


def test_use_collectives_false_in_one_process_saves(tmp_path: Path) -> None:
    dcp.save({"a": torch.ones(3)}, storage_writer=pyckpt.Writer(tmp_path), no_dist=True,
             use_collectives=False)
    out = {"a": torch.zeros(3)}
    dcp.load(out, storage_reader=pyckpt.Reader(tmp_path), no_dist=True)
    assert torch.equal(out["a"], torch.ones(3))
