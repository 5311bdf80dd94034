"""Cooperative loads: replicated state is read from storage once over the ranks, balanced.

Every rank loads the same replicated state; the Reader counts the stored bytes it read from
storage (files or objects, including what it read for others). Asserted on 2-4 gloo ranks:
per-rank max/mean <= 1.05 and total <= 1.05x the stored bytes, on a shared directory, on S3
(SeaweedFS) and node-local; bit-exact values; sharded items mixed in; the same typed error on
every rank when one rank's read fails; ``cooperative=False`` reading everything everywhere.

The default (``cooperative=None``, ``PYCKPT_COOPERATIVE`` unset) is decided per load: every
rank on one node reading a directory reads alone; ranks on two nodes (pretended with
``GROUP_RANK``, as torchrun sets it), S3 and node-local checkpoints load cooperatively; the
argument and the knob force either way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from _coop_workers import (
    data_bytes,
    load_api,
    load_counted,
    load_failing,
    load_mixed,
    load_nodelocal,
    replicated_state,
    save_mixed,
    save_nodelocal,
    save_replicated,
)
from _nodelocal_workers import namespace_refusal
from _s3server import SeaweedServer, ServerUnavailable
from dist_utils import run_distributed

import pyckpt
from pyckpt import _knobs
from pyckpt._coop import assign, pays_off, wanted_across_nodes

pytestmark = pytest.mark.distributed


def _balanced(per_rank: list[int], stored: int) -> None:
    mean = sum(per_rank) / len(per_rank)
    assert max(per_rank) / mean <= 1.05, per_rank
    assert stored <= sum(per_rank) <= 1.05 * stored, (per_rank, stored)


def load_on_nodes(rank: int, world: int, path: str, cooperative: bool | None, per_node: int,
                  env: dict[str, str] | None = None) -> dict[str, Any]:
    """``load_counted`` with ranks ``per_node`` to a node (torchrun's ``GROUP_RANK``)."""
    os.environ.update(GROUP_RANK=str(rank // per_node), LOCAL_WORLD_SIZE=str(per_node))
    return load_counted(rank, world, path, cooperative, None, env)


def load_failing_forced(rank: int, world: int, path: str) -> tuple[str, str]:
    """``load_failing`` with cooperative loads forced on (the ranks share one node)."""
    os.environ["PYCKPT_COOPERATIVE"] = "1"
    return load_failing(rank, world, path)


@pytest.mark.slow
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_shared_directory_reads_each_byte_once(tmp_path: Path, compression: str | None) -> None:
    # One node: cooperative=True overrides the default (which reads alone there).
    path = str(tmp_path / "ckpt")
    run_distributed(save_replicated, 4, path, compression)
    results = run_distributed(load_counted, 4, path, True)
    assert all(r["bad"] == [] for r in results), results
    _balanced([r["bytes_read"] for r in results], data_bytes(path))


@pytest.mark.slow
def test_default_on_one_node_every_rank_reads_for_itself(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_replicated, 4, path, "zstd")
    results = run_distributed(load_counted, 4, path, None)
    stored = data_bytes(path)
    for r in results:
        assert r["bad"] == [] and r["bytes_read"] == stored, (r, stored)


def test_default_on_two_nodes_reads_each_byte_once(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_replicated, 4, path, "zstd")
    stored = data_bytes(path)
    results = run_distributed(load_on_nodes, 4, path, None, 2)
    assert all(r["bad"] == [] for r in results), results
    _balanced([r["bytes_read"] for r in results], stored)
    assert sum(r["bytes_read"] for r in results) == stored
    # cooperative=False overrides the default on two nodes too: every rank reads everything.
    alone = run_distributed(load_on_nodes, 4, path, False, 2)
    for r in alone:
        assert r["bad"] == [] and r["bytes_read"] == stored, (r, stored)


@pytest.mark.slow
def test_cooperative_false_reads_everything_on_every_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_replicated, 3, path, "zstd")
    results = run_distributed(load_counted, 3, path, False)
    stored = data_bytes(path)
    for r in results:
        assert r["bad"] == [] and r["bytes_read"] == stored, (r, stored)


@pytest.mark.parametrize("cooperative", [None, True, False])
def test_pyckpt_load_bit_exact(tmp_path: Path, cooperative: bool | None) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_replicated, 2, path, "zstd")
    assert run_distributed(load_api, 2, path, cooperative) == [[], []]


@pytest.mark.slow
def test_env_knob_forces_either_way(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_replicated, 2, path, None)
    stored = data_bytes(path)
    on = run_distributed(load_counted, 2, path, None, None, {"PYCKPT_COOPERATIVE": "1"})
    assert all(r["bad"] == [] for r in on), on
    _balanced([r["bytes_read"] for r in on], stored)  # one node, yet cooperative
    off = run_distributed(load_on_nodes, 2, path, None, 1, {"PYCKPT_COOPERATIVE": "0"})
    assert [(r["bad"], r["bytes_read"]) for r in off] == [([], stored)] * 2  # two nodes


@pytest.mark.slow
def test_mixed_sharded_and_replicated(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_mixed, 2, path)
    coop = run_distributed(load_mixed, 2, path, True)
    alone = run_distributed(load_mixed, 2, path, False)
    assert all(r["bad"] == [] for r in coop + alone), (coop, alone)
    _balanced([r["bytes_read"] for r in coop], data_bytes(path))
    # Without cooperation each rank reads its shards plus every replicated byte: the difference
    # is the replicated bytes the other rank read for it, never more (shards are not shared).
    assert sum(r["bytes_read"] for r in alone) > sum(r["bytes_read"] for r in coop)
    # The sharded tensors alone, cooperatively: planning it, the coordinator reads no other
    # rank's metadata shard (each cell is read by one rank, so nothing is exchanged).
    sharded = run_distributed(load_mixed, 2, path, True, "sharded.")
    assert [(r["bad"], r["shards_read"]) for r in sharded] == [([], 1)] * 2, sharded


@pytest.mark.slow
def test_a_failing_read_raises_the_same_typed_error_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_distributed(save_replicated, 3, str(path), None)
    victim = sorted(n for n in os.listdir(path) if n.endswith(".pyckpt"))[1]
    with open(path / victim, "r+b") as f:  # flip a byte in the middle of a chunk
        f.seek(CHUNK_MIDDLE)
        b = f.read(1)
        f.seek(CHUNK_MIDDLE)
        f.write(bytes([b[0] ^ 0xFF]))
    results = run_distributed(load_failing_forced, 3, str(path))
    assert len({r[0] for r in results}) == 1 and results[0][0] == "ChecksumError", results
    assert all(victim in msg for _, msg in results), results
    # The tensor the damaged chunk belongs to, by name (as a plain load names it), not the
    # exchange's "chunks for rank N".
    named = {m.group(1) for _, msg in results
             for m in [re.search(r"tensor '([^']+)'", msg)] if m is not None}
    assert len(named) == 1 and named <= set(replicated_state()), results


CHUNK_MIDDLE = 100_000


def test_assign_balances_and_keeps_single_rank_chunks_with_their_rank() -> None:
    # 40 chunks every rank wants, 10 only rank 0 wants (sharded): rank 0 reads those alone.
    shared = {("f", i * 10): 10 for i in range(40)}
    own = {("g", i * 10): 10 for i in range(10)}
    plans = assign([{**shared, **own}, dict(shared), dict(shared)], window=30)
    assert plans is not None
    assert all(k not in plans[0].exchanged for k in own)  # read by rank 0 itself
    assert {k for p in plans for k in p.exchanged} == set(shared)
    assert all(p.exchanged == plans[0].exchanged for p in plans)  # same reader, same round
    load = [0, 0, 0]
    for reader, _ in plans[0].exchanged.values():
        load[reader] += 10
    load[0] += 100
    assert max(load) - min(load) <= 10, load
    # Rounds: at most a window per round, at most window / (N - 1) from one reader.
    per_round: dict[int, list[int]] = {}
    for reader, t in plans[0].exchanged.values():
        per_round.setdefault(t, []).append(reader)
    assert plans[0].rounds == len(per_round)
    assert all(len(rs) <= 3 and all(rs.count(r) == 1 for r in rs) for rs in per_round.values())
    # Node-local: only the file's holders may read it.
    plans = assign([dict(shared), dict(shared)], holders=lambda name: [1])
    assert plans is not None and {r for r, _ in plans[0].exchanged.values()} == {1}
    assert assign([dict(own), {("h", 0): 5}]) is None  # nothing wanted twice: no exchange


def test_reader_argument_and_knob_default() -> None:
    assert pyckpt.Reader("x").cooperative is None  # decided per load
    assert pyckpt.Reader("x", cooperative=False).cooperative is False
    with _knobs.override(cooperative="1"):
        assert pyckpt.Reader("x").cooperative is True
        assert pyckpt.Reader("x", cooperative=False).cooperative is False
    with _knobs.override(cooperative="off"):
        assert pyckpt.Reader("x").cooperative is False
        assert pyckpt.Reader("x", cooperative=True).cooperative is True
    with _knobs.override(cooperative="maybe"), pytest.raises(ValueError, match="COOPERATIVE"):
        pyckpt.Reader("x")


def test_node_id_is_the_managers(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from pyckpt.manager import node_identity

    monkeypatch.setenv("GROUP_RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _knobs.node_id() == node_identity() == "5"
    monkeypatch.delenv("GROUP_RANK")
    assert _knobs.node_id() == node_identity() == socket.gethostname()
    with _knobs.override(node_id="rack2"):
        assert _knobs.node_id() == node_identity() == "rack2"


class _Place:
    """A backend as :func:`pays_off` sees it: a directory (its ranks share a page cache) or a
    store."""

    def __init__(self, directory: bool) -> None:
        self.shares_page_cache = directory

    def holders(self) -> None:
        return None


def test_default_rule() -> None:
    shared = {("f", 0): 10, ("f", 10): 10}
    own = [{("g", 0): 10}, {("g", 10): 10}, {("g", 20): 10}, {("g", 30): 10}]
    replicated = [dict(shared) for _ in range(4)]
    directory, store = _Place(True), _Place(False)

    def never() -> Any:
        raise AssertionError("one node: the chunks are not looked at")

    assert pays_off(directory, ["a"] * 4, never)[0] is False
    assert pays_off(directory, ["a", "a", "b", "b"], lambda: replicated)[0] is True
    assert pays_off(store, ["a"] * 4, never)[0] is True  # object store: always
    # Several nodes, but each chunk wanted on one node only (sharded; or replicas within a node).
    assert pays_off(directory, ["a", "a", "b", "b"], lambda: own)[0] is False
    within = [dict(shared), dict(shared), {("h", 0): 5}, {("h", 0): 5}]
    assert wanted_across_nodes(within, ["a", "a", "b", "b"]) is False
    assert wanted_across_nodes(within, ["a", "b", "b", "b"]) is True
    # A plan that named no node counts as a node of its own.
    assert pays_off(directory, ["a", None], lambda: replicated[:2])[0] is True
    assert wanted_across_nodes(own, [None] * 4) is False


@pytest.mark.slow
def test_node_local_reads_each_byte_once_from_its_holder(tmp_path: Path) -> None:
    root = tmp_path
    (root / "ckpt").mkdir()
    (root / "nodes").mkdir()
    modes = run_distributed(save_nodelocal, 2, str(root))
    # Node-local: cooperative by default (None), whatever the nodes.
    results = run_distributed(load_nodelocal, 2, str(root), None)
    for r in results:
        assert r["bad"] == [] and r["foreign"] == [], r
    if namespace_refusal() is None:
        assert set(modes) == {"namespace"}
    stored = sum(data_bytes(str(root / "nodes" / f"n{k}" / "ckpt")) for k in range(2))
    # Only a file's holders may read it: each rank reads exactly its node's files (so the load
    # is as balanced as the save placed them), every stored byte once over the group.
    for k, r in enumerate(results):
        assert r["bytes_read"] == data_bytes(str(root / "nodes" / f"n{k}" / "ckpt")), results
    assert sum(r["bytes_read"] for r in results) == stored
    alone = run_distributed(load_nodelocal, 2, str(root), False)
    assert all(r["bad"] == [] for r in alone), alone


@pytest.fixture(scope="module")
def s3env() -> Any:
    pytest.importorskip("obstore")
    pytest.importorskip("boto3")
    srv = SeaweedServer()
    try:
        srv.start()
    except ServerUnavailable as e:
        srv.close()
        pytest.skip(f"no S3-compatible test server: {e}")
    try:
        srv.create_bucket("coop")
        yield srv.env()
    finally:
        srv.close()


@pytest.mark.slow
def test_s3_fetches_each_byte_once(s3env: dict[str, str]) -> None:
    # One node, default: an object store loads cooperatively (every rank's GET is paid).
    url = "s3://coop/replicated"
    run_distributed(save_replicated, 3, url, "zstd", s3env)
    results = run_distributed(load_counted, 3, url, None, None, s3env)
    assert all(r["bad"] == [] for r in results), results
    stored = _object_bytes(s3env, "coop", "replicated/")
    _balanced([r["bytes_fetched"] for r in results], stored)
    assert [r["bytes_read"] for r in results] == [r["bytes_fetched"] for r in results]
    alone = run_distributed(load_counted, 3, url, False, None, s3env)
    assert [r["bytes_fetched"] for r in alone] == [stored] * 3


def _object_bytes(env: dict[str, str], bucket: str, prefix: str) -> int:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"],
        config=Config(s3={"addressing_style": "path"}),
    )
    listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    total = sum(o["Size"] for o in listing.get("Contents", []) if o["Key"].endswith(".pyckpt"))
    # less the metadata shards (format version 4), which are not chunk bytes
    import json

    doc = json.loads(client.get_object(Bucket=bucket, Key=prefix + "pyckpt.json")["Body"].read())
    return total - sum(s[2] for s in doc.get("shards", []))


def test_read_stored_serves_the_same_verified_bytes_from_files_and_memory(tmp_path: Path) -> None:
    """What a reader sends to the others: the stored chunk bytes as saved, from every backend."""
    import torch

    from pyckpt import _C
    from pyckpt.backends import open_backend
    from pyckpt.backends.base import stored_len
    from pyckpt.backends.memory import drop

    g = torch.Generator().manual_seed(2)
    sd = {"w": torch.randn(256, 256, generator=g)}
    places = [str(tmp_path / "c"), "memory://coop-read-stored"]
    try:
        got = []
        for place in places:
            pyckpt.save(sd, place, compression="zstd", chunk_bytes=64 << 10)
            backend = open_backend(place)
            segments = backend.read_index().tensors["w"].pieces[0].segments
            n = sum(stored_len(rec) for seg in segments for rec in seg[3])
            buf = torch.empty(n, dtype=torch.uint8)
            nread, nchunks = backend.read_stored([("w", segments, 0, 0, buf.data_ptr())],
                                                 _C.ThreadPool(2))
            assert (nread, nchunks) == (n, 4)
            got.append(bytes(buf.numpy()))
        on_disk = b"".join((tmp_path / "c" / seg[0].rsplit("/", 1)[-1]).read_bytes()
                           [rec[0]:rec[0] + stored_len(rec)]
                           for seg in open_backend(places[0]).read_index().tensors["w"]
                           .pieces[0].segments for rec in seg[3])
        assert got[0] == on_disk and got[1] == on_disk
    finally:
        drop(places[1])


def load_different_checkpoints(rank: int, world: int, root: str) -> tuple[str, str]:
    """Each rank saves its own checkpoint of the same structure (a rank that resumed from
    another step), then all load cooperatively, each from its own."""
    import torch

    path = os.path.join(root, f"step-{rank}")
    state = {"w": torch.full((4096,), float(rank))}
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    # Saved without collectives across ranks: one rank at a time, each its own checkpoint.
    for r in range(world):
        if r == rank:
            dcp.save(state, storage_writer=pyckpt.Writer(path), no_dist=True)
        dist.barrier()
    into = {"w": torch.zeros(4096)}
    try:
        dcp.load(into, storage_reader=pyckpt.Reader(path, cooperative=True))
    except BaseException as e:
        err = pyckpt.find_error(e, pyckpt.PyckptError)
        return (type(err).__name__, str(err)) if err is not None else (type(e).__name__, str(e))
    return ("loaded", str(into["w"][0].item()))


def test_ranks_loading_different_checkpoints_cooperatively_are_refused(tmp_path: Path) -> None:
    out = run_distributed(load_different_checkpoints, 2, str(tmp_path))
    for kind, text in out:
        assert kind == "PyckptError", out
        assert "read different checkpoints" in text and "step-0" in text and "step-1" in text
