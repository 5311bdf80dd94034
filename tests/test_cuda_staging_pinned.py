"""The process-wide pinned staging memory (pyckpt/_pinned.py), on CPU through the CUDA runtime
test double: ``dcp.async_save`` with a new ``pyckpt.Writer`` per checkpoint, as the Quickstart
writes it, must page-lock memory once per process and never unregister it while a save runs.
"""

from __future__ import annotations

import gc
import threading
import warnings
from typing import Any

import psutil
import pytest
import torch
from _fake_cudart import load_double

import pyckpt
from pyckpt import _C, _knobs, _pinned
from pyckpt.errors import PinnedMemoryWarning

pytestmark = [
    pytest.mark.skipif(not hasattr(_C, "FileWriter"), reason="native file I/O core not built in"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

MiB = 1 << 20


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    yield from load_double(monkeypatch)
    pyckpt.set_pinned_limit(None)


def _model_state(dev, layers: int = 4, width: int = 128, seed: int = 0) -> dict:
    """A nested state dict as ``{"model": model.state_dict(), "optim": ...}`` gives it: bf16
    weights and fp32 momentum buffers "on the device", a step counter on the host."""
    g = torch.Generator().manual_seed(seed)
    model = {
        f"layers.{i}.weight": dev.mark(torch.randn(width, width, generator=g).to(torch.bfloat16))
        for i in range(layers)
    }
    optim = {
        "state": {i: {"momentum_buffer": dev.mark(torch.randn(width, width, generator=g))}
                  for i in range(layers)},
        "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": list(range(layers))}],
    }
    return {"model": model, "optim": optim, "step": torch.tensor(7)}


def _state_bytes(sd: dict) -> int:
    from torch.utils._pytree import tree_flatten

    return sum(t.numel() * t.element_size() for t in tree_flatten(sd)[0]
               if isinstance(t, torch.Tensor))


def _train_step(sd: dict) -> None:
    for t in sd["model"].values():
        t.add_(1)
    for s in sd["optim"]["state"].values():
        s["momentum_buffer"].mul_(0.5)


def _load_equal(path, expect: dict) -> None:
    import torch.distributed.checkpoint as dcp

    out = {
        "model": {k: torch.zeros_like(v) for k, v in expect["model"].items()},
        "optim": {
            "state": {i: {"momentum_buffer": torch.zeros_like(s["momentum_buffer"])}
                      for i, s in expect["optim"]["state"].items()},
        },
        "step": torch.tensor(0),
    }
    # The tensors are what is compared: the optimizer's param_groups (plain values) stay behind.
    with pyckpt.Reader(path, allow_partial=True) as r:
        dcp.load(out, storage_reader=r, no_dist=True)
    for k, v in expect["model"].items():
        assert torch.equal(out["model"][k], v), k
    for i, s in expect["optim"]["state"].items():
        assert torch.equal(out["optim"]["state"][i]["momentum_buffer"], s["momentum_buffer"]), i
    assert out["step"].item() == expect["step"].item()


def _clone(sd: dict) -> dict:
    return {
        "model": {k: v.clone() for k, v in sd["model"].items()},
        "optim": {"state": {i: {"momentum_buffer": s["momentum_buffer"].clone()}
                            for i, s in sd["optim"]["state"].items()}},
        "step": sd["step"].clone(),
    }


# -- a new Writer per save --------------------------------------------------------------------


@pytest.mark.parametrize("how", ["dcp.async_save", "pyckpt.async_save"])
def test_new_writer_per_async_save_page_locks_once_per_process(fake, tmp_path, how) -> None:
    import torch.distributed.checkpoint as dcp

    def async_save(sd: dict, path) -> Any:
        if how == "pyckpt.async_save":
            return pyckpt.async_save(sd, path)
        return dcp.async_save(sd, storage_writer=pyckpt.Writer(path), no_dist=True)

    sd = _model_state(fake.dev)
    for step in range(5):
        expect = _clone(sd)
        fut = async_save(sd, tmp_path / f"step-{step}")
        _train_step(sd)  # training goes on while the save is written
        fut.result()
        gc.collect()  # the Writer is gone now: nothing it used may be freed
        if step == 0:
            registered = fake.counter("register_calls")
            assert registered >= 1
        assert fake.counter("register_calls") == registered, step
        assert fake.counter("unregister_calls") == 0, step
        _load_equal(tmp_path / f"step-{step}", expect)
    stats = pyckpt.pinned_stats()
    assert stats["extents"] == 1 and stats["extents_in_use"] == 0
    assert stats["allocations"] == 1
    assert stats["extent_bytes"] == _pinned._align(_state_bytes(sd), 2 * MiB)
    assert fake.counter("streams_created") <= 1  # one side stream for the process
    assert fake.counter("unpinned_copies") == 0
    # every device byte copied once per save (the step counter is a host tensor)
    assert fake.counter("bytes_d2h") == 5 * (_state_bytes(sd) - sd["step"].element_size())


