"""GPU-to-host staging, exercised on CPU through the CUDA runtime test double.

The double (``pyckpt/_testing/libpyckpt_fake_cudart.so``, see ``_fake_cudart.py``) is loaded
through the same run-time path as a real runtime (``PYCKPT_CUDART``); "device memory" is host
memory, streams are worker threads, so copies really are asynchronous and missing waits show up as
wrong bytes. The process-wide pinned memory itself is tested in test_cuda_staging_pinned.py.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time

import pytest
import torch
from _fake_cudart import FakeDevice, double_path, load_double

import pyckpt
from pyckpt import _C, _knobs, _pinned, _staging

BLOCK = 8192


_double_path = double_path


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    yield from load_double(monkeypatch)


def _staging_obj(blocks: int = 4) -> _staging.DeviceStaging:
    return _staging.DeviceStaging(block_bytes=BLOCK, pool_bytes=blocks * BLOCK)


def _rand(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _collect(st: _staging.DeviceStaging, items, **kw) -> dict[int, bytearray]:
    out: dict[int, bytearray] = {i: bytearray(t.numel() * t.element_size()) for i, (_, t) in
                                 enumerate(items)}
    for batch in st.stream_to_host(items, **kw):
        for p in batch:
            out[p.item][p.offset : p.offset + p.nbytes] = ctypes.string_at(p.address, p.nbytes)
    return out


# -- loading the runtime -------------------------------------------------------------------


def test_double_loads_through_the_runtime_path(fake) -> None:
    rt = _staging.runtime()
    assert rt.available, rt.error
    assert rt.library == _double_path()
    assert rt.device_count == 1
    assert _staging.runtime() is rt  # cached per path


def test_bad_path_is_unavailable_and_staging_raises(fake) -> None:
    bad = "/nonexistent/libcudart.so.12"
    with _knobs.override(cudart_path=bad):
        rt = _staging.runtime()
        assert rt.available is False
        assert bad in rt.error
        st = _staging.DeviceStaging()
        assert st.available is False
        t = fake.dev.mark(torch.ones(4))
        with pytest.raises(pyckpt.CudaError, match="not available"):
            list(st.stream_to_host([("w", t)]))


def test_library_without_entry_points_is_unavailable() -> None:
    rt = _C.CudaRuntime.load("libc.so.6")
    assert rt.available is False
    assert "cudaMemcpyAsync" in rt.error


def test_no_device_is_unavailable(fake) -> None:
    fake.fake_cudart_set_device_count(0)
    rt = _C.CudaRuntime.load(_double_path())
    assert rt.available is False
    assert "no CUDA-capable device" in rt.error
    with pytest.raises(pyckpt.CudaError):
        _C.Stager(rt, _C.PinnedPool(None, BLOCK, 2), 0)


def test_cuda_off_disables_staging(fake) -> None:
    with _knobs.override(cuda_mode="off"):
        assert _staging.runtime() is None
        assert _staging.DeviceStaging().available is False


# -- streaming device -> host ----------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes",
    [[0], [1], [4095, 4096, 4097], [BLOCK - 1, BLOCK, BLOCK + 1], [3 * BLOCK + 5, 7, 0, 300]],
)
def test_stream_round_trip(fake, sizes: list[int]) -> None:
    items = [(f"t{i}", fake.dev.mark(_rand(n, i))) for i, n in enumerate(sizes)]
    got = _collect(_staging_obj(), items)
    for i, (_, t) in enumerate(items):
        assert bytes(got[i]) == t.numpy().tobytes()
    assert fake.counter("unpinned_copies") == 0  # every copy targets a registered block
    assert fake.counter("bytes_d2h") == sum(sizes)


def test_small_items_are_packed_whole_and_large_ones_split(fake) -> None:
    items = [(f"s{i}", fake.dev.mark(_rand(1000, i))) for i in range(10)]
    items.append(("big", fake.dev.mark(_rand(2 * BLOCK + 10, 99))))
    st = _staging_obj()
    pieces = [p for batch in st.stream_to_host(items) for p in batch]
    small = [p for p in pieces if p.item < 10]
    assert len(small) == 10 and all(p.offset == 0 and p.nbytes == 1000 for p in small)
    big = [p for p in pieces if p.item == 10]
    assert [(p.offset, p.nbytes) for p in big] == [(0, BLOCK), (BLOCK, BLOCK), (2 * BLOCK, 10)]
    assert all(p.address % 4096 == 0 for p in big)


def test_non_contiguous_and_dtypes(fake) -> None:
    base = torch.randn(64, 48)
    items = [
        ("nc", fake.dev.mark(base.t())),  # contiguous copy is made "on device"
        ("bf16", fake.dev.mark(torch.randn(1000).to(torch.bfloat16))),
        ("i64", fake.dev.mark(torch.arange(777, dtype=torch.int64))),
    ]
    got = _collect(_staging_obj(), items)
    assert bytes(got[0]) == base.t().contiguous().numpy().tobytes()
    assert bytes(got[1]) == items[1][1].view(torch.int16).numpy().tobytes()
    assert bytes(got[2]) == items[2][1].numpy().tobytes()


def test_pool_is_bounded_pinned_and_reused(fake) -> None:
    st = _staging_obj(blocks=4)
    items = [(f"t{i}", fake.dev.mark(_rand(BLOCK, i))) for i in range(40)]
    for _ in range(3):
        _collect(st, items)
    stats = st.stats()["pool"]
    assert stats["pinned"] is True
    assert stats["allocated"] == 4 and stats["peak_in_use"] <= 4 and stats["in_use"] == 0
    assert fake.counter("register_calls") == 4  # registered once, reused by every save
    assert fake.counter("registered_bytes") >= 4 * BLOCK
    assert fake.counter("streams_created") == 1  # one side stream, created once
    assert fake.counter("stream_syncs") == 0  # never a (device- or stream-) wide sync


def test_owners_share_the_process_pool_and_only_release_pinned_frees_it(fake) -> None:
    before = fake.counter("registered_bytes")
    st = _staging_obj(blocks=2)
    _collect(st, [("a", fake.dev.mark(_rand(3 * BLOCK, 1)))])
    assert fake.counter("registered_bytes") == before + 2 * BLOCK
    st.close()
    del st
    gc.collect()
    assert fake.counter("unregister_calls") == 0  # closing or dropping an owner frees nothing
    st2 = _staging_obj(blocks=2)  # a new owner, same configuration: the same blocks and stream
    _collect(st2, [("b", fake.dev.mark(_rand(3 * BLOCK, 2)))])
    assert fake.counter("register_calls") == 2 and fake.counter("streams_created") == 1
    st2.close()
    assert pyckpt.release_pinned() == 2 * BLOCK
    del st2
    gc.collect()
    assert fake.counter("registered_bytes") == before
    assert fake.counter("unregister_calls") == 2


def test_copies_are_ordered_after_the_callers_stream(fake) -> None:
    handle = ctypes.c_void_p()
    assert fake.cudaStreamCreateWithFlags(ctypes.byref(handle), 1) == 0
    try:
        src = fake.dev.mark(torch.zeros(3 * BLOCK, dtype=torch.uint8))
        # A slow "kernel" on the caller's stream writes the tensor; staging must see its result.
        fake.fake_cudart_enqueue_fill(handle, src.data_ptr(), 0xAB, src.numel(), 300_000)
        fake.dev.stream = handle.value
        got = _collect(_staging_obj(), [("w", src)])
        assert bytes(got[0]) == b"\xab" * src.numel()
        assert fake.counter("stream_waits") == 1
        # Control: ordered after another stream, the copy overtakes the slow kernel (slower
        # here: the staging must not lose a race against it on a loaded machine).
        src2 = fake.dev.mark(torch.zeros(BLOCK, dtype=torch.uint8))
        fake.fake_cudart_enqueue_fill(handle, src2.data_ptr(), 0xCD, src2.numel(), 2_000_000)
        fake.dev.stream = 0
        got = _collect(_staging_obj(), [("w", src2)])
        assert bytes(got[0]) == b"\x00" * BLOCK
    finally:
        fake.cudaStreamSynchronize(handle)
        fake.cudaStreamDestroy(handle)


def test_no_block_is_reused_before_its_consumer_released_it(fake) -> None:
    fake.fake_cudart_set_copy_delay_us(2000)
    st = _staging_obj(blocks=2)
    items = [(f"t{i}", fake.dev.mark(_rand(BLOCK, i))) for i in range(12)]
    seen = 0
    for batch in st.stream_to_host(items, batch_blocks=1):
        time.sleep(0.01)  # slow consumer: the next block's copy is running meanwhile
        for p in batch:
            assert ctypes.string_at(p.address, p.nbytes) == items[p.item][1].numpy().tobytes()
            seen += 1
        assert st.stats()["pool"]["in_use"] <= 2
    assert seen == 12


def test_generator_closed_early_returns_every_block(fake) -> None:
    st = _staging_obj(blocks=4)
    it = st.stream_to_host([(f"t{i}", fake.dev.mark(_rand(BLOCK, i))) for i in range(10)])
    next(it)
    it.close()
    assert st.stats()["pool"]["in_use"] == 0


def test_gil_is_released_while_waiting(fake) -> None:
    fake.fake_cudart_set_copy_delay_us(300_000)
    st = _staging_obj()
    items = [("slow", fake.dev.mark(_rand(100, 1)))]
    ticks = 0
    done = threading.Event()

    def consume() -> None:
        _collect(st, items)
        done.set()

    th = threading.Thread(target=consume)
    th.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    th.join()
    assert ticks > 50  # the main thread kept running during the 300 ms wait


# -- errors ----------------------------------------------------------------------------------


def test_failed_copy_names_the_tensor_and_leaks_nothing(fake) -> None:
    st = _staging_obj(blocks=4)
    items = [(f"layer.{i}.weight", fake.dev.mark(_rand(BLOCK, i))) for i in range(6)]
    fake.fake_cudart_fail_on(b"cudaMemcpyAsync", 2, 700)
    with pytest.raises(pyckpt.CudaError) as info:
        _collect(st, items)
    assert type(info.value) is pyckpt.CudaError
    assert "'layer.2.weight'" in str(info.value)
    assert "illegal memory access" in str(info.value)
    assert st.stats()["pool"]["in_use"] == 0


def test_asynchronous_failure_surfaces_at_wait(fake) -> None:
    st = _staging_obj(blocks=4)
    items = [(f"p{i}", fake.dev.mark(_rand(BLOCK, i))) for i in range(3)]
    fake.fake_cudart_fail_async_copy_after(1, 719)
    with pytest.raises(pyckpt.CudaError, match="unspecified launch failure.*'p"):
        _collect(st, items)
    assert st.stats()["pool"]["in_use"] == 0


def test_a_block_the_driver_may_still_hold_is_never_reused(fake) -> None:
    # Freed host blocks go to the process's host cache; one the driver may still hold
    # registered must never be handed out again (from the cache, or by the kernel as a new
    # mapping at the same address), or the next pinned block would fail to register ("already
    # registered"): it stays mapped and unused. A block size no other code uses: the cache
    # serves pool blocks by exact size, whatever earlier tests in this process left in it.
    size = (4 << 20) + 3 * 4096

    def address(block) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(memoryview(block)))

    rt = _C.CudaRuntime.load(_double_path())
    _C.set_host_cache_limit(64 << 20)
    stuck = None
    try:
        pool = _C.PinnedPool(rt, size, 1)
        with pool.acquire() as block:
            stuck = address(block)
        fake.fake_cudart_fail_on(b"cudaHostUnregister", 0, 1)
        del pool, block  # a released block's object keeps its pool alive
        gc.collect()
        again = _C.PinnedPool(rt, size, 1)
        with again.acquire() as block:  # registers a fresh range, not the stuck one
            fresh = address(block)
        assert fresh != stuck
        # A block whose unregister succeeded is cached, and registers again when reused.
        del again, block
        gc.collect()
        third = _C.PinnedPool(rt, size, 1)
        with third.acquire() as block:
            assert address(block) == fresh
        # A range the driver reports as not registered (it forgot it, after a device reset say)
        # is free to reuse: cached, and handed to the next pool.
        fake.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        assert fake.cudaHostUnregister(ctypes.c_void_p(fresh)) == 0
        del third, block  # its unregister now fails with cudaErrorHostMemoryNotRegistered
        gc.collect()
        fourth = _C.PinnedPool(rt, size, 1)
        with fourth.acquire() as block:
            assert address(block) == fresh  # reused; it registers again
        del fourth, block
        gc.collect()
    finally:
        if stuck is not None:  # the double still counts the stuck range as registered
            fake.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            fake.cudaHostUnregister(ctypes.c_void_p(stuck))
        _C.set_host_cache_limit(_knobs.host_cache_bytes())


def test_registration_failure_raises_cuda_error(fake) -> None:
    fake.fake_cudart_fail_on(b"cudaHostRegister", 0, 2)
    st = _staging_obj()
    with pytest.raises(pyckpt.CudaError, match="cudaHostRegister failed: out of memory"):
        _collect(st, [("w", fake.dev.mark(_rand(10, 0)))])


# -- async staging (AsyncStager.stage) -------------------------------------------------------


def _state_dict(dev: FakeDevice) -> dict:
    return {
        "model": {
            "w": dev.mark(torch.randn(33, 17)),
            "bf16": dev.mark(torch.randn(100).to(torch.bfloat16)),
            "nc": dev.mark(torch.randn(8, 6)).t(),
            "empty": dev.mark(torch.empty(0, 3)),
        },
        "cpu": torch.arange(10),
        "step": 7,
        "extra": [dev.mark(torch.ones(5, dtype=torch.int32)), "tag"],
    }


def test_stage_state_dict_copies_into_one_region(fake) -> None:
    sd = _state_dict(fake.dev)
    st = _staging_obj()
    staged = st.stage_state_dict(sd)
    (region,) = st._regions.values()
    lo, hi = region.address, region.address + region.nbytes
    flat = [staged["model"]["w"], staged["model"]["bf16"], staged["model"]["nc"],
            staged["cpu"], staged["extra"][0]]
    for t in flat:
        assert lo <= t.data_ptr() < hi
    assert torch.equal(staged["model"]["w"], sd["model"]["w"])
    assert torch.equal(staged["model"]["bf16"], sd["model"]["bf16"])
    assert torch.equal(staged["model"]["nc"], sd["model"]["nc"])
    assert staged["model"]["empty"].shape == (0, 3)
    assert staged["step"] == 7 and staged["extra"][1] == "tag"
    # Training-safe: later updates (device or CPU) do not reach the staged copy.
    expect = staged["model"]["w"].clone()
    sd["model"]["w"].add_(1)
    sd["cpu"].add_(1)
    assert torch.equal(staged["model"]["w"], expect)
    assert torch.equal(staged["cpu"], torch.arange(10))


def test_extents_are_reused_and_a_second_save_in_flight_gets_its_own(fake) -> None:
    sd = _state_dict(fake.dev)
    st = _staging_obj()
    a = st.stage_state_dict(sd)
    b = st.stage_state_dict(sd)  # `a` is still being written: `b` needs other memory
    addr_a, addr_b = a["cpu"].data_ptr(), b["cpu"].data_ptr()
    assert addr_a != addr_b
    assert _pinned.pinned_stats()["extents"] == 2 and fake.counter("register_calls") == 2
    assert st.release_regions([addr_a]) == 1
    c = st.stage_state_dict(sd)
    assert c["cpu"].data_ptr() == addr_a  # the released extent, not a new one
    assert torch.equal(c["model"]["w"], sd["model"]["w"])
    del a, b, c
    for _ in range(20):
        s = st.stage_state_dict(sd)
        st.release_regions([s["cpu"].data_ptr()])
    assert _pinned.pinned_stats()["extents"] == 2
    assert fake.counter("register_calls") == 2 and fake.counter("unregister_calls") == 0


def test_stage_failure_releases_the_region(fake) -> None:
    sd = _state_dict(fake.dev)
    st = _staging_obj()
    fake.fake_cudart_fail_on(b"cudaMemcpyAsync", 1, 700)
    with pytest.raises(pyckpt.CudaError, match=r"\['model'\]\['bf16'\]"):
        st.stage_state_dict(sd)
    assert st.stats()["region_pool"]["extents_in_use"] == 0


def test_a_failed_stage_returns_no_extent_a_device_copy_still_writes_into(fake) -> None:
    # The device copy is queued, then a CPU leaf's copy fails: the extent must not go back to
    # the free list before the copy landed, or the next stage (which leases it) gets its bytes
    # overwritten after it returned (a checkpoint of the wrong values).
    st = _staging_obj()
    n = 1 << 18
    fake.fake_cudart_set_copy_delay_us(300_000)
    bad = {"a": fake.dev.mark(torch.full((n,), 1.0)), "z": torch.empty(3, device="meta")}
    with pytest.raises(NotImplementedError):
        st.stage_state_dict(bad)
    fake.fake_cudart_set_copy_delay_us(0)
    sd = {"b": torch.full((n,), 2.0)}
    staged = st.stage_state_dict(sd)
    st.synchronize()  # any copy still queued has landed
    assert torch.equal(staged["b"], sd["b"])


# -- loads: host -> device -------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, BLOCK, 3 * BLOCK + 7])
def test_upload_round_trip(fake, n: int) -> None:
    st = _staging_obj(blocks=2)
    src = _rand(n, 5)
    dst = fake.dev.mark(torch.zeros(n, dtype=torch.uint8))
    st.upload_from_host("w", dst, src)
    st.synchronize()
    assert torch.equal(dst, src)
    assert fake.counter("copies_h2d") == (n + BLOCK - 1) // BLOCK
    assert fake.counter("unpinned_copies") == 0


def test_upload_into_non_contiguous_destination(fake) -> None:
    st = _staging_obj(blocks=2)
    src = torch.randn(40, 30)
    dst = fake.dev.mark(torch.zeros(30, 40)).t()
    st.upload_from_host("w", dst, src)
    st.synchronize()
    assert torch.equal(dst, src)


def test_upload_failure_names_the_tensor(fake) -> None:
    st = _staging_obj(blocks=2)
    fake.fake_cudart_fail_on(b"cudaMemcpyAsync", 0, 700)
    dst = fake.dev.mark(torch.zeros(10))
    with pytest.raises(pyckpt.CudaError, match="loading 'opt.state'"):
        st.upload_from_host("opt.state", dst, torch.ones(10))
    assert st.stats()["pool"]["in_use"] == 0


# -- DCP async_save through the AsyncStager protocol -----------------------------------------


def test_writer_is_an_async_stager(fake, tmp_path) -> None:
    from torch.distributed.checkpoint.staging import AsyncStager

    from pyckpt.storage import Writer

    w = Writer(str(tmp_path))
    assert isinstance(w, AsyncStager)
    assert w.should_synchronize_after_execute is False


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_async_save_then_load(fake, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    sd = {"w": fake.dev.mark(torch.randn(64, 64)), "b": fake.dev.mark(torch.randn(64)),
          "cpu": torch.arange(5)}
    expect = {k: v.clone() for k, v in sd.items()}
    w = pyckpt.Writer(str(tmp_path / "c"))
    try:
        fut = dcp.async_save(sd, storage_writer=w, no_dist=True)
        for v in sd.values():
            v.add_(1)  # training continues while the checkpoint is written
        fut.result()
        st = w._staging()
        assert st.stats()["regions_outstanding"] == 0  # released once written
    finally:
        w.close()
    out = {k: torch.zeros_like(v) for k, v in expect.items()}
    dcp.load(out, storage_reader=pyckpt.Reader(str(tmp_path / "c")), no_dist=True)
    for k, v in expect.items():
        assert torch.equal(out[k], v)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_async_save_failure_saves_nothing(fake, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    sd = {"a": fake.dev.mark(torch.randn(16)), "b": fake.dev.mark(torch.randn(16))}
    w = pyckpt.Writer(str(tmp_path / "c"))
    fake.fake_cudart_fail_on(b"cudaMemcpyAsync", 1, 700)
    try:
        with pytest.raises(pyckpt.CudaError, match=r"\['b'\]"):
            dcp.async_save(sd, storage_writer=w, no_dist=True)
    finally:
        w.close()
    assert not (tmp_path / "c" / "pyckpt.json").exists()


def test_writer_pickles_without_staging_state(fake, tmp_path) -> None:
    import pickle

    w = pyckpt.Writer(str(tmp_path), pinned_pool_bytes=64 << 20)
    w.stage({"a": fake.dev.mark(torch.ones(3))})
    assert w._native.made_staging() is not None
    clone = pickle.loads(pickle.dumps(w))
    assert clone._native.made_staging() is None  # pools and stagers stay with the original
    assert clone.pinned_pool_bytes == 64 << 20
    assert clone._staging().max_blocks == 4  # 16 MiB blocks
    w.close()
    assert w._native.made_staging() is None  # close() frees it; the writer stays usable
    assert w.stage({"b": torch.ones(2)})["b"].tolist() == [1.0, 1.0]
    w.close()


# -- pyckpt.Writer / Reader with device tensors (needs the native file I/O core) ------------

_needs_native_io = pytest.mark.skipif(
    not hasattr(_C, "FileWriter"), reason="native file I/O core (FileWriter) not built in"
)


@_needs_native_io
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_sync_save_streams_device_tensors_and_loads_back(fake, tmp_path, compression) -> None:
    import torch.distributed.checkpoint as dcp

    from pyckpt.storage import Reader, Writer

    sd = {
        "big": fake.dev.mark(torch.randn(3 * 4096 + 5)),  # larger than a 16 KiB block
        "bf16": fake.dev.mark(torch.randn(100, 7).to(torch.bfloat16)),
        "nc": fake.dev.mark(torch.randn(9, 5)).t(),
        "cpu": torch.arange(11),
    }
    with Writer(tmp_path, compression, chunk_bytes=16384, pinned_pool_bytes=1 << 20) as w:
        dcp.save(sd, storage_writer=w, no_dist=True)
        stats = w._staging().stats()["pool"]
        assert stats["pinned"] and stats["in_use"] == 0
        assert stats["max_blocks"] == 2  # the least: 1 MiB holds less than two blocks
    assert fake.counter("bytes_d2h") >= sum(
        v.numel() * v.element_size() for k, v in sd.items() if k != "cpu"
    )
    out = {k: fake.dev.mark(torch.zeros_like(v)) for k, v in sd.items()}
    with Reader(tmp_path) as r:
        dcp.load(out, storage_reader=r, no_dist=True)
    for k, v in sd.items():
        assert torch.equal(out[k], v), k
    assert fake.counter("copies_h2d") > 0


def test_pinned_pool_bytes_is_an_argument_whose_default_is_the_environment(fake, tmp_path) -> None:
    from pyckpt.storage import Reader, Writer

    mib16 = 16 << 20  # the block size for 1 MiB chunks, and the reader's
    with _knobs.override(pinned_pool_bytes=4 * mib16):
        assert Writer(tmp_path, chunk_bytes=1 << 20)._staging().max_blocks == 4
        assert Reader(tmp_path)._staging().max_blocks == 4
        # The argument wins over the environment.
        assert Writer(tmp_path, chunk_bytes=1 << 20, pinned_pool_bytes=6 * mib16)._staging(
        ).max_blocks == 6
        assert Reader(tmp_path, pinned_pool_bytes=3 * mib16)._staging().max_blocks == 3
    for bad in (1000, True, 2.5e9):
        with pytest.raises(ValueError, match="pinned_pool_bytes"):
            Writer(tmp_path, pinned_pool_bytes=bad)
        with pytest.raises(ValueError, match="pinned_pool_bytes"):
            Reader(tmp_path, pinned_pool_bytes=bad)


@_needs_native_io
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_pyckpt_writer_async_save_20_times_reuses_pinned_memory(fake, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import AsyncStager

    from pyckpt.storage import Reader, Writer

    sd = {"w": fake.dev.mark(torch.randn(256, 64)), "b": fake.dev.mark(torch.randn(64))}
    w = Writer(tmp_path / "c")
    assert isinstance(w, AsyncStager)
    try:
        registered = None
        for step in range(20):
            dcp.async_save(sd, storage_writer=w, no_dist=True).result()
            if registered is None:
                registered = fake.counter("registered_bytes")
            assert fake.counter("registered_bytes") == registered, step
            expected = sd["w"].clone()  # what this save holds (before training changes it)
            sd["w"].add_(1)
        assert w._staging().stats()["region_pool"]["extents"] == 1
    finally:
        w.close()
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    with Reader(tmp_path / "c") as r:
        dcp.load(out, storage_reader=r, no_dist=True)
    assert torch.equal(out["w"], expected)


# -- async_save on a host without a usable CUDA runtime ----------------------------------------


def _async_save_and_load_cpu(tmp_path) -> None:
    """dcp.async_save of CPU tensors through pyckpt.Writer, then a bit-exact load."""
    import torch.distributed.checkpoint as dcp

    from pyckpt.storage import Reader, Writer

    g = torch.Generator().manual_seed(3)
    sd = {"w": torch.randn(300, 17, generator=g), "i": torch.arange(10), "step": 7}
    expect = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    with Writer(tmp_path / "c") as w:
        fut = dcp.async_save(sd, storage_writer=w, no_dist=True)
        sd["w"].add_(1)  # training goes on: the staged copy is what gets saved
        fut.result()
        stats = w._staging().stats()
        assert stats["region_pool"] is not None and stats["regions_outstanding"] == 0
    out = {"w": torch.zeros(300, 17), "i": torch.zeros(10, dtype=torch.int64), "step": 0}
    with Reader(tmp_path / "c") as r:
        dcp.load(out, storage_reader=r, no_dist=True)
    assert torch.equal(out["w"], expect["w"]) and torch.equal(out["i"], expect["i"])
    assert out["step"] == 7


@_needs_native_io
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_async_save_with_a_runtime_whose_device_count_fails(fake, tmp_path, monkeypatch) -> None:
    # A runtime library without a usable driver: cudaGetDeviceCount fails (code 35).
    monkeypatch.setattr(_pinned, "_runtimes", {})
    fake.fake_cudart_fail_on(b"cudaGetDeviceCount", 0, 35)
    rt = _staging.runtime()
    assert rt.available is False and "driver version is insufficient" in rt.error
    _async_save_and_load_cpu(tmp_path)
    assert fake.counter("registered_bytes") == 0  # nothing was page-locked


@_needs_native_io
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_async_save_without_any_runtime(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_pinned, "_runtimes", {})
    with _knobs.override(cudart_path="/nonexistent/libcudart.so.12", cuda_mode="auto"):
        assert _staging.runtime().available is False
        _async_save_and_load_cpu(tmp_path)


@_needs_native_io
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_async_save_with_cuda_off(tmp_path, monkeypatch) -> None:
    with _knobs.override(cuda_mode="off"):
        _async_save_and_load_cpu(tmp_path)


_DRIVERLESS_SCRIPT = """
import sys, warnings
import torch, torch.distributed.checkpoint as dcp
import pyckpt
from pyckpt import _staging
warnings.simplefilter("ignore")
rt = _staging.runtime()
if rt.available:
    print("USABLE")
    sys.exit(0)
print("RUNTIME", rt.error)
sd = {"w": torch.randn(1000)}
with pyckpt.Writer(sys.argv[1]) as w:
    dcp.async_save(sd, storage_writer=w, no_dist=True).result()
out = {"w": torch.zeros(1000)}
dcp.load(out, storage_reader=pyckpt.Reader(sys.argv[1]), no_dist=True)
assert torch.equal(out["w"], sd["w"])
print("SAVED")
"""


@pytest.mark.slow
@_needs_native_io
def test_async_save_with_the_systems_runtime(tmp_path) -> None:
    """Whatever CUDA runtime the dynamic linker finds here (on CPU CI hosts: a libcudart without
    a driver, or none at all), an async save of CPU tensors works."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PYCKPT_CUDART", "PYCKPT_CUDA")}
    proc = subprocess.run([sys.executable, "-c", _DRIVERLESS_SCRIPT, str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "USABLE" in proc.stdout:
        pytest.skip("this host has a usable CUDA device; covered by the GPU tests")
    assert "SAVED" in proc.stdout, proc.stdout
