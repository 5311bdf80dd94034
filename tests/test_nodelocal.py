"""Node-local checkpoints: no rank can open another node's files (no shared filesystem).

Each rank's checkpoint directory lives on its "node" (tests/_nodelocal_workers.py): with a
private mount namespace per rank, other nodes' directories are unreachable by any path; every
rank also records the files it opens from Python and the test checks none is another node's.
Saves, loads at the same and at other world sizes (2 -> 3, 4 -> 2, other sharding), errors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _nodelocal_workers import (
    agree_worker,
    auto_load_worker,
    consolidate_error_worker,
    consolidate_worker,
    failing_save_worker,
    full_state,
    load_error_worker,
    load_worker,
    namespace_refusal,
    save_worker,
    shared_save_worker,
)
from dist_utils import free_port, run_distributed

import pyckpt
from pyckpt._format import METADATA_FILE, is_data_file

pytestmark = pytest.mark.distributed

_REFUSAL = namespace_refusal()
if os.environ.get("PYCKPT_TEST_NO_NAMESPACE") == "1":  # exercise the audit-hook-only fallback
    _REFUSAL = "PYCKPT_TEST_NO_NAMESPACE=1"


def _node(root: Path, k: int, name: str = "ckpt") -> Path:
    return root / "nodes" / f"n{k}" / name


def _setup(root: Path) -> None:
    (root / "ckpt").mkdir(parents=True, exist_ok=True)
    (root / "export").mkdir(exist_ok=True)
    (root / "nodes").mkdir(exist_ok=True)


def _data_files(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if is_data_file(n))


def _save(root: Path, world: int, per_node: int, compression: str | None = None) -> None:
    _setup(root)
    results = run_distributed(save_worker, world, str(root), per_node, compression)
    for r in results:
        assert r["foreign"] == [], r
        assert r["mode"] == ("paths" if _REFUSAL else "namespace")
        if r["mode"] == "namespace":  # other nodes' directories cannot even be listed
            assert r["visible"] == [], r
    nnodes = world // per_node
    writers = set()
    for k in range(nnodes):
        d = _node(root, k)
        assert (d / METADATA_FILE).is_file()  # every node can tell the save is complete
        names = _data_files(d)
        assert names, k
        # Each node holds only the files its own ranks wrote.
        assert {int(n.split("-")[0]) // per_node for n in names} == {k}
        writers |= {int(n.split("-")[0]) for n in names}
    assert writers == set(range(world))
    docs = {(_node(root, k) / METADATA_FILE).read_bytes() for k in range(nnodes)}
    assert len(docs) == 1  # the same metadata everywhere


def _load(root: Path, world: int, per_node: int) -> None:
    results = run_distributed(load_worker, world, str(root), per_node)
    for r in results:
        assert r["bad"] == [] and r["foreign"] == [], r


@pytest.mark.parametrize("compression", [pytest.param(None, marks=pytest.mark.slow), "zstd"])
def test_save_load_same_world_and_2_to_3(tmp_path: Path, compression: str | None) -> None:
    _save(tmp_path, 2, 1, compression)
    _load(tmp_path, 2, 1)  # same world size, another sharding: both ranks fetch from the other
    _load(tmp_path, 3, 1)  # node 2 is new (no files, no metadata): it gets both from peers
    assert not os.path.exists(_node(tmp_path, 2) / METADATA_FILE)  # a load writes nothing


@pytest.mark.slow
def test_auto_reads_node_local_over_the_group_and_a_shared_directory_directly(
    tmp_path: Path,
) -> None:
    _save(tmp_path, 2, 1, "zstd")
    results = run_distributed(auto_load_worker, 2, str(tmp_path), 1, True)
    for r in results:  # each rank sees only its node's files: chunks travel between ranks
        assert r["bad"] == [] and r["foreign"] == [] and r["exchanges"] == 1, r
    run_distributed(shared_save_worker, 2, str(tmp_path))
    results = run_distributed(auto_load_worker, 2, str(tmp_path), 1, False)
    for r in results:  # every rank sees every file: read directly, no transfer round
        assert r["bad"] == [] and r["exchanges"] == 0, r


def test_reader_refuses_an_unknown_shared_filesystem_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'auto'"):
        pyckpt.Reader(tmp_path, shared_filesystem="yes")  # type: ignore[arg-type]


@pytest.mark.slow
def test_save_4_ranks_on_2_nodes_load_on_2(tmp_path: Path) -> None:
    _save(tmp_path, 4, 2, "zstd")  # ranks 0,1 on node 0; ranks 2,3 on node 1
    _load(tmp_path, 2, 1)


@pytest.mark.slow
def test_missing_node_files_name_rank_and_file(tmp_path: Path) -> None:
    _save(tmp_path, 2, 1)
    lost = _data_files(_node(tmp_path, 1))
    for n in lost:
        os.unlink(_node(tmp_path, 1) / n)
    results = run_distributed(load_error_worker, 2, str(tmp_path), 1)
    for r in results:
        assert r["type"] == "FileNotFoundError", r
        assert "written by rank 1" in r["message"] and lost[0] in r["message"], r
        assert os.path.basename(r["filename"]) == lost[0]


@pytest.mark.slow
def test_corrupt_chunk_on_the_owner_is_a_checksum_error_on_every_rank(tmp_path: Path) -> None:
    _save(tmp_path, 2, 1, "zstd")
    name = _data_files(_node(tmp_path, 1))[0]
    path = _node(tmp_path, 1) / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    results = run_distributed(load_error_worker, 2, str(tmp_path), 1)
    for r in results:
        assert r["type"] == "ChecksumError" and name in r["message"], r


def test_agree_reraises_the_failure_on_every_rank() -> None:
    results = run_distributed(agree_worker, 2)
    for rank, r in enumerate(results):
        assert r["raised"] == "KeyError" and r["cleaned"] == [rank], r
        assert r["value"] == rank * 10 and r["values"] == [0, 10] and r["root"] == {"plan": 42}
    assert any("test step failed on rank 1" in n for n in results[0]["notes"]), results[0]


@pytest.mark.slow
def test_metadata_of_different_saves_is_refused(tmp_path: Path) -> None:
    _save(tmp_path, 2, 1)
    old = (_node(tmp_path, 1) / METADATA_FILE).read_bytes()
    old_files = {n: (_node(tmp_path, 1) / n).read_bytes() for n in _data_files(_node(tmp_path, 1))}
    _save(tmp_path, 2, 1)
    (_node(tmp_path, 1) / METADATA_FILE).write_bytes(old)  # node 1 missed the second commit
    for n, b in old_files.items():
        (_node(tmp_path, 1) / n).write_bytes(b)
    results = run_distributed(load_error_worker, 2, str(tmp_path), 1)
    for r in results:
        assert r["type"] == "CheckpointFormatError" and "different saves" in r["message"], r


@pytest.mark.slow
@pytest.mark.skipif(_REFUSAL is not None, reason=str(_REFUSAL))
def test_failed_rank_leaves_no_metadata_anywhere(tmp_path: Path) -> None:
    _setup(tmp_path)
    results = run_distributed(failing_save_worker, 2, str(tmp_path))
    # Rank 1 hits ENOSPC; DCP reports the failure on every rank.
    assert [r["type"] for r in results] == ["OSError"] * 2, results
    for k in range(2):
        assert not (_node(tmp_path, k) / METADATA_FILE).exists()


def _same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bytes(
        a.contiguous().view(-1).view(__import__("torch").uint8).numpy()
    ) == bytes(b.contiguous().view(-1).view(__import__("torch").uint8).numpy())


def _gather_export(root: Path, nnodes: int, out: Path) -> dict:
    """Copies every node's export into one directory (what a user would do) and loads it."""
    from safetensors.torch import load_file

    from pyckpt._consolidate import INDEX_NAME

    out.mkdir()
    indexes = set()
    for k in range(nnodes):
        d = _node(root, k, "export")
        assert [n for n in os.listdir(d) if n.startswith(".")] == []  # no temp left behind
        indexes.add((d / INDEX_NAME).read_bytes())  # every node's dst has the same index
        for n in os.listdir(d):
            if n != INDEX_NAME:
                assert not (out / n).exists()  # each output file is written by one rank
                shutil.copy(d / n, out / n)
    assert len(indexes) == 1
    import json

    index = json.loads(indexes.pop())
    tensors = {}
    for fname in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(out / fname)))
    return tensors


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_consolidate_over_the_process_group(tmp_path: Path, world: int) -> None:
    _save(tmp_path, 2, 1, "zstd")
    kwargs = {"max_file_bytes": 500, "batch_bytes": 2048, "threads": 2}
    results = run_distributed(consolidate_worker, world, str(tmp_path), 1, kwargs)
    for r in results:
        assert r["foreign"] == [], r
    assert sum(r["rank_bytes"] for r in results) == results[0]["total"]
    assert all(r["files"] for r in results)  # every rank wrote some of the files
    for r in results:  # where each rank's time went (the transfers count as copying)
        assert list(r["phases"]) == ["plan", "copy", "wait", "commit"], r["phases"]
        assert sum(r["phases"].values()) <= r["seconds"] + 1e-9
    out = _gather_export(tmp_path, world, tmp_path / "all")
    full = full_state()
    assert sorted(out) == sorted(full)
    for k, v in full.items():
        assert _same_bits(out[k], v), k


