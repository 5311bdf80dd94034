"""Fixtures of the backend conformance suite: one place per backend kind."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _backend_places import BUCKET, KINDS, Place
from _s3server import SeaweedServer, started


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedServer]:
    """One SeaweedFS server for the suite (skipped cleanly without ``weed`` or obstore)."""
    srv = started(BUCKET)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(params=KINDS)
def place(request: pytest.FixtureRequest, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[Place]:
    kind = request.param
    if kind == "posix":
        yield Place(kind, str(tmp_path / "ckpt"))
    elif kind == "peer":  # one rank: the node-local layout and its commit path
        yield Place(kind, str(tmp_path / "ckpt"), {"shared_filesystem": False})
    elif kind == "memory":
        from pyckpt.backends import memory

        url = f"memory://conformance-{uuid.uuid4().hex[:8]}"
        yield Place(kind, url)
        memory.drop(url)
    else:
        server = request.getfixturevalue("s3_server")
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        yield Place(kind, f"s3://{BUCKET}/c-{uuid.uuid4().hex[:8]}", server=server)
