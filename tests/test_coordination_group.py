"""pyckpt.coordination_group: checkpoint coordination on a gloo group derived from the user's.

This machine has no GPU, so the user's "accelerator" group is simulated: a backend registered
for the ``cuda`` device only (a gloo backend underneath), as NCCL is. Object collectives on such
a group move their pickles to CUDA (which fails without CUDA) and CPU tensors find no backend,
so a save or load that touched it for its coordination would fail: succeeding shows that the
coordination ran on the derived group. The GPU test at the end checks the real thing with NCCL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from _child_env import child_env
from dist_utils import run_distributed

pytestmark = pytest.mark.distributed

_FAKE = "fakeaccel"


def _register_fake_accelerator() -> None:
    """Registers ``fakeaccel``: a backend of the ``cuda`` device only, gloo underneath."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroupGloo

    def make(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        return ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend(_FAKE, make, devices=["cuda"])


class _NewGroupSpy:
    """Counts ``dist.new_group`` calls (torch's function stays in place behind it)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.calls: list[dict[str, Any]] = []
        self._orig = dist.new_group

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls.append({"args": args, **kwargs})
            return self._orig(*args, **kwargs)

        dist.new_group = spy

    def close(self) -> None:
        import torch.distributed as dist

        dist.new_group = self._orig


def _object_collective_groups() -> list[Any]:
    """Wraps torch's object collectives (DCP's planning and result exchanges go through them)
    to record the group of each call; returns the (growing) list."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    seen: list[Any] = []
    for name in ("all_gather_object", "gather_object", "broadcast_object_list",
                 "scatter_object_list"):
        orig = getattr(c10d, name)

        def wrapped(*args: Any, __orig: Any = orig, **kwargs: Any) -> Any:
            seen.append(kwargs.get("group"))
            return __orig(*args, **kwargs)

        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    return seen


def _state(rank: int) -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32) * 3, "step": 7}


