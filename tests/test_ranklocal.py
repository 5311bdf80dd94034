"""Rank-local saves (``dcp.save(..., use_collectives=False)`` on several ranks) and the
``Writer.save_id`` of a finished save.

PyTorch's own behaviour is the oracle: the same state is saved by DCP's ``FileSystemWriter``
and by ``pyckpt.Writer`` with ``use_collectives=False``, and both must produce per-rank metadata
naming the same items and chunks, and load back (at the same world size, through DCP's
rank-local fallback) to the same values, bit for bit.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_distributed
from torch.distributed.checkpoint.api import CheckpointException

import pyckpt
from pyckpt import _format, _ranklocal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(rank: int, world: int, step: int) -> dict[str, Any]:
    """Replicated, sharded (DTensor), rank-specific and non-tensor state; deterministic."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(step)
    full = torch.randn(8 * world, 33, generator=g)
    return {
        "replicated": torch.randn(1000, generator=g).to(torch.bfloat16) + step,
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        f"only_rank{rank}": torch.arange(rank * 7, rank * 7 + 50, dtype=torch.int64) + step,
        "extra": {"step": step, "lr": [0.1 * step]},
    }


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)  # a DTensor stays a DTensor (same placement)
        else:
            out[k] = {"step": -1, "lr": [0.0]}
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            x, y = _local(v), _local(b[k])
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert torch.equal(x.view(torch.uint8) if x.dtype.is_floating_point else x,
                               y.view(torch.uint8) if y.dtype.is_floating_point else y), k
        else:
            assert v == b[k], k


def _layout(md: Any) -> dict[str, Any]:
    """Items of a DCP ``Metadata`` with their chunks ((offsets, sizes), sorted) or "bytes"."""
    out: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        chunks = getattr(m, "chunks", None)
        out[fqn] = "bytes" if chunks is None else sorted(
            (tuple(c.offsets), tuple(c.sizes)) for c in chunks)
    return out


def _pyckpt_layout(path: str, rank: int) -> dict[str, Any]:
    index = _ranklocal.read_index(path, rank)
    out: dict[str, Any] = {fqn: "bytes" for fqn in index.bytes_items}
    for fqn, st in index.tensors.items():
        out[fqn] = sorted((tuple(p.offsets), tuple(p.sizes)) for p in st.pieces)
    return out


def _compare_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    dcp_dir, ours = os.path.join(root, "dcp"), os.path.join(root, "pyckpt")
    result: dict[str, Any] = {}
    for step in (1, 2):  # the second save replaces the first in both directories
        sd = _state(rank, world, step)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(dcp_dir), use_collectives=False)
        writer = pyckpt.Writer(ours)
        dcp.save(sd, storage_writer=writer, use_collectives=False)
        dist.barrier()  # every rank's part is committed (DCP barriers too; this is explicit)

        # The same items and chunks in each rank's metadata.
        with open(os.path.join(dcp_dir, f"__{rank}.metadata"), "rb") as f:
            theirs = _layout(pickle.load(f))
        assert _pyckpt_layout(ours, rank) == theirs, (rank, step)
        # save_id: the id stored in this rank's metadata, stable after the save.
        stored = _ranklocal.read_index(ours, rank).save_id
        assert writer.save_id == stored and writer.save_id == stored

        # Both load at the same world size through DCP's rank-local fallback, bit-exact.
        out_dcp, out_ours = _zeros_like(sd), _zeros_like(sd)
        dcp.load(out_dcp, storage_reader=dcp.FileSystemReader(dcp_dir))
        dcp.load(out_ours, storage_reader=pyckpt.Reader(ours))
        _assert_equal(out_dcp, sd)
        _assert_equal(out_ours, sd)
        out_api = _zeros_like(sd)
        pyckpt.load(out_api, ours)
        _assert_equal(out_api, sd)
        dist.barrier()
        result[f"files{step}"] = sorted(os.listdir(ours))
        result[f"save_id{step}"] = writer.save_id
    return result


@pytest.mark.distributed
def test_rank_local_save_matches_filesystem_writer(tmp_path: Path) -> None:
    results = run_distributed(_compare_worker, 2, str(tmp_path))
    dcp_files = set(os.listdir(tmp_path / "dcp"))
    assert {"__0.metadata", "__1.metadata"} <= dcp_files and ".metadata" not in dcp_files
    files = sorted(os.listdir(tmp_path / "pyckpt"))
    # One metadata file and one data file per rank, of the last save; no global metadata.
    data = [n for n in files if _format.is_data_file(n)]
    assert sorted(_format.data_file_rank(n) for n in data) == [0, 1]
    assert [n for n in files if not _format.is_data_file(n)] == [
        ".pyckpt.lock", "pyckpt.rank0.json", "pyckpt.rank1.json"]
    for r, res in enumerate(results):
        assert res["save_id1"] != res["save_id2"]
        mine = [n for n in data if _format.data_file_rank(n) == r]
        assert mine == [_format.data_file_name(r, 0, res["save_id2"])]