def test_pyckpt_async_save_staging_failure_fails_the_future_and_writes_nothing(
        fake, tmp_path) -> None:
    sd = _model_state(fake.dev)
    fake.fake_cudart_fail_on(b"cudaMemcpyAsync", 1, 700)
    fut = pyckpt.async_save(sd, tmp_path / "c")  # returns: the failure is the future's
    with pytest.raises(pyckpt.CudaError, match=r"\['model'\]"):
        fut.result(timeout=60)
    assert not (tmp_path / "c" / "pyckpt.json").exists()
    assert pyckpt.pinned_stats()["extents_in_use"] == 0
    expect = _clone(sd)
    pyckpt.async_save(sd, tmp_path / "again").result(timeout=60)  # the next one saves
    _load_equal(tmp_path / "again", expect)


def test_no_unregister_or_free_while_a_background_save_is_in_flight(fake, tmp_path,
                                                                     monkeypatch) -> None:
    import torch.distributed.checkpoint as dcp

    from pyckpt.storage import Writer

    gate = threading.Event()
    entered = threading.Event()
    write_data = Writer.write_data

    def held_write_data(self, *args, **kwargs):  # the background save waits before writing
        entered.set()
        assert gate.wait(60), "the test never let the save go on"
        return write_data(self, *args, **kwargs)

    sd = _model_state(fake.dev)
    dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path / "warm"), no_dist=True).result()
    monkeypatch.setattr(Writer, "write_data", held_write_data)
    expect = _clone(sd)
    fut = dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path / "a"), no_dist=True)
    try:
        assert entered.wait(60)
        # While it is in flight: old writers die, training steps run, and the next checkpoint
        # is staged with yet another Writer (it needs a second extent) and dropped.
        gc.collect()
        _train_step(sd)
        staged = pyckpt.Writer(tmp_path / "b").stage(sd)
        del staged
        gc.collect()
        assert not fut.done()
        assert fake.counter("register_calls") == 2
        assert fake.counter("unregister_calls") == 0
        assert pyckpt.pinned_stats()["extents_in_use"] == 1
        # An explicit release frees only the idle extent; the in-flight save keeps its own.
        assert pyckpt.release_pinned() == pyckpt.pinned_stats()["extent_bytes"]
        assert fake.counter("unregister_calls") == 1
        assert pyckpt.pinned_stats()["extents"] == 1
        calls = fake.counter("calls")
    finally:
        gate.set()
    fut.result()
    gc.collect()
    # The background part of the save (writing, committing, handing the extent back) and the
    # collection of its Writer make no CUDA call at all.
    assert fake.counter("calls") == calls
    assert fake.counter("unregister_calls") == 1  # nothing freed when the save ended
    _load_equal(tmp_path / "a", expect)


def test_dropping_writers_and_staged_copies_frees_nothing(fake, tmp_path) -> None:
    sd = _model_state(fake.dev)
    for i in range(4):
        w = pyckpt.Writer(tmp_path / f"c{i}")
        staged = w.stage(sd)
        assert torch.equal(staged["model"]["layers.0.weight"], sd["model"]["layers.0.weight"])
        del w, staged  # never written, never closed: the extent returns when the views die
        gc.collect()
    assert fake.counter("register_calls") == 1
    assert fake.counter("unregister_calls") == 0
    assert pyckpt.pinned_stats()["extents_in_use"] == 0


