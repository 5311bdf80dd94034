"""Cooperative loads: replicated state is read from storage once over the ranks, balanced.

Every rank loads the same replicated state; the Reader counts the stored bytes it read from
storage (files or objects, including what it read for others). Asserted on 2-4 gloo ranks:
per-rank max/mean <= 1.05 and total <= 1.05x the stored bytes, on a shared directory, on S3
(SeaweedFS) and node-local; bit-exact values; sharded items mixed in; the same typed error on
every rank when one rank's read fails; ``cooperative=False`` reading everything everywhere.
"""

from __future__ import annotations

import os
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
    save_mixed,
    save_nodelocal,
    save_replicated,
)
from _nodelocal_workers import namespace_refusal
from _s3server import SeaweedServer, ServerUnavailable
from dist_utils import run_distributed

import pyckpt
from pyckpt.backends.coop import assign

pytestmark = pytest.mark.distributed


def _balanced(per_rank: list[int], stored: int) -> None:
    mean = sum(per_rank) / len(per_rank)
    assert max(per_rank) / mean <= 1.05, per_rank
    assert stored <= sum(per_rank) <= 1.05 * stored, (per_rank, stored)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_shared_directory_reads_each_byte_once(tmp_path: Path, compression: str | None) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_replicated, 4, path, compression)
    results = run_distributed(load_counted, 4, path, None)
    assert all(r["bad"] == [] for r in results), results
    _balanced([r["bytes_read"] for r in results], data_bytes(path))


def test_cooperative_false_reads_everything_on_every_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_replicated, 3, path, "zstd")
    results = run_distributed(load_counted, 3, path, False)
    stored = data_bytes(path)
    for r in results:
        assert r["bad"] == [] and r["bytes_read"] == stored, (r, stored)


def test_pyckpt_load_cooperative_and_opted_out_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_replicated, 2, path, "zstd")
    assert run_distributed(load_api, 2, path, None) == [[], []]
    assert run_distributed(load_api, 2, path, False) == [[], []]


def test_env_knob_turns_it_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_replicated, 2, path, None)
    stored = data_bytes(path)
    results = run_distributed(load_counted, 2, path, None, None, {"PYCKPT_COOPERATIVE": "0"})
    assert [r["bytes_read"] for r in results] == [stored, stored]


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


def test_a_failing_read_raises_the_same_typed_error_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_distributed(save_replicated, 3, str(path), None)
    victim = sorted(n for n in os.listdir(path) if n.endswith(".pyckpt"))[1]
    with open(path / victim, "r+b") as f:  # flip a byte in the middle of a chunk
        f.seek(CHUNK_MIDDLE)
        b = f.read(1)
        f.seek(CHUNK_MIDDLE)
        f.write(bytes([b[0] ^ 0xFF]))
    results = run_distributed(load_failing, 3, str(path))
    assert len({r[0] for r in results}) == 1 and results[0][0] == "ChecksumError", results
    assert all(victim in msg for _, msg in results), results


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
    assert pyckpt.Reader("x").cooperative is True
    assert pyckpt.Reader("x", cooperative=False).cooperative is False


def test_node_local_reads_each_byte_once_from_its_holder(tmp_path: Path) -> None:
    root = tmp_path
    (root / "ckpt").mkdir()
    (root / "nodes").mkdir()
    modes = run_distributed(save_nodelocal, 2, str(root))
    results = run_distributed(load_nodelocal, 2, str(root), True)
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


def test_s3_fetches_each_byte_once(s3env: dict[str, str]) -> None:
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
    return sum(o["Size"] for o in listing.get("Contents", []) if o["Key"].endswith(".pyckpt"))


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
