"""Staging on a real GPU (``@pytest.mark.gpu``; skipped without CUDA by conftest.py).

Run on an NVIDIA H100 and, with the tests of the process-wide pinned memory at the end (a new
Writer per save, reserve_pinned, the bound), on an NVIDIA H200 (torch 2.11+cu130, 2026-11-26):
all pass; see BENCHMARKS.md "GPU staging". On a host without a GPU the same rules are checked by
test_cuda_staging_pinned.py through the runtime double. ``scripts/gpu_check.sh`` runs these.
"""

from __future__ import annotations

import gc

import pytest
import torch

import pyckpt
from pyckpt import _staging

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


@pytest.fixture
def staging():
    rt = _staging.runtime()
    assert rt is not None and rt.available, rt.error if rt is not None else "PYCKPT_CUDA=off"
    st = _staging.DeviceStaging(block_bytes=1 << 20, pool_bytes=8 << 20)
    yield st
    st.close()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "bf16": torch.randn(1024, 777, device="cuda", generator=g).to(torch.bfloat16),
        "fp32": torch.randn(3 << 18, device="cuda", generator=g),
        "nc": torch.randn(512, 300, device="cuda", generator=g).t(),
        "i64": torch.arange(12345, device="cuda"),
        "empty": torch.empty(0, 4, device="cuda"),
    }


def test_runtime_is_shared_with_torch() -> None:
    torch.cuda.init()
    rt = _staging.runtime()
    assert rt.available, rt.error
    assert rt.reused_loaded  # RTLD_NOLOAD found torch's libcudart


def test_stream_round_trip(staging) -> None:
    sd = _tensors()
    items = list(sd.items())
    out = {name: bytearray(t.numel() * t.element_size()) for name, t in items}
    import ctypes

    for batch in staging.stream_to_host(items):
        for p in batch:
            out[items[p.item][0]][p.offset : p.offset + p.nbytes] = ctypes.string_at(
                p.address, p.nbytes
            )
    for name, t in items:
        host = t.contiguous().cpu()
        got = torch.frombuffer(out[name], dtype=torch.uint8) if out[name] else torch.empty(0)
        assert got.numpy().tobytes() == host.view(torch.uint8).numpy().tobytes(), name


def test_ordered_after_current_stream_without_device_sync(staging) -> None:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(1 << 24, device="cuda")
        torch.cuda._sleep(50_000_000)  # a long kernel before the write
        x.fill_(3.0)
        staged = staging.stage_state_dict({"x": x})
    assert torch.equal(staged["x"], torch.full((1 << 24,), 3.0))