@pytest.mark.slow
def test_local_read_failure_mid_consolidation_is_raised_on_every_rank(tmp_path: Path) -> None:
    # Every chunk of node 0's file is corrupt, and one output file per rank: rank 0 fails on
    # its own (local) chunks while rank 1 learns of it in a transfer round; both must raise
    # the ChecksumError (no rank left waiting in a collective).
    _save(tmp_path, 2, 1, None)
    name = _data_files(_node(tmp_path, 0))[0]
    path = _node(tmp_path, 0) / name
    data = bytearray(path.read_bytes())
    for i in range(0, len(data), 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    kwargs = {"max_file_bytes": 500, "batch_bytes": 2048, "threads": 1}
    results = run_distributed(consolidate_error_worker, 2, str(tmp_path), 1, kwargs)
    for r in results:
        assert r["type"] == "ChecksumError" and name in r["message"], r
    from pyckpt._consolidate import INDEX_NAME

    for k in range(2):
        assert INDEX_NAME not in os.listdir(_node(tmp_path, k, "export"))


@pytest.mark.slow
@pytest.mark.skipif(_REFUSAL is not None, reason=str(_REFUSAL))
def test_killed_rank_mid_consolidation_leaves_no_index(tmp_path: Path) -> None:
    from pyckpt._consolidate import INDEX_NAME

    _save(tmp_path, 2, 1, "zstd")
    port = free_port()
    script = str(Path(__file__).with_name("_nodelocal_workers.py"))
    procs = [
        subprocess.Popen([sys.executable, script, str(r), "2", str(port), str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert procs[1].returncode == 17, outs[1]
    assert procs[0].returncode == 3 and b"ERROR" in outs[0][0], outs[0]
    for k in range(2):
        d = _node(tmp_path, k, "export")
        names = os.listdir(d)
        assert INDEX_NAME not in names
        assert all(n.startswith(".") and ".tmp-" in n for n in names), names
    # The surviving rank removed its temp files; only the killed rank's remain.
    assert os.listdir(_node(tmp_path, 0, "export")) == []


def test_single_process_node_local_save_load_consolidate(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    import pyckpt

    full = full_state()
    pyckpt.save(dict(full), tmp_path / "ckpt", shared_filesystem=False, compression="zstd")
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    pyckpt.load(sd, tmp_path / "ckpt", shared_filesystem=False)
    assert all(_same_bits(sd[k], v) for k, v in full.items())
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    pyckpt.load(sd, tmp_path / "ckpt", shared_filesystem="auto")  # one process: reads directly
    assert all(_same_bits(sd[k], v) for k, v in full.items())
    res = pyckpt.consolidate(tmp_path / "ckpt", tmp_path / "out", shared_filesystem=False,
                             fsync=False)
    out = load_file(res.files[0])
    assert all(_same_bits(out[k], v) for k, v in full.items())
    with pytest.raises(ValueError, match="batch_bytes"):
        pyckpt.consolidate(tmp_path / "ckpt", tmp_path / "out2", shared_filesystem=False,
                           batch_bytes=0)
