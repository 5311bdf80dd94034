"""Object-store retries: one budget (count and time) with backoff; a store restarting
mid-save or mid-load is waited for, not failed on.

The server tests run a real SeaweedFS (tests/_s3server.py), stopped and started again while a
save uploads its parts or before a load's first request, so the client meets refused
connections for as long as the restart takes (the stop, a pause, then the server's own
start-up, ten seconds or more here).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import torch

import pyckpt
from pyckpt.backends.s3 import retry as _retry
from pyckpt.backends.s3 import upload as _upload

BUCKET = "pyckpt-retries"
PAUSE_S = 3.0  # the server is down this long before its start-up (which takes ~10 s more)


# ----------------------------------------------------------------------------- the loop


def _generic(message: str) -> Exception:
    ox = pytest.importorskip("obstore.exceptions")
    return ox.GenericError(message)  # type: ignore[no-any-return]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_refused_connections_are_retried_with_backoff_until_success() -> None:
    clock = _Clock()
    errors = [_generic("Error performing HEAD ... HttpError { kind: Connect, ... }")] * 4

    def op() -> str:
        clock.now += 2.0  # the client's own retries of one attempt
        if errors:
            raise errors.pop()
        return "ok"

    p = _retry.policy({})
    assert _retry.call(op, p, "HEAD x", clock.sleep, lambda: clock.now) == "ok"
    assert clock.sleeps == [1.0, 2.0, 4.0, 8.0]  # doubling from 1 s


def test_budget_in_time_and_in_count() -> None:
    def failing(clock: _Clock) -> Any:
        def op() -> None:
            clock.now += 2.0
            raise _generic("Error performing GET: error sending request, kind: Connect")
        return op

    clock = _Clock()
    with pytest.raises(Exception, match="error sending request"):
        _retry.call(failing(clock), _retry.policy({"retry_timeout": 30}), "GET x", clock.sleep,
                    lambda: clock.now)
    assert clock.now <= 30 + 2.0  # no attempt starts after the budget
    assert clock.sleeps == [1.0, 2.0, 4.0, 8.0]  # the next (15 s) would pass 30 s

    clock = _Clock()
    with pytest.raises(Exception, match="error sending request"):
        _retry.call(failing(clock), _retry.policy({"max_retries": 2}), "GET x", clock.sleep,
                    lambda: clock.now)
    assert clock.sleeps == [1.0, 2.0]


def test_only_transient_failures_are_retried() -> None:
    ox = pytest.importorskip("obstore.exceptions")
    for exc in (ox.NotFoundError("Object at location x not found"),
                ox.PermissionDeniedError("403 Forbidden"),
                ox.PreconditionError("Request precondition failure"),
                _generic("Error performing PUT: Client error with status 400 Bad Request")):
        calls: list[int] = []

        def op(e: Exception = exc, calls: list[int] = calls) -> None:
            calls.append(1)
            raise e

        with pytest.raises(type(exc)):
            _retry.call(op, _retry.policy({}), "op", lambda s: None)
        assert calls == [1], exc
    for text in ("HttpError { kind: Timeout }", "Server returned non-2xx status code: "
                 "503 Service Unavailable", "status: 500", "<Code>SlowDown</Code>",
                 "connection reset by peer"):
        assert _retry.is_transient(_generic(text)), text


def test_client_config_spans_the_budget() -> None:
    cfg = _retry.client_config(_retry.policy({"max_retries": 7, "retry_timeout": 60}))
    assert cfg["max_retries"] == 7 and cfg["retry_timeout"].total_seconds() == 60
    # A first backoff of 1 s: the client's 7 retries of one request span at least 7 s.
    assert cfg["backoff"]["init_backoff"].total_seconds() == 1.0
    with pytest.raises(ValueError, match="retry_timeout"):
        _retry.policy({"retry_timeout": 0})
    # The default: the client's waits are each >= 1 s, so its retries of one upload part (which
    # only the client retries) span at least 30 s: a restart of 10 s plus start-up is waited for.
    default = _retry.client_config(_retry.policy({}))
    min_span = default["max_retries"] * default["backoff"]["init_backoff"].total_seconds()
    assert min_span >= 30 and default["retry_timeout"].total_seconds() == 180


# ----------------------------------------------------------------------------- a real store


@pytest.fixture(scope="module")
def server() -> Any:
    from _s3server import started

    srv = started(BUCKET)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def s3(server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return server


def _restart_in_background(srv: Any) -> threading.Thread:
    """Kills the server now; starts it again after :data:`PAUSE_S` in a thread."""
    srv.kill()

    def start() -> None:
        time.sleep(PAUSE_S)
        srv.start()

    t = threading.Thread(target=start, daemon=True)
    t.start()
    return t


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4096, 1024, generator=g), "b": torch.randn(333, generator=g)}


@pytest.mark.slow
def test_save_survives_a_server_restart_mid_upload(s3: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{BUCKET}/r-{uuid.uuid4().hex[:8]}"
    restarts: list[threading.Thread] = []

    def after_part(_url: str, part: int) -> None:
        if part == 1 and not restarts:
            restarts.append(_restart_in_background(s3))

    monkeypatch.setattr(_upload, "_after_part", after_part)
    sd = _state(1)
    t0 = time.monotonic()
    try:
        # 16 MiB: 4 parts, 3 sent into the restart. The parts are retried by the client only,
        # with the default budget: its retries of one part span at least 30 s.
        pyckpt.save(sd, url, part_bytes=5 << 20)
    finally:
        monkeypatch.setattr(_upload, "_after_part", None)
        for t in restarts:
            t.join(120)
    assert restarts, "the upload never reached its first part"
    assert time.monotonic() - t0 >= PAUSE_S  # it did wait for the store
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    pyckpt.load(out, url)
    assert all(torch.equal(out[k], sd[k]) for k in sd)


@pytest.mark.slow
def test_load_survives_a_server_restart(s3: Any) -> None:
    url = f"s3://{BUCKET}/r-{uuid.uuid4().hex[:8]}"
    sd = _state(2)
    pyckpt.save(sd, url)
    restart = _restart_in_background(s3)  # the load's first requests are refused
    try:
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        pyckpt.load(out, url)
    finally:
        restart.join(120)
    assert all(torch.equal(out[k], sd[k]) for k in sd)


# ----------------------------------------------------------------------------- stalls


@pytest.fixture
def proxy(s3: Any) -> Any:
    from _stallproxy import StallProxy

    with StallProxy(s3.s3_port) as p:
        yield p


@pytest.mark.slow
def test_a_stalled_connection_is_abandoned_after_stall_timeout_and_retried(
        s3: Any, proxy: Any) -> None:
    url = f"s3://{BUCKET}/stall-{uuid.uuid4().hex[:8]}"
    sd = _state(3)
    pyckpt.save(sd, url)
    proxy.stall_next(1)  # the load's first connection: the request arrives, no answer comes back
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    t0 = time.monotonic()
    pyckpt.load(out, url, storage_options={"endpoint": f"http://127.0.0.1:{proxy.port}",
                                           "stall_timeout": "2s"})
    assert proxy.stalled == 1 and proxy.forwarded >= 1
    assert time.monotonic() - t0 >= 2.0  # it waited for the stalled answer, then gave up on it
    assert all(torch.equal(out[k], sd[k]) for k in sd)


@pytest.mark.slow
def test_a_store_that_stays_stalled_fails_typed_naming_the_url(s3: Any, proxy: Any) -> None:
    url = f"s3://{BUCKET}/stall-{uuid.uuid4().hex[:8]}"
    pyckpt.save(_state(4), url)
    proxy.stall_next(1000)
    out = {k: torch.zeros_like(v) for k, v in _state(4).items()}
    t0 = time.monotonic()
    with pytest.raises(pyckpt.ObjectStoreError, match=url):
        pyckpt.load(out, url, storage_options={"endpoint": f"http://127.0.0.1:{proxy.port}",
                                               "stall_timeout": "1s", "max_retries": 1,
                                               "retry_timeout": 2})
    # The configured stall timeout, not the default 30 s nor the group's 30 min, bounds it:
    # two attempts (one retry) of 1 s each, plus one re-issue by pyckpt of the same.
    assert time.monotonic() - t0 < 25
    assert proxy.stalled >= 2


# ----------------------------------------------------------------------------- after the commit


@pytest.mark.slow
def test_clean_up_after_the_commit_does_not_wait_for_a_store_that_went_down(
    s3: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A save whose store goes down right after its metadata PUT is committed: removing the
    earlier save's objects gives up within seconds (it once retried for minutes), logs what it
    left, and the next save removes them."""
    from pyckpt.backends.s3 import S3Backend

    url = f"s3://{BUCKET}/c-{uuid.uuid4().hex[:8]}"
    prefix = url.split("/", 3)[3]
    small = {"w": torch.arange(1000, dtype=torch.float32)}
    pyckpt.save(small, url)
    first = set(s3.keys(BUCKET, prefix + "/"))
    real = S3Backend.put_metadata
    killed: list[bool] = []

    def put_metadata(self: Any, encoded: bytes, state: Any) -> None:
        real(self, encoded, state)
        if not killed:
            killed.append(True)
            s3.kill()  # committed; the store is gone before the clean-up starts

    monkeypatch.setattr(S3Backend, "put_metadata", put_metadata)
    sd = {"w": torch.arange(1000, dtype=torch.float32) * 2}
    t0 = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="pyckpt"):
            pyckpt.save(sd, url)
        elapsed = time.monotonic() - t0
    finally:
        monkeypatch.setattr(S3Backend, "put_metadata", real)
        s3.start()
    assert killed
    assert elapsed < 30, elapsed  # the clean-up's requests give up after 5 s (was ~130 s)
    assert any("committed" in r.getMessage() and "left for the next save" in r.getMessage()
               and prefix in r.getMessage() for r in caplog.records), caplog.text
    out = {"w": torch.zeros(1000)}
    pyckpt.load(out, url)
    assert torch.equal(out["w"], sd["w"])  # the committed save is the one restored
    assert first & set(s3.keys(BUCKET, prefix + "/")) - {f"{prefix}/pyckpt.json"}  # left
    pyckpt.save(sd, url)  # the next save removes them
    assert not first & set(s3.keys(BUCKET, prefix + "/")) - {f"{prefix}/pyckpt.json"}