def _saved(root: Path) -> None:
    run_distributed(_save_worker, 2, str(root))


def _save_worker(rank: int, world: int, path: str) -> None:
    dcp.save(_state(rank, world, 3), storage_writer=pyckpt.Writer(path), use_collectives=False)


def _load_worker(rank: int, world: int, path: str) -> tuple[str, str, str]:
    """Loads with pyckpt.load (typed errors) and with dcp.load (CheckpointException)."""
    sd = _zeros_like(_state(rank, world, 3))
    try:
        pyckpt.load(sd, path)
        typed = "loaded"
    except Exception as e:
        typed = f"{type(e).__name__}|{getattr(e, 'filename', None)}|{e}"
    try:
        dcp.load(sd, storage_reader=pyckpt.Reader(path))
        wrapped = "loaded"
    except CheckpointException as e:
        # failures: rank -> (exception, traceback)
        wrapped = ";".join(f"{r}:{type(f[0]).__name__}" for r, f in sorted(e.failures.items()))
    if typed == "loaded":
        _assert_equal(sd, _state(rank, world, 3))
    return typed, wrapped, str(rank)


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_local_load_errors_are_typed(tmp_path: Path) -> None:
    good = tmp_path / "good"
    _saved(good)
    # A rank's metadata is missing: that rank fails with FileNotFoundError naming the file.
    missing = tmp_path / "missing"
    shutil.copytree(good, missing)
    (missing / "pyckpt.rank1.json").unlink()
    # A rank's metadata is damaged: CheckpointFormatError naming it.
    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    raw = (damaged / "pyckpt.rank0.json").read_bytes()
    (damaged / "pyckpt.rank0.json").write_bytes(raw.replace(b'"sharded"', b'"shardex"'))
    # A rank's metadata names another rank's data file.
    foreign = tmp_path / "foreign"
    shutil.copytree(good, foreign)
    shutil.copy(foreign / "pyckpt.rank1.json", foreign / "pyckpt.rank0.json")

    # Every rank raises the failing rank's typed error (pyckpt.load), and DCP's
    # CheckpointException names that rank and error type (dcp.load).
    meta1 = str(missing / "pyckpt.rank1.json")
    for typed, wrapped, _ in run_distributed(_load_worker, 2, str(missing)):
        assert typed.startswith(f"FileNotFoundError|{meta1}|"), typed
        assert "no rank-local metadata for rank 1" in typed
        assert wrapped == "1:FileNotFoundError"

    meta0 = str(damaged / "pyckpt.rank0.json")
    for typed, wrapped, _ in run_distributed(_load_worker, 2, str(damaged)):
        assert typed.startswith(f"CheckpointFormatError|None|{meta0}: metadata checksum"), typed
        assert wrapped == "0:CheckpointFormatError"

    for typed, wrapped, _ in run_distributed(_load_worker, 2, str(foreign)):
        assert typed.startswith("CheckpointFormatError") and "pyckpt.rank0.json" in typed
        assert "is not a data file of rank 0" in typed, typed
        assert wrapped == "0:CheckpointFormatError"


def test_single_process_loads_rank_zero_part(tmp_path: Path) -> None:
    """What else loads a rank-local checkpoint: a single process loads rank 0's part (its
    replicated state is complete; other ranks' shards are not in it)."""
    _saved(tmp_path)
    out = {"replicated": torch.zeros(1000, dtype=torch.bfloat16), "only_rank0": torch.zeros(
        50, dtype=torch.int64), "extra": {"step": -1, "lr": [0.0]}}
    pyckpt.load(out, tmp_path)
    g = torch.Generator().manual_seed(3)
    torch.randn(16, 33, generator=g)  # the sharded tensor's draw comes first in _state
    replicated = torch.randn(1000, generator=g).to(torch.bfloat16) + 3
    assert torch.equal(out["replicated"].view(torch.int16), replicated.view(torch.int16))
    assert torch.equal(out["only_rank0"], torch.arange(0, 50) + 3)
    assert out["extra"] == {"step": 3, "lr": [0.1 * 3]}
    # A key only rank 1 saved is not in rank 0's part: DCP's missing-key error.
    with pytest.raises(RuntimeError, match="only_rank1"):
        pyckpt.load({"only_rank1": torch.zeros(50, dtype=torch.int64)}, tmp_path)
    # The whole sharded tensor: rank 0's part holds half of it. Refused, not half-loaded.
    whole = {"sharded": torch.full((16, 33), 7.0)}
    with pytest.raises(pyckpt.CheckpointFormatError, match=r"holds 264 of the 528 elements") as e:
        pyckpt.load(whole, tmp_path)
    assert "pyckpt.rank0.json" in str(e.value) and "'sharded'" in str(e.value)
    assert torch.equal(whole["sharded"], torch.full((16, 33), 7.0))  # nothing was read