def test_stage_and_upload_round_trip(staging) -> None:
    sd = _tensors()
    staged = staging.stage_state_dict(sd)
    for k, v in sd.items():
        assert staged[k].device.type == "cpu"
        assert torch.equal(staged[k], v.cpu()), k
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    for k in sd:
        staging.upload_from_host(k, back[k], staged[k])
    torch.cuda.current_stream().synchronize()
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_dtensor_shard_on_one_device(staging, tmp_path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cuda", (1,))
        full = torch.randn(64, 32, device="cuda")
        dt = distribute_tensor(full, mesh, [Shard(0)])
        staged = staging.stage_state_dict({"dt": dt})["dt"]
        assert staged.to_local().device.type == "cpu"
        assert torch.equal(staged.to_local(), full.cpu())
    finally:
        dist.destroy_process_group()


def test_writer_sync_and_async_save_then_load(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    from pyckpt.storage import Reader, Writer

    sd = _tensors()
    with Writer(tmp_path / "sync", "zstd") as w:
        dcp.save(sd, storage_writer=w, no_dist=True)
    w = Writer(tmp_path / "async")
    try:
        dcp.async_save(sd, storage_writer=w, no_dist=True).result()
    finally:
        w.close()
    for d in ("sync", "async"):
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        with Reader(tmp_path / d) as r:
            dcp.load(out, storage_reader=r, no_dist=True)
        for k, v in sd.items():
            assert torch.equal(out[k], v), (d, k)


def test_pyckpt_async_save_holds_the_state_at_the_call_and_loads_into_cuda(tmp_path) -> None:
    sd = _tensors()
    expect = {k: v.clone() for k, v in sd.items()}
    fut = pyckpt.async_save(sd, tmp_path / "c", compression="zstd")
    for v in sd.values():  # the next training step, queued on the current stream
        v.add_(1)
    fut.result(timeout=120)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    pyckpt.load(out, tmp_path / "c")
    for k, v in expect.items():
        assert out[k].is_cuda and torch.equal(out[k], v), k


def test_twenty_async_saves_do_not_grow_rss_or_pinned_memory(fresh_pinned, tmp_path) -> None:
    import psutil
    import torch.distributed.checkpoint as dcp

    from pyckpt.storage import Writer

    sd = {f"layer{i}": torch.randn(1 << 20, device="cuda") for i in range(16)}  # 64 MiB
    w = Writer(tmp_path / "c")
    proc = psutil.Process()
    try:
        rss = []
        for _ in range(20):
            dcp.async_save(sd, storage_writer=w, no_dist=True).result()
            gc.collect()
            rss.append(proc.memory_info().rss)
        stats = w._staging().stats()
        assert stats["region_pool"]["extents"] <= 2
        assert stats["regions_outstanding"] == 0
        # After warm-up (two regions), RSS stays flat: 17 more saves of 64 MiB grow it by less
        # than 4 saves' worth (allocator arenas move it by tens of MiB; a leak of the staged
        # bytes would add 64 MiB a save).
        assert max(rss[3:]) - rss[2] < 256 << 20, rss
    finally:
        w.close()


# -- the process-wide pinned memory (pyckpt/_pinned.py) ------------------------------------------


@pytest.fixture
def fresh_pinned():
    from pyckpt import _pinned

    _pinned._forget_for_tests()
    gc.collect()
    yield _pinned
    _pinned._forget_for_tests()
    _pinned.pinned_memory().set_limit(None)


def _nested_state(layers: int = 4, width: int = 1024) -> dict:
    """``{"model": ..., "optim": ...}`` of bf16 Linear layers trained one SGD step (momentum)."""
    model = torch.nn.Sequential(
        *[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]
    ).to(device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model(torch.randn(8, width, device="cuda", dtype=torch.bfloat16)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _load_and_compare(path, sd: dict) -> None:
    import torch.distributed.checkpoint as dcp

    from pyckpt.storage import Reader

    out = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}
    with Reader(path) as r:
        dcp.load(out, storage_reader=r, no_dist=True)
    for k, v in sd["model"].items():
        assert torch.equal(out["model"][k], v), k


def test_new_writer_per_async_save_page_locks_once(fresh_pinned, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    import pyckpt

    sd = _nested_state()
    for step in range(5):
        expect = {"model": {k: v.clone() for k, v in sd["model"].items()}}
        fut = dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path / f"s{step}"),
                             no_dist=True)
        for v in sd["model"].values():
            v.add_(1)  # training goes on
        fut.result()
        gc.collect()  # the Writer is gone: nothing may be unregistered
        stats = pyckpt.pinned_stats()
        assert stats["allocations"] == 1 and stats["frees"] == 0, (step, stats)
        assert stats["pinned_extent_bytes"] > 0
        _load_and_compare(tmp_path / f"s{step}", expect)


def test_reserve_pinned_then_first_save_allocates_nothing(fresh_pinned, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    import pyckpt

    sd = _nested_state()
    assert pyckpt.reserve_pinned(sd) > 0
    before = pyckpt.pinned_stats()["allocations"]
    dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path / "c"), no_dist=True).result()
    assert pyckpt.pinned_stats()["allocations"] == before
    _load_and_compare(tmp_path / "c", sd)


def test_state_over_the_bound_warns_and_saves_exactly(fresh_pinned, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    import pyckpt
    from pyckpt.errors import PinnedMemoryWarning

    sd = {"model": {f"w{i}": torch.randn(1 << 19, device="cuda") for i in range(3)}}  # 3 x 2 MiB
    pyckpt.set_pinned_limit(4 << 20)
    with pytest.warns(PinnedMemoryWarning, match="2.0 MiB of it is copied"):
        fut = dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path / "c"), no_dist=True)
    expect = {"model": {k: v.clone() for k, v in sd["model"].items()}}
    fut.result()
    assert pyckpt.pinned_stats()["allocated_bytes"] <= 4 << 20
    _load_and_compare(tmp_path / "c", expect)


def test_twenty_saves_with_new_writers_keep_host_memory_flat(fresh_pinned, tmp_path) -> None:
    import psutil
    import torch.distributed.checkpoint as dcp

    import pyckpt

    sd = {f"layer{i}": torch.randn(1 << 20, device="cuda") for i in range(16)}  # 64 MiB
    proc = psutil.Process()
    rss, pinned = [], []
    for step in range(20):
        dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path / f"s{step % 2}"),
                       no_dist=True).result()
        gc.collect()
        rss.append(proc.memory_info().rss)
        pinned.append(pyckpt.pinned_stats()["allocated_bytes"])
    assert len(set(pinned)) == 1
    assert pyckpt.pinned_stats()["frees"] == 0
    assert max(rss[3:]) - rss[2] < 256 << 20, rss
