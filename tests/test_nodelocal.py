"""Node-local checkpoints: no rank can open another node's files (no shared filesystem).

Each rank's checkpoint directory lives on its "node" (tests/_nodelocal_workers.py): with a
private mount namespace per rank, other nodes' directories are unreachable by any path; every
rank also records the files it opens from Python and the test checks none is another node's.
Saves, loads at the same and at other world sizes (2 -> 3, 4 -> 2, other sharding), errors.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _nodelocal_workers import (
    failing_save_worker,
    load_error_worker,
    load_worker,
    namespace_refusal,
    save_worker,
)
from dist_utils import run_distributed

from pyckpt._format import METADATA_FILE, is_data_file

pytestmark = pytest.mark.distributed

_REFUSAL = namespace_refusal()


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
        assert r["foreign"] == [] and r["visible"] == [], r
        assert r["mode"] == ("paths" if _REFUSAL else "namespace")
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


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_save_load_same_world_and_2_to_3(tmp_path: Path, compression: str | None) -> None:
    _save(tmp_path, 2, 1, compression)
    _load(tmp_path, 2, 1)  # same world size, another sharding: both ranks fetch from the other
    _load(tmp_path, 3, 1)  # node 2 is new (no files, no metadata): it gets both from peers
    assert not os.path.exists(_node(tmp_path, 2) / METADATA_FILE)  # a load writes nothing


def test_save_4_ranks_on_2_nodes_load_on_2(tmp_path: Path) -> None:
    _save(tmp_path, 4, 2, "zstd")  # ranks 0,1 on node 0; ranks 2,3 on node 1
    _load(tmp_path, 2, 1)


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


@pytest.mark.skipif(_REFUSAL is not None, reason=str(_REFUSAL))
def test_failed_rank_leaves_no_metadata_anywhere(tmp_path: Path) -> None:
    _setup(tmp_path)
    results = run_distributed(failing_save_worker, 2, str(tmp_path))
    # Rank 1 hits ENOSPC; DCP reports the failure on every rank.
    assert [r["type"] for r in results] == ["OSError"] * 2, results
    for k in range(2):
        assert not (_node(tmp_path, k) / METADATA_FILE).exists()