def test_a_larger_state_adds_an_extent_for_the_difference_only(fake) -> None:
    from pyckpt._staging import DeviceStaging

    small = {"a": fake.dev.mark(torch.ones(2 * MiB, dtype=torch.uint8))}
    st = DeviceStaging()
    s1 = st.stage_state_dict(small)
    st.release_regions([s1["a"].data_ptr()])
    grown = {"a": small["a"], "b": fake.dev.mark(torch.full((3 * MiB,), 7, dtype=torch.uint8))}
    s2 = st.stage_state_dict(grown)
    assert torch.equal(s2["a"], grown["a"]) and torch.equal(s2["b"], grown["b"])
    stats = pyckpt.pinned_stats()
    assert stats["extents"] == 2 and stats["extent_bytes"] == 2 * MiB + 4 * MiB
    assert fake.counter("register_calls") == 2 and fake.counter("unregister_calls") == 0
    st.release_regions([s2["a"].data_ptr()])
    s3 = st.stage_state_dict(grown)  # now fits in what is there
    assert torch.equal(s3["b"], grown["b"])
    assert fake.counter("register_calls") == 2


# -- the bound and its warning ------------------------------------------------------------------


def test_state_over_the_bound_warns_and_stages_the_rest_in_pageable_memory(fake, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    pyckpt.set_pinned_limit(4 * MiB)
    sd = {f"w{i}": fake.dev.mark(torch.randn(MiB // 2)) for i in range(3)}  # 3 x 2 MiB
    expect = {k: v.clone() for k, v in sd.items()}
    with pytest.warns(PinnedMemoryWarning) as rec:
        fut = dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path / "c"), no_dist=True)
    msg = str(rec[0].message)
    assert "6.0 MiB" in msg and "bound (4.0 MiB" in msg and "2.0 MiB of it is copied" in msg
    assert "PYCKPT_PINNED_LIMIT" in msg and "reserve_pinned" in msg
    for v in sd.values():
        v.add_(1)  # the overflow part is a copy too: training may change the originals
    fut.result()
    stats = pyckpt.pinned_stats()
    assert stats["allocated_bytes"] <= 4 * MiB
    assert stats["overflow_bytes"] == 2 * MiB
    assert fake.counter("registered_bytes") <= 4 * MiB
    out = {k: torch.zeros_like(v) for k, v in expect.items()}
    with pyckpt.Reader(tmp_path / "c") as r:
        dcp.load(out, storage_reader=r, no_dist=True)
    for k, v in expect.items():
        assert torch.equal(out[k], v), k


def test_second_save_in_flight_over_the_bound_still_saves_exactly(fake, tmp_path) -> None:
    from pyckpt._staging import DeviceStaging

    pyckpt.set_pinned_limit(2 * MiB)
    sd = {"w": fake.dev.mark(torch.randn(MiB // 4))}  # 1 MiB: one fits, two do not
    st = DeviceStaging()
    first = st.stage_state_dict(sd)
    with pytest.warns(PinnedMemoryWarning, match="1.0 MiB of it is copied into pageable"):
        second = st.stage_state_dict(sd)
    assert torch.equal(first["w"], sd["w"]) and torch.equal(second["w"], sd["w"])
    assert second["w"].data_ptr() != first["w"].data_ptr()
    assert fake.counter("register_calls") == 1


def test_no_warning_within_the_bound(fake, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    pyckpt.set_pinned_limit(64 * MiB)
    sd = _model_state(fake.dev)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PinnedMemoryWarning)
        for i in range(3):
            dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path / f"{i}"),
                           no_dist=True).result()


def test_pinned_limit_knob_and_argument() -> None:
    host = _knobs.host_memory_bytes()
    with _knobs.override(pinned_limit=None, local_world_size=None):
        assert _knobs.pinned_limit() == int(host * 0.4)
    with _knobs.override(pinned_limit=None, local_world_size=8):
        assert _knobs.pinned_limit() == int(host * 0.4) // 8
    with _knobs.override(pinned_limit="0.25"):
        assert _knobs.pinned_limit() == int(host * 0.25)
    with _knobs.override(pinned_limit=str(64 * MiB)):
        assert _knobs.pinned_limit() == 64 * MiB
        mem = _pinned.PinnedMemory()
        assert mem.limit() == 64 * MiB
        mem.set_limit(8 * MiB)  # the argument wins over the environment
        assert mem.limit() == 8 * MiB
        mem.set_limit(0.5)
        assert mem.limit() == int(host * 0.5)
        mem.set_limit(None)
        assert mem.limit() == 64 * MiB
    for bad in ("lots", "0", "1.5", "-3", "1000"):
        with _knobs.override(pinned_limit=bad):
            with pytest.raises(ValueError, match="PYCKPT_PINNED_LIMIT"):
                _knobs.pinned_limit()
    for bad_arg in (True, 0.0, 2.0, 100, "x"):
        with pytest.raises(ValueError, match="pinned limit"):
            pyckpt.set_pinned_limit(bad_arg)  # type: ignore[arg-type]


# -- reserve_pinned -------------------------------------------------------------------------------


def test_reserve_pinned_makes_the_first_save_allocate_nothing(fake, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    sd = _model_state(fake.dev)
    reserved = pyckpt.reserve_pinned(sd)
    assert reserved >= _state_bytes(sd)
    assert fake.counter("register_calls") == 1
    assert fake.counter("bytes_d2h") == 0  # sizes only: no device byte was read
    assert pyckpt.reserve_pinned(sd) == 0  # already there
    expect = _clone(sd)
    dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path / "c"), no_dist=True).result()
    assert fake.counter("register_calls") == 1
    assert pyckpt.pinned_stats()["allocations"] == 1
    _load_equal(tmp_path / "c", expect)


def test_reserve_pinned_copies_bytes_and_limit(fake, tmp_path) -> None:
    from pyckpt._staging import DeviceStaging

    sd = {"w": fake.dev.mark(torch.randn(MiB // 4))}
    assert pyckpt.reserve_pinned(sd, copies=2) == 2 * 2 * MiB  # two 1 MiB states, 2 MiB steps
    st = DeviceStaging()
    a, b = st.stage_state_dict(sd), st.stage_state_dict(sd)  # two saves in flight: no allocation
    assert a["w"].data_ptr() != b["w"].data_ptr()
    assert fake.counter("register_calls") == 2
    assert pyckpt.reserve_pinned(3 * MiB) == 4 * MiB  # both extents are leased: a new one
    del a, b
    gc.collect()
    assert pyckpt.release_pinned() == 8 * MiB
    assert fake.counter("registered_bytes") == 0
    with pytest.warns(PinnedMemoryWarning):
        pyckpt.reserve_pinned(4 * MiB, limit=2 * MiB)
    assert pyckpt.pinned_stats()["limit"] == 2 * MiB
    with pytest.raises(TypeError):
        pyckpt.reserve_pinned(True)
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        pyckpt.reserve_pinned(-1)
    with pytest.raises(ValueError, match="copies"):
        pyckpt.reserve_pinned(sd, copies=0)


# -- host memory over 20 saves --------------------------------------------------------------------


def test_host_memory_does_not_grow_over_20_saves_with_new_writers(fake, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    sd = _model_state(fake.dev, layers=8, width=512)  # 8 x (0.5 + 1) MiB = 12 MiB
    nbytes = _state_bytes(sd)
    proc = psutil.Process()
    rss, pinned = [], []
    for step in range(20):
        dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path / f"s{step % 2}"),
                       no_dist=True).result()
        gc.collect()
        rss.append(proc.memory_info().rss)
        pinned.append(pyckpt.pinned_stats()["allocated_bytes"])
    assert len(set(pinned)) == 1 and pinned[0] >= nbytes  # the process's own accounting
    assert fake.counter("register_calls") == 1 and fake.counter("unregister_calls") == 0
    # A staged copy leaked per save would add 12 MiB each time (over 200 MiB in 17 saves);
    # allocator arenas move RSS by a few tens of MiB.
    assert max(rss[3:]) - rss[2] < 64 * MiB, [r >> 20 for r in rss]


def test_cpu_only_saves_reuse_host_extents_across_writers(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    _pinned._forget_for_tests()
    try:
        with _knobs.override(cuda_mode="off"):
            sd = {"w": torch.randn(256, 256), "n": torch.arange(10)}
            for i in range(5):
                dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path / f"{i}"),
                               no_dist=True).result()
            stats = pyckpt.pinned_stats()
            assert stats["extents"] == 1 and stats["pinned_extent_bytes"] == 0
            assert stats["allocations"] == 1
            out = {"w": torch.zeros(256, 256), "n": torch.zeros(10, dtype=torch.int64)}
            with pyckpt.Reader(tmp_path / "4") as r:
                dcp.load(out, storage_reader=r, no_dist=True)
            assert torch.equal(out["w"], sd["w"]) and torch.equal(out["n"], sd["n"])
    finally:
        _pinned._forget_for_tests()
