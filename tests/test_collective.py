"""pyckpt's bounded collectives (pyckpt/_collective/) on a real one-rank gloo group."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from _ports import free_port

from pyckpt import _collective
from pyckpt._collective import liveness
from pyckpt.errors import PeerLostError


@pytest.fixture
def group() -> Iterator[_collective.Group]:
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    pg = dist.group.WORLD
    try:
        yield _collective.group_info(None)
    finally:
        # Marked lost (if a test has not): its heartbeat thread stops, and the entry keeps the
        # group object alive, so no later group can reuse its id.
        with liveness._lost_lock:
            liveness._lost.setdefault(id(pg), (pg, "the end of a test", None))
        dist.destroy_process_group()


class _CompletesDuringThePoll:
    """A collective that finishes just after this rank's timed wait gave up: the wait raises
    gloo's timeout, and by the time the caller looks the work is complete and succeeded (what
    a loaded machine produces now and then). Its outcome is the real one of ``work``."""

    def __init__(self, work: Any) -> None:
        self.work = work
        self.timed_waits = 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None:
            self.timed_waits += 1
            self.work.wait()
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc] "
                               "Operation timed out!")
        return bool(self.work.wait())

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def test_a_collective_that_completes_as_the_poll_times_out_is_not_a_lost_peer(
        group: _collective.Group) -> None:
    import torch

    buf = torch.arange(4)
    seen: list[_CompletesDuringThePoll] = []

    def start(options: Any) -> Any:
        seen.append(_CompletesDuringThePoll(dist.all_reduce(buf, async_op=True)))
        return seen[0]

    liveness._run(group, "a test collective", None, start)  # no PeerLostError
    assert seen[0].timed_waits == 1
    assert torch.equal(buf, torch.arange(4))
    # The group is still usable: the next collective goes through.
    assert _collective.all_gather("x", group) == ["x"]


def test_a_collective_that_failed_still_raises_peer_lost(group: _collective.Group) -> None:
    class Failed:
        def wait(self, timeout: timedelta | None = None) -> bool:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

        def is_completed(self) -> bool:
            return True

    with pytest.raises(PeerLostError, match="a test collective"):
        liveness._run(group, "a test collective", None, lambda options: Failed())


def test_heartbeat_does_not_keep_a_destroyed_group_alive() -> None:
    """After ``destroy_process_group`` (and the job's own references gone) the group is freed,
    and its heartbeat thread ends: pyckpt keeps no group alive until the interpreter finalizes,
    where tearing down a gloo group can abort a process whose work is done."""
    import gc
    import threading
    import weakref

    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    pg = dist.group.WORLD
    before = {t for t in threading.enumerate() if t.name == "pyckpt-peer-heartbeat"}
    _collective.all_gather(1, _collective.group_info(None))  # starts the heartbeat
    beats = {t for t in threading.enumerate() if t.name == "pyckpt-peer-heartbeat"} - before
    assert len(beats) == 1 and pg in liveness._beating
    ref = weakref.ref(pg)
    del pg
    dist.destroy_process_group()
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())
    (thread,) = beats
    thread.join(liveness.HEARTBEAT_S + 10)  # it notices at its next beat
    assert not thread.is_alive()


def test_raise_first_prefers_this_ranks_error_then_the_lowest_remote_one() -> None:
    """The one rule every exchange of outcomes ends with (agree, the node-local exchange, the
    metadata discovery): this rank's own failure, else the lowest failing rank's, noted."""
    _collective.raise_first([None, None, None], None, "a step")  # nobody failed: returns

    mine, remote1, remote2 = OSError("mine"), KeyError("one"), ValueError("two")
    with pytest.raises(OSError) as own:
        _collective.raise_first([None, remote1, remote2], mine, "a step")
    assert own.value is mine and not getattr(mine, "__notes__", [])

    with pytest.raises(KeyError) as first:
        _collective.raise_first([None, remote1, remote2], None, "a step")
    assert first.value is remote1
    assert getattr(remote1, "__notes__", []) == ["pyckpt: a step failed on rank 1"]
    assert not getattr(remote2, "__notes__", [])

    # Some ranks' failures by rank (a coordinator's report), in any order: the lowest rank's.
    remote3, remote5 = RuntimeError("three"), OSError("five")
    with pytest.raises(RuntimeError) as lowest:
        _collective.raise_first({5: remote5, 3: remote3}, None, "the commit")
    assert lowest.value is remote3
    assert getattr(remote3, "__notes__", []) == ["pyckpt: the commit failed on rank 3"]
    _collective.raise_first({}, None, "the commit")