def _refused_worker(rank: int, world: int, path: str, url: str) -> tuple[str, str]:
    sd = {f"r{rank}": torch.full((100,), float(rank))}
    out = []
    for target, kwargs in ((url, {}), (path, {"overwrite": False})):
        try:
            dcp.save(sd, storage_writer=pyckpt.Writer(target, **kwargs), use_collectives=False)
            out.append("saved")
        except (ValueError, FileExistsError) as e:
            out.append(f"{type(e).__name__}|{getattr(e, 'filename', None)}|{e}")
    return out[0], out[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_local_save_refusals(tmp_path: Path) -> None:
    _saved(tmp_path)
    before = sorted(os.listdir(tmp_path))
    results = run_distributed(_refused_worker, 2, str(tmp_path), "s3://bucket/ckpt")
    for rank, (s3, again) in enumerate(results):
        assert s3.startswith("ValueError") and "s3://bucket/ckpt" in s3, s3
        meta = str(tmp_path / f"pyckpt.rank{rank}.json")
        assert again.startswith(f"FileExistsError|{meta}|"), again
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, nothing removed


def _collective_worker(rank: int, world: int, path: str) -> None:
    dcp.save(_state(rank, world, 4), storage_writer=pyckpt.Writer(path))


def _rank_local_worker(rank: int, world: int, path: str) -> None:
    dcp.save(_state(rank, world, 5), storage_writer=pyckpt.Writer(path), use_collectives=False)
    sd = _zeros_like(_state(rank, world, 5))
    pyckpt.load(sd, path)
    _assert_equal(sd, _state(rank, world, 5))


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_local_and_collective_saves_replace_each_other(tmp_path: Path) -> None:
    _saved(tmp_path)
    run_distributed(_collective_worker, 2, str(tmp_path))  # removes the rank-local parts
    names = sorted(n for n in os.listdir(tmp_path) if not _format.is_data_file(n))
    assert names == [".pyckpt.lock", "pyckpt.json"]
    index = _format.read_index(tmp_path)
    assert set(index.files) == {n for n in os.listdir(tmp_path) if _format.is_data_file(n)}
    run_distributed(_rank_local_worker, 2, str(tmp_path))  # removes pyckpt.json
    names = sorted(n for n in os.listdir(tmp_path) if not _format.is_data_file(n))
    assert names == [".pyckpt.lock", "pyckpt.rank0.json", "pyckpt.rank1.json"]
    assert len([n for n in os.listdir(tmp_path) if _format.is_data_file(n)]) == 2


def _replicated_worker(rank: int, world: int, path: str, step: int) -> bool:
    """Saves a replicated tensor rank-locally at ``step`` (``step`` < 0: loads it and
    returns whether this rank got step ``-step``'s values)."""
    def state(s: int) -> dict[str, Any]:
        return {"w": torch.full((1000,), float(s)), f"only_rank{rank}": torch.full((3,), s)}

    if step > 0:
        dcp.save(state(step), storage_writer=pyckpt.Writer(path), use_collectives=False)
        return True
    sd = state(0)
    pyckpt.load(sd, path)
    return all(torch.equal(sd[k], v) for k, v in state(-step).items())


@pytest.mark.slow
@pytest.mark.distributed
def test_a_save_by_fewer_ranks_retires_the_parts_of_the_others(tmp_path: Path) -> None:
    """A job that shrank (4 ranks, then 2) and grew back: the 2-rank save must not leave ranks
    2 and 3's parts of the 4-rank save, which a 4-rank load read beside the new ones (ranks 0-1
    got step 2, ranks 2-3 step 1, silently). Their metadata is retired with the commit, so such
    a load is the typed error of a checkpoint saved by fewer ranks."""
    run_distributed(_replicated_worker, 4, str(tmp_path), 1)
    run_distributed(_replicated_worker, 2, str(tmp_path), 2)
    with pytest.raises(AssertionError, match="no rank-local metadata for rank 2"):
        run_distributed(_replicated_worker, 4, str(tmp_path), -2)
    assert run_distributed(_replicated_worker, 2, str(tmp_path), -2) == [True, True]
    names = sorted(n for n in os.listdir(tmp_path) if n != ".pyckpt.lock")
    assert [n for n in names if not _format.is_data_file(n)] == [
        "pyckpt.rank0.json", "pyckpt.rank1.json"]
    assert {_format.data_file_rank(n) for n in names if _format.is_data_file(n)} == {0, 1}


# ------------------------------------------------------------------------- commit of a part

_OLD, _NEW = "a" * 12, "b" * 12


def _part_dir(path: Path) -> None:
    for name in ("pyckpt.json", "pyckpt.rank1.json", f"0-0.{_OLD}.pyckpt", f"1-0.{_OLD}.pyckpt",
                 f"0-0.{_NEW}.pyckpt", "pyckpt.rank0.json.tmp-1-2", f"0-1.{_OLD}.pyckpt.tmp-3-4",
                 f"1-1.{_OLD}.pyckpt.tmp-5-6", "pyckpt.rank1.json.tmp-7-8",
                 "pyckpt.json.tmp-9-10", ".pyckpt.lock"):
        (path / name).write_bytes(b"x")


def test_a_part_commits_by_the_backends_rule_and_removes_only_its_own_stale_files(
    tmp_path: Path,
) -> None:
    from pyckpt.backends.base import SaveState, commit_save

    _part_dir(tmp_path)
    part = _ranklocal.Part(str(tmp_path), 0, fsync=False)
    commit_save(part, {f"0-0.{_NEW}.pyckpt": 1}, b"rank 0's document", SaveState(False),
                stale=part.is_stale)
    assert (tmp_path / "pyckpt.rank0.json").read_bytes() == b"rank 0's document"
    # pyckpt.json (the collective checkpoint replaced) and rank 0's data and temp files of other
    # saves are gone; rank 1's files and another writer's temp of pyckpt.json stay.
    assert sorted(os.listdir(tmp_path)) == sorted([
        ".pyckpt.lock", "pyckpt.rank0.json", "pyckpt.rank1.json", f"1-0.{_OLD}.pyckpt",
        f"0-0.{_NEW}.pyckpt", f"1-1.{_OLD}.pyckpt.tmp-5-6", "pyckpt.rank1.json.tmp-7-8",
        "pyckpt.json.tmp-9-10"])


def test_a_part_whose_metadata_cannot_be_written_removes_only_this_saves_data(
    tmp_path: Path,
) -> None:
    from pyckpt.backends.base import SaveState, commit_save

    _part_dir(tmp_path)
    (tmp_path / "pyckpt.rank0.json").mkdir()  # the rename onto it fails
    before = set(os.listdir(tmp_path))
    part = _ranklocal.Part(str(tmp_path), 0, fsync=False)
    with pytest.raises(OSError):
        commit_save(part, {f"0-0.{_NEW}.pyckpt": 1}, b"doc", SaveState(False),
                    stale=part.is_stale)
    after = set(os.listdir(tmp_path))
    assert before - after == {f"0-0.{_NEW}.pyckpt"}
    assert not {n for n in after - before if ".tmp-" not in n}  # at most the failed temp


# ------------------------------------------------------------------------- save_id


def test_save_id_is_the_stored_one_after_a_save(tmp_path: Path) -> None:
    w = pyckpt.Writer(tmp_path)
    ids = []
    for value in (1.0, 2.0):
        dcp.save({"a": torch.full((10,), value)}, storage_writer=w, no_dist=True)
        doc = json.loads((tmp_path / _format.METADATA_FILE).read_bytes()[:-1].rsplit(
            b',"checksum"', 1)[0] + b"}")
        md = pyckpt.Reader(tmp_path).read_metadata()
        assert md.storage_meta is not None
        assert w.save_id == doc["save_id"] == md.storage_meta.save_id
        assert w.save_id == w.save_id  # stable: reading it mints nothing
        ids.append(w.save_id)
    assert ids[0] != ids[1]
    # Another writer's save into the same directory does not change this writer's id.
    dcp.save({"a": torch.zeros(10)}, storage_writer=pyckpt.Writer(tmp_path), no_dist=True)
    assert w.save_id == ids[1]


def _save_id_worker(rank: int, world: int, path: str) -> str:
    w = pyckpt.Writer(path)
    dcp.save({"a": torch.full((1000,), float(rank)), "b": torch.ones(4096)}, storage_writer=w)
    return w.save_id


@pytest.mark.distributed
def test_save_id_is_the_stored_one_on_every_rank(tmp_path: Path) -> None:
    ids = run_distributed(_save_id_worker, 2, str(tmp_path))
    assert ids[0] == ids[1] == _format.read_index(tmp_path).save_id


def test_a_collective_metadata_that_outlives_the_commit_fails_the_save(tmp_path: Path) -> None:
    """The commit's clean-up only logs what it cannot remove; a ``pyckpt.json`` left beside a
    rank-local part would be loaded instead of it, so its removal is checked on its own."""
    part = _ranklocal.Part(str(tmp_path), 0, fsync=False)
    part.retire_collective()  # none there: nothing to do
    (tmp_path / "pyckpt.json").write_bytes(b"x")
    part.retire_collective()
    assert not (tmp_path / "pyckpt.json").exists()
    (tmp_path / "pyckpt.json").mkdir()  # cannot be unlinked
    with pytest.raises(IsADirectoryError):
        part.retire_collective()