def _save_twice_and_load(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """(a) the derived group is made once, reused by the next save and by the load."""
    import torch.distributed as dist

    import pyckpt

    _register_fake_accelerator()
    user = dist.new_group(list(range(world)), backend=_FAKE, timeout=timedelta(seconds=123))
    seen = _object_collective_groups()
    spy = _NewGroupSpy()
    try:
        sd = {"w": torch.arange(12, dtype=torch.float32), "step": 7}
        pyckpt.save(sd, os.path.join(tmp, "a"), process_group=user)
        made_by_first = len(spy.calls)
        derived = pyckpt.coordination_group(user)
        pyckpt.save(sd, os.path.join(tmp, "b"), process_group=user)
        made_by_second = len(spy.calls) - made_by_first
        out = {"w": torch.zeros(12), "step": 0}
        pyckpt.load(out, os.path.join(tmp, "b"), process_group=user)
        again = pyckpt.coordination_group(user)
    finally:
        spy.close()
    timeout = derived._get_backend(torch.device("cpu")).options._timeout
    return {
        "made_by_first": made_by_first,
        "backend": spy.calls[0].get("backend") if spy.calls else None,
        "made_by_second": made_by_second,
        "made_in_all": len(spy.calls),
        "same": again is derived,
        "gloo": dist.get_backend(derived),
        "ranks": dist.get_process_group_ranks(derived),
        "timeout_s": timeout.total_seconds(),
        "groups_seen": sorted({"derived" if g is derived else repr(g) for g in seen}),
        "calls": len(seen),
        "loaded": torch.equal(out["w"], sd["w"]) and out["step"] == 7,
    }


def test_derived_group_is_made_once_and_reused(tmp_path: Path) -> None:
    results = run_distributed(_save_twice_and_load, 2, str(tmp_path))
    for r in results:
        # Made by the first save (one new_group, gloo), then only looked up.
        assert r["made_by_first"] == 1 and r["backend"] == "gloo", r
        assert r["made_by_second"] == 0 and r["made_in_all"] == 1 and r["same"], r
        assert r["gloo"] == "gloo" and r["ranks"] == [0, 1], r
        assert r["timeout_s"] == 123.0, r  # the user group's own timeout
        # No torch object collective ran: the saves and the load drive DCP's steps themselves
        # (pyckpt._savedrive, pyckpt._loaddrive), whose exchanges would fail on the fake
        # backend, so a save and a load that succeed ran them on the derived group.
        assert r["groups_seen"] == [] and r["calls"] == 0, r
        assert r["loaded"], r


def _subgroup_save_load(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """(b) a save and a load through a user subgroup of ranks [1, 2] of 3, node-local
    included; (c) rank 0, outside it, gets a clear error; later groups over every rank still
    form although rank 0 made no derived group."""
    import torch.distributed as dist

    import pyckpt
    from pyckpt._collective import bound_s, bounded_group, group_info

    _register_fake_accelerator()
    sub = dist.new_group([1, 2], backend=_FAKE, timeout=timedelta(seconds=900))
    out: dict[str, Any] = {}
    if rank == 0:
        for call in (lambda: pyckpt.coordination_group(sub),
                     lambda: pyckpt.save(_state(0), os.path.join(tmp, "x"), process_group=sub)):
            with pytest.raises(ValueError, match="not a member") as info:
                call()
            out.setdefault("errors", []).append(str(info.value))
    else:
        seen = _object_collective_groups()
        derived = pyckpt.coordination_group(sub)
        group = group_info(derived)
        before = derived._get_backend(torch.device("cpu")).options._timeout
        with bounded_group(derived):  # the peer bound still lowers its timeout
            during = derived._get_backend(torch.device("cpu")).options._timeout
        out["timeouts"] = [before.total_seconds(), during.total_seconds(), bound_s(group)]
        out["rank"] = (group.rank, group.world, dist.get_rank(sub))
        sd = _state(rank)
        pyckpt.save(sd, os.path.join(tmp, "shared"), process_group=sub)
        pyckpt.save(sd, os.path.join(tmp, f"node{rank}"), process_group=sub,
                    shared_filesystem=False)
        back = {"w": torch.zeros(12), "step": 0}
        pyckpt.load(back, os.path.join(tmp, "shared"), process_group=sub)
        node = {"w": torch.zeros(12), "step": 0}
        # Node-local: each rank reads its own directory, the rest over the exchange rounds
        # (pyckpt's own collectives) of the derived group.
        pyckpt.load(node, os.path.join(tmp, f"node{rank}"), process_group=sub,
                    shared_filesystem=False)
        want = [torch.equal(x["w"], sd["w"]) for x in (back, node)]
        out["loaded"] = want == [True, True] and back["step"] == node["step"] == 7
        out["groups_seen"] = sorted({"derived" if g is derived else repr(g) for g in seen})
    # Rank 0 made no derived group: a later group over every rank (the one a manager makes,
    # or a derived one) must still form on all three.
    everyone = dist.new_group([0, 1, 2], backend=_FAKE)
    whole = pyckpt.coordination_group(everyone)
    from pyckpt._collective import peer_group

    manager_like = peer_group([0, 1, 2])
    seen_all = [None] * world
    dist.all_gather_object(seen_all, rank, group=whole)
    dist.all_gather_object(seen_all, rank, group=manager_like)
    out["whole"] = seen_all
    return out


def test_subgroup_save_load_and_non_member(tmp_path: Path) -> None:
    results = run_distributed(_subgroup_save_load, 3, str(tmp_path))
    errors = results[0]["errors"]
    assert len(errors) == 2 and all("global rank 0" in e for e in errors), errors
    for r in results[1:]:
        assert r["loaded"], r
        # pyckpt drives the saves' and the loads' steps itself, over its own exchanges on the
        # derived group (they would fail on the fake backend): no torch object collective
        assert r["groups_seen"] == [], r
        # Group rank as in the user's subgroup; its timeout, lowered to the peer bound.
        assert r["rank"][1] == 2 and r["rank"][0] == r["rank"][2], r
        before, during, bound = r["timeouts"]
        assert before == 900.0 and during == bound == 300.0, r
    assert all(r["whole"] == [0, 1, 2] for r in results)


def _gloo_is_kept(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import pyckpt

    spy = _NewGroupSpy()
    try:
        sub = dist.new_group([0, 1])
        made = len(spy.calls)
        same = (pyckpt.coordination_group() is dist.group.WORLD
                and pyckpt.coordination_group(sub) is sub)
        return {"same": same, "made": len(spy.calls) - made}
    finally:
        spy.close()


def test_a_gloo_group_is_used_as_it_is() -> None:
    for r in run_distributed(_gloo_is_kept, 2):
        assert r == {"same": True, "made": 0}, r


def test_single_process_has_no_group() -> None:
    # A fresh interpreter: no default group (this test process may hold none either).
    code = textwrap.dedent("""
        import pyckpt
        assert pyckpt.coordination_group() is None
        try:
            pyckpt.coordination_group(object())
        except ValueError as e:
            assert "not initialised" in str(e)
        else:
            raise AssertionError("no error")
    """)
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env(), timeout=120)


# -- a real NCCL group (the lent GPU machine) ------------------------------------------------

_GPU_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    import pyckpt
    tmp = sys.argv[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    sd = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 3}
    before = torch.cuda.memory_reserved()
    pyckpt.save(sd, os.path.join(tmp, "a"))
    pyckpt.save(sd, os.path.join(tmp, "b"))
    out = {"w": torch.zeros(1 << 16), "step": 0}
    pyckpt.load(out, os.path.join(tmp, "b"))
    after = torch.cuda.memory_reserved()
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 3
    # The control: DCP's own coordination on the NCCL group allocates GPU buffers.
    dcp.save(sd, storage_writer=pyckpt.Writer(os.path.join(tmp, "c")))
    control = torch.cuda.memory_reserved()
    print(f"reserved before={before} after={after} dcp_on_nccl={control}")
    assert after == before, (before, after)
    assert control > before, (before, control)
    dist.destroy_process_group()
""")


@pytest.mark.gpu
def test_nccl_coordination_allocates_no_gpu_memory(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from _ports import free_port

    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "-c", _GPU_SCRIPT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "reserved before=" in done.stdout
