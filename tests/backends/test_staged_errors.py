"""Issue 24 item 4: consolidating from a store names the object (its URL), not the deleted
temp copy, when a chunk fails its checksum."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from _backend_places import BUCKET
from _s3server import SeaweedServer

import pyckpt
from pyckpt.errors import ChecksumError


def _damage(server: SeaweedServer, key: str) -> None:
    client = server.boto3()
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))


def test_consolidate_from_s3_names_the_damaged_object(
    s3_server: SeaweedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    prefix = f"staged-{uuid.uuid4().hex[:8]}"
    url = f"s3://{BUCKET}/{prefix}"
    pyckpt.save({"w": torch.randn(64, 1024)}, url)
    (key,) = [k for k in s3_server.keys(BUCKET, prefix + "/") if k.endswith(".pyckpt")]
    _damage(s3_server, key)
    with pytest.raises(ChecksumError) as info:
        pyckpt.consolidate(url, str(tmp_path / "out"))
    message = str(info.value)
    assert f"s3://{BUCKET}/{key}" in message, message
    assert "pyckpt-consolidate-" not in message, message


def test_consolidate_from_memory_names_the_damaged_file(tmp_path: Path) -> None:
    from pyckpt.backends import memory, open_backend

    url = f"memory://staged-{uuid.uuid4().hex[:8]}"
    try:
        pyckpt.save({"w": torch.randn(64, 1024)}, url)
        backend = open_backend(url)
        (name,) = backend.list_names()
        data = bytearray(memory._stores[url][name])
        data[len(data) // 2] ^= 0xFF
        memory._stores[url][name] = bytes(data)
        with pytest.raises(ChecksumError) as info:
            pyckpt.consolidate(url, str(tmp_path / "out"))
        assert backend.url_of(name) in str(info.value)
        assert "pyckpt-consolidate-" not in str(info.value)
    finally:
        memory.drop(url)
