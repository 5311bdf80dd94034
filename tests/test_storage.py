"""dcp.save / dcp.load through pyckpt.Writer / pyckpt.Reader: round trips, format, errors."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from dist_utils import run_distributed

import pyckpt
from pyckpt import _format

CHUNK = 16 << 10  # small chunks so modest tensors span many of them


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (bit-exact comparison, NaNs included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b))


def all_dtype_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(257, 33, generator=g)
    out: dict[str, torch.Tensor] = {}
    for name in ("float64", "float32", "float16", "bfloat16"):
        out[name] = f.to(getattr(torch, name))
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        out[name] = f.clamp(-50, 50).to(getattr(torch, name))
    out["float8_e8m0fnu"] = f.abs().add(0.1).to(torch.float8_e8m0fnu)
    ints = torch.randint(-(2**62), 2**62, (129, 7), generator=g, dtype=torch.int64)
    out["int64"] = ints
    out["int32"] = ints.to(torch.int32)
    out["int16"] = ints.to(torch.int16)
    out["int8"] = ints.to(torch.int8)
    out["uint8"] = ints.to(torch.uint8)
    out["uint16"] = ints.view(torch.uint16)
    out["uint32"] = ints.view(torch.uint32)
    out["uint64"] = ints.view(torch.uint64)
    out["bool"] = ints > 0
    out["float4_e2m1fn_x2"] = ints.to(torch.uint8).view(torch.float4_e2m1fn_x2)  # DCP stores it
    out["complex64"] = torch.complex(f, f.flip(0))
    out["complex128"] = out["complex64"].to(torch.complex128)
    out["complex32"] = out["complex64"].to(torch.complex32)
    out["nan_inf"] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1.0])
    return out


def shape_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(64, 1024, generator=g)
    elems = CHUNK // 4
    return {
        "scalar": torch.tensor(3.25),
        "scalar_int": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "empty3d": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "transposed": torch.randn(48, 31, generator=g).t(),
        "strided": big[:, ::3],
        "view_of_larger": big[10:12],  # a view whose storage is far larger than the view
        "chunk_minus_1": torch.randn(elems - 1, generator=g),
        "chunk_exact": torch.randn(elems, generator=g),
        "chunk_plus_1": torch.randn(elems + 1, generator=g),
        "page_minus_1": torch.randint(0, 255, (4095,), generator=g, dtype=torch.uint8),
        "page_plus_1": torch.randint(0, 255, (4097,), generator=g, dtype=torch.uint8),
        "many_chunks_bf16": torch.randn(37 * CHUNK // 2 + 3, generator=g).to(torch.bfloat16),
    }


def roundtrip(sd: dict, path: Path, **writer_kw) -> dict:
    dcp.save(sd, storage_writer=pyckpt.Writer(path, chunk_bytes=CHUNK, **writer_kw))
    out = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()
    }
    out = {k: v for k, v in out.items() if v is not None}
    dcp.load(out, storage_reader=pyckpt.Reader(path))
    return out


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_roundtrip_every_dtype(tmp_path: Path, compression: str | None) -> None:
    sd = all_dtype_tensors()
    out = roundtrip(sd, tmp_path / "ckpt", compression=compression)
    for k, v in sd.items():
        assert_bitwise_equal(out[k], v)


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_roundtrip_shapes_and_views(tmp_path: Path, compression: str | None, threads: int) -> None:
    sd = shape_cases()
    out = roundtrip(sd, tmp_path / "ckpt", compression=compression, threads=threads)
    for k, v in sd.items():
        assert_bitwise_equal(out[k], v)


def test_view_is_stored_without_its_base(tmp_path: Path) -> None:
    base = torch.randn(4096, 1024)
    dcp.save({"v": base[7:9]}, storage_writer=pyckpt.Writer(tmp_path, compression=None))
    stored = sum(p.stat().st_size for p in tmp_path.glob("*.pyckpt"))
    assert stored < 16 << 10  # 2 rows of 4 KiB, not the 16 MiB base


def test_non_tensor_values_and_optimizer_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
    sd = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {"step": 3, "name": "run-7", "lrs": [0.1, 0.01]},
    }
    dcp.save(sd, storage_writer=pyckpt.Writer(tmp_path, compression="zstd"))

    model2 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2(torch.randn(8, 16)).sum().backward()
    opt2.step()  # materialise state tensors to load into
    target = {"model": model2.state_dict(), "optim": opt2.state_dict(),
              "extra": {"step": 0, "name": "", "lrs": [0.0, 0.0]}}
    dcp.load(target, storage_reader=pyckpt.Reader(tmp_path))
    for k, v in model.state_dict().items():
        assert_bitwise_equal(target["model"][k], v)
    for pid, state in opt.state_dict()["state"].items():
        for k, v in state.items():
            got = target["optim"]["state"][pid][k]
            assert_bitwise_equal(got, v) if isinstance(v, torch.Tensor) else got == v
    assert target["extra"] == {"step": 3, "name": "run-7", "lrs": [0.1, 0.01]}


def test_metadata_is_plain_json_written_last(tmp_path: Path) -> None:
    sd = {"w": torch.randn(100, 100)}
    dcp.save(sd, storage_writer=pyckpt.Writer(tmp_path, compression="zstd"))
    doc = json.loads((tmp_path / _format.METADATA_FILE).read_text())
    assert doc["format"] == "pyckpt" and doc["version"] == _format.FORMAT_VERSION
    item = doc["items"]["w"]
    assert item["dtype"] == "float32" and item["shape"] == [100, 100]
    data_files = sorted(p.name for p in tmp_path.glob("*.pyckpt"))
    assert data_files == sorted(doc["files"])
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def _ungroup_reference(raw: np.ndarray, elem_size: int, transform: str) -> list[bytes]:
    """Independent numpy model of byte grouping: returns each plane's bytes."""
    if transform == "none":
        return [raw.tobytes()]
    words = raw.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[elem_size]).copy()
    if transform == "group_rotl1":
        bits_n = elem_size * 8
        words = (words << 1) | (words >> (bits_n - 1))
    planes = words.view(np.uint8).reshape(-1, elem_size)
    return [planes[:, p].tobytes() for p in range(elem_size)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64])
def test_zstd_planes_decode_with_zstandard(tmp_path: Path, dtype: torch.dtype) -> None:
    t = (torch.randn(3 * CHUNK // 4 + 5) * 0.02).to(dtype) if dtype.is_floating_point else (
        torch.randint(-1000, 1000, (3 * CHUNK // 8 + 5,), dtype=dtype))
    dcp.save({"t": t}, storage_writer=pyckpt.Writer(tmp_path, compression="zstd",
                                                     chunk_bytes=CHUNK))
    index = _format.read_index(tmp_path)
    (piece,) = index.tensors["t"].pieces
    raw_all = bits(t).numpy()
    decompressed_planes = 0
    for path, raw_begin, params, chunks in piece.segments:
        assert params.codec == "zstd"
        elem_size = params.elem_size
        pos = raw_begin
        with open(path, "rb") as f:
            for off, raw_len, _ck, transform_code, planes in chunks:
                transform = ("none", "group", "group_rotl1")[transform_code]
                expect = _ungroup_reference(raw_all[pos:pos + raw_len], elem_size, transform)
                f.seek(off)
                for p, (mode, stored_len) in enumerate(zip(planes[0::2], planes[1::2])):
                    blob = f.read(stored_len)
                    if mode == 1:
                        got = zstandard.ZstdDecompressor().decompress(blob)
                        decompressed_planes += 1
                    else:
                        got = blob
                    assert got == expect[p]
                pos += raw_len
    assert decompressed_planes > 0


def test_bf16_compressed_size(tmp_path: Path) -> None:
    torch.manual_seed(0)
    sd = {f"w{i}": (torch.randn(512, 512) * 0.02).to(torch.bfloat16) for i in range(4)}
    dcp.save(sd, storage_writer=pyckpt.Writer(tmp_path / "raw"))
    dcp.save(sd, storage_writer=pyckpt.Writer(tmp_path / "z", compression="zstd"))
    raw = sum(p.stat().st_size for p in (tmp_path / "raw").glob("*.pyckpt"))
    z = sum(p.stat().st_size for p in (tmp_path / "z").glob("*.pyckpt"))
    assert raw == 4 * 512 * 512 * 2
    assert z <= 0.70 * raw, z / raw


def test_resave_same_directory_replaces_and_cleans(tmp_path: Path) -> None:
    dcp.save({"a": torch.ones(10)}, storage_writer=pyckpt.Writer(tmp_path))
    first = {p.name for p in tmp_path.glob("*.pyckpt")}
    dcp.save({"a": torch.full((10,), 2.0)}, storage_writer=pyckpt.Writer(tmp_path))
    second = {p.name for p in tmp_path.glob("*.pyckpt")}
    assert first.isdisjoint(second) and len(second) == 1
    out = {"a": torch.zeros(10)}
    dcp.load(out, storage_reader=pyckpt.Reader(tmp_path))
    assert torch.equal(out["a"], torch.full((10,), 2.0))


def test_a_plan_dcp_cached_is_refused_not_written_with_an_earlier_save_id(
    tmp_path: Path,
) -> None:
    """DCP's plan cache hands a later save the earlier save's final plan, whose save id would
    name this save's data files: an overwrite would replace the live files in place. The save
    is refused before a byte is written; the earlier checkpoint stays whole."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner

    def clear() -> None:
        for name in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan",
                     "_cached_metadata", "_cached_final_save_plan"):
            getattr(SavePlanner, name, {}).clear()

    clear()
    try:
        dcp.save({"a": torch.ones(10)}, storage_writer=pyckpt.Writer(tmp_path),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        before = {p.name: p.read_bytes() for p in tmp_path.glob("[!.]*")}
        with pytest.raises(CheckpointException, match="final plan of an earlier save"):
            dcp.save({"a": torch.full((10,), 2.0)}, storage_writer=pyckpt.Writer(tmp_path),
                     planner=DefaultSavePlanner(enable_plan_caching=True))
    finally:
        clear()
    assert {p.name: p.read_bytes() for p in tmp_path.glob("[!.]*")} == before
    out = {"a": torch.zeros(10)}
    dcp.load(out, storage_reader=pyckpt.Reader(tmp_path))
    assert torch.equal(out["a"], torch.ones(10))
    # the directory is free again: a save without DCP's cache goes through
    dcp.save({"a": torch.full((10,), 3.0)}, storage_writer=pyckpt.Writer(tmp_path))
    dcp.load(out, storage_reader=pyckpt.Reader(tmp_path))
    assert torch.equal(out["a"], torch.full((10,), 3.0))


def test_writer_is_picklable_and_reusable(tmp_path: Path) -> None:
    w = pyckpt.Writer(tmp_path / "a", compression="zstd", threads=2)
    dcp.save({"x": torch.arange(10.0)}, storage_writer=w)
    w2 = pickle.loads(pickle.dumps(w))
    assert w2.compression == "zstd" and w2.threads == 2
    dcp.save({"x": torch.arange(5.0)}, storage_writer=w2, checkpoint_id=tmp_path / "b")
    w.close()
    w2.close()
    out = {"x": torch.zeros(5)}
    dcp.load(out, storage_reader=pyckpt.Reader(tmp_path / "b"))
    assert torch.equal(out["x"], torch.arange(5.0))


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="compression"):
        pyckpt.Writer("x", compression="lz4")
    with pytest.raises(ValueError, match="direct_io"):
        pyckpt.Writer("x", direct_io="maybe")
    with pytest.raises(ValueError, match="chunk_bytes"):
        pyckpt.Writer("x", chunk_bytes=1000)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_unsupported_dtype_names_tensor(tmp_path: Path) -> None:
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.quint8)
    err = _raises(pyckpt.UnsupportedDtypeError,
                  lambda: dcp.save({"good": torch.ones(2), "qt": q},
                                   storage_writer=pyckpt.Writer(tmp_path)))
    assert "qt" in str(err) and "quint8" in str(err)
    assert not (tmp_path / _format.METADATA_FILE).exists()


# --------------------------------------------------------------------------- errors on load


def _saved(tmp_path: Path, compression: str | None = "zstd") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    sd = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    dcp.save(sd, storage_writer=pyckpt.Writer(tmp_path, compression=compression,
                                               chunk_bytes=CHUNK))
    return sd


def _load(tmp_path: Path) -> dict[str, torch.Tensor]:
    out = {"w": torch.zeros(256, 256), "b": torch.zeros(256)}
    dcp.load(out, storage_reader=pyckpt.Reader(tmp_path))
    return out


def _root_cause(exc: BaseException) -> BaseException:
    """DCP wraps rank failures in CheckpointException; return the original exception."""
    failures = getattr(exc, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return exc


def _raises(excinfo_type, fn):  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as e:
        cause = _root_cause(e)
        assert isinstance(cause, excinfo_type), repr(e)
        return cause
    raise AssertionError(f"{excinfo_type.__name__} not raised")


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_flipped_byte_is_detected(tmp_path: Path, compression: str | None) -> None:
    _saved(tmp_path, compression)
    index = _format.read_index(tmp_path)
    path, _, _, chunks = index.tensors["w"].pieces[0].segments[0]
    off = chunks[3][0] + 5
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x10]))
    err = _raises(pyckpt.ChecksumError, lambda: _load(tmp_path))
    assert isinstance(err, pyckpt.CheckpointFormatError)
    assert "'w'" in str(err) and os.path.basename(path) in str(err)


def test_truncated_data_file(tmp_path: Path) -> None:
    _saved(tmp_path)
    (data,) = tmp_path.glob("*.pyckpt")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 100)
    err = _raises(pyckpt.CheckpointFormatError, lambda: _load(tmp_path))
    assert "truncated" in str(err) and data.name in str(err)


def test_missing_data_file(tmp_path: Path) -> None:
    _saved(tmp_path)
    (data,) = tmp_path.glob("*.pyckpt")
    data.unlink()
    err = _raises(FileNotFoundError, lambda: _load(tmp_path))
    assert err.filename == str(data)


def test_missing_metadata(tmp_path: Path) -> None:
    _saved(tmp_path)
    (tmp_path / _format.METADATA_FILE).unlink()
    err = _raises(FileNotFoundError, lambda: _load(tmp_path))
    assert err.filename == str(tmp_path / _format.METADATA_FILE)
    assert not pyckpt.Reader.validate_checkpoint_id(tmp_path)


def test_unknown_version_is_refused(tmp_path: Path) -> None:
    _saved(tmp_path)
    _format.rewrite_metadata(tmp_path, lambda d: d.__setitem__("version", 99))
    err = _raises(pyckpt.CheckpointFormatError, lambda: _load(tmp_path))
    assert "version 99" in str(err)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["files"].update({"../evil.pyckpt": 1}),
        lambda d: d["items"]["w"]["pieces"][0]["segments"][0]["chunks"][0].__setitem__(0, 1 << 40),
        lambda d: d["items"]["w"]["pieces"][0]["segments"][0].__setitem__("raw_begin", 8),
        lambda d: d["items"]["w"].__setitem__("dtype", "object"),
        lambda d: d["items"]["w"]["pieces"][0].__setitem__("offsets", [300, 0]),
    ],
    ids=["path_escape", "offset_past_eof", "gap", "bad_dtype", "outside_shape"],
)
def test_hostile_metadata_is_refused(tmp_path: Path, mutate) -> None:  # type: ignore[no-untyped-def]
    _saved(tmp_path)
    meta = tmp_path / _format.METADATA_FILE
    _format.rewrite_metadata(tmp_path, mutate)  # checksum re-computed: the schema must refuse it
    err = _raises(pyckpt.PyckptError, lambda: _load(tmp_path))
    assert str(meta) in str(err)
    assert "checksum" not in str(err)


def test_unwritable_directory(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        target = Path("/sys")  # root bypasses mode bits; sysfs refuses new files even to root
    else:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(0o555)
    err = _raises(PermissionError,
                  lambda: dcp.save({"a": torch.ones(4)}, storage_writer=pyckpt.Writer(target)))
    assert str(err.filename).startswith(str(target))


_FSIZE_SCRIPT = textwrap.dedent(
    """
    import resource, signal, sys, torch
    import torch.distributed.checkpoint as dcp
    import pyckpt
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    sd = {"w": torch.randn(1 << 20)}  # 4 MiB > the 1 MiB file size limit
    try:
        dcp.save(sd, storage_writer=pyckpt.Writer(sys.argv[1], direct_io=sys.argv[2]))
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        print("ERROR", type(e).__name__, e, getattr(e, "failures", ""))
        sys.exit(3)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_write_failing_midway_keeps_previous_checkpoint(tmp_path: Path, direct_io: str) -> None:
    previous = _saved(tmp_path / "same")  # a complete checkpoint in the target dir
    _saved(tmp_path / "other")
    for target in (tmp_path / "same", tmp_path / "fresh"):
        proc = subprocess.run(
            [sys.executable, "-c", _FSIZE_SCRIPT, str(target), direct_io],
            capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "File too large" in proc.stdout, proc.stdout
        assert not [p for p in target.iterdir() if ".tmp-" in p.name] if target.exists() else True
    # A fresh directory does not load as a checkpoint ...
    assert not pyckpt.Reader.validate_checkpoint_id(tmp_path / "fresh")
    # ... and the previous checkpoints, in the same directory and in another, are intact.
    for d in ("same", "other"):
        out = _load(tmp_path / d)
        for k, v in previous.items():
            assert torch.equal(out[k], v)


@pytest.mark.slow
def test_crash_before_metadata_leaves_no_checkpoint(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os, sys, torch
        import torch.distributed.checkpoint as dcp
        import pyckpt
        w = pyckpt.Writer(sys.argv[1])
        def die(*a, **k):
            os.kill(os.getpid(), 9)
        w.finish = die
        dcp.save({"w": torch.randn(1000)}, storage_writer=w)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert list(tmp_path.glob("*.pyckpt"))  # data was written ...
    assert not pyckpt.Reader.validate_checkpoint_id(tmp_path)  # ... but it is no checkpoint
    with pytest.raises(FileNotFoundError):
        _format.read_index(tmp_path)


# ------------------------------------------------------------------ multi-rank and resharding

ROWS, COLS = 96, 40


def _full(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(42)
    return torch.randn(ROWS, COLS, generator=g).to(dtype)


def _save_dtensor_worker(rank: int, world: int, path: str, dim: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {
        "w": distribute_tensor(_full(), mesh, [Shard(dim)]),
        "h": distribute_tensor(_full(torch.bfloat16), mesh, [Shard(dim)]),
        "step": 11,
    }
    dcp.save(sd, storage_writer=pyckpt.Writer(path, compression="zstd", chunk_bytes=4096))


def _load_dtensor_worker(rank: int, world: int, path: str, dim: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {
        "w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(dim)]),
        "h": distribute_tensor(torch.zeros(ROWS, COLS, dtype=torch.bfloat16), mesh, [Shard(dim)]),
        "step": 0,
    }
    dcp.load(sd, storage_reader=pyckpt.Reader(path))
    assert sd["step"] == 11
    for k, dtype in (("w", torch.float32), ("h", torch.bfloat16)):
        expect = distribute_tensor(_full(dtype), mesh, [Shard(dim)]).to_local()
        assert torch.equal(sd[k].to_local(), expect), k


@pytest.mark.slow
@pytest.mark.distributed
def test_reshard_shard0_on_2_to_shard1_on_3(tmp_path: Path) -> None:
    run_distributed(_save_dtensor_worker, 2, str(tmp_path), 0)
    run_distributed(_load_dtensor_worker, 3, str(tmp_path), 1)


@pytest.mark.distributed
def test_4_ranks_to_one_process(tmp_path: Path) -> None:
    run_distributed(_save_dtensor_worker, 4, str(tmp_path), 1)
    assert len(list(tmp_path.glob("*.pyckpt"))) == 4
    out = {"w": torch.zeros(ROWS, COLS), "h": torch.zeros(ROWS, COLS, dtype=torch.bfloat16),
           "step": 0}
    dcp.load(out, storage_reader=pyckpt.Reader(tmp_path))
    assert torch.equal(out["w"], _full()) and torch.equal(out["h"], _full(torch.bfloat16))
    assert out["step"] == 11


def _partial_load_worker(rank: int, world: int, path: str) -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {"big": distribute_tensor(torch.zeros(1024, 256), mesh, [Shard(0)])}
    reader = pyckpt.Reader(path)
    dcp.load(sd, storage_reader=reader)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(1024, 256, generator=g)
    assert torch.equal(sd["big"].to_local(), full.chunk(world)[rank])
    return reader.bytes_read, reader.chunks_decoded


@pytest.mark.slow
@pytest.mark.distributed
def test_resharded_load_reads_only_overlapping_chunks(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    dcp.save({"big": torch.randn(1024, 256, generator=g)},
             storage_writer=pyckpt.Writer(tmp_path, chunk_bytes=64 << 10))
    stored = sum(p.stat().st_size for p in tmp_path.glob("*.pyckpt"))  # 1 MiB, 16 chunks
    results = run_distributed(_partial_load_worker, 4, str(tmp_path))
    for nread, ndecoded in results:
        assert ndecoded == 4
        assert nread == stored // 4


# ------------------------------------------------------------ pyckpt.save / pyckpt.load errors


def test_pyckpt_load_raises_typed_errors(tmp_path: Path) -> None:
    sd = _saved(tmp_path)
    out = {"w": torch.zeros(256, 256), "b": torch.zeros(256)}
    pyckpt.load(out, tmp_path)
    assert torch.equal(out["w"], sd["w"])
    index = _format.read_index(tmp_path)
    path, _, _, chunks = index.tensors["b"].pieces[0].segments[0]
    with open(path, "r+b") as f:
        f.seek(chunks[0][0])
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(pyckpt.ChecksumError, match="'b'") as info:
        pyckpt.load(out, tmp_path)
    assert type(info.value.__cause__).__name__ == "CheckpointException"
    with pytest.raises(FileNotFoundError):
        pyckpt.load(out, tmp_path / "nowhere")


def test_pyckpt_save_raises_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(pyckpt.UnsupportedDtypeError, match="'sp'"):
        pyckpt.save({"sp": torch.eye(3).to_sparse()}, tmp_path)
    assert not (tmp_path / _format.METADATA_FILE).exists()


def test_raw_threshold_is_a_writer_argument(tmp_path) -> None:
    # Bytes of which half are zeros: zstd keeps about half, so the default (0.97) stores the
    # chunks compressed and raw_threshold=0.4 stores them raw. Both load bit-exact.
    g = torch.Generator().manual_seed(11)
    t = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)
    t[::2] = 0
    stored = {}
    for threshold in (None, 0.4):
        path = tmp_path / str(threshold)
        opts = {} if threshold is None else {"raw_threshold": threshold}
        pyckpt.save({"t": t}, path, compression="zstd", chunk_bytes=4096, **opts)
        (piece,) = _format.read_index(path).tensors["t"].pieces
        stored[threshold] = sum(sum(c[4][1::2]) for s in piece.segments for c in s[3])
        out = {"t": torch.zeros_like(t)}
        pyckpt.load(out, path)
        assert torch.equal(out["t"], t)
    assert stored[0.4] == t.numel()
    assert stored[None] < 0.8 * t.numel()


@pytest.mark.parametrize("options", [{"raw_threshold": 0.0}, {"raw_threshold": 1.5},
                                     {"compression": "zstd", "level": 1000}])
def test_bad_codec_options_fail_when_the_writer_is_made(tmp_path, options) -> None:
    with pytest.raises(ValueError, match="raw_threshold|zstd level"):
        pyckpt.Writer(tmp_path, **options)
    assert not any(tmp_path.iterdir())


FOREIGN_URLS = ["gs://bucket/ckpt", "az://container/ckpt", "file:///tmp/ckpt", "S3://bucket/ckpt",
                "hf://org/model"]


@pytest.mark.parametrize("url", FOREIGN_URLS)
def test_urls_of_other_schemes_are_refused_not_written_as_local_paths(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taken as a path, gs://bucket/ckpt is the relative directory gs:/bucket/ckpt: a save would
    land on the local disk while the caller believes it is in a bucket. Every entry point refuses
    it, naming the URL, and leaves nothing behind."""
    from pyckpt import tools
    from pyckpt._consolidate import consolidate

    monkeypatch.chdir(tmp_path)
    src = tmp_path / "src"
    pyckpt.save({"w": torch.arange(8.0)}, src)
    scheme = url.split("://")[0]
    match = f"unsupported URL scheme '{scheme}'"
    sd = {"w": torch.zeros(8)}
    with pytest.raises(ValueError, match=match) as e:
        pyckpt.save(sd, url)
    assert url in str(e.value)
    with pytest.raises(ValueError, match=match):
        pyckpt.load(sd, url)
    with pytest.raises(ValueError, match=match):
        pyckpt.Writer(url)
    with pytest.raises(ValueError, match=match):
        pyckpt.Reader(url)
    with pytest.raises(ValueError, match=match):  # DCP's checkpoint_id goes through reset()
        dcp.save(sd, storage_writer=pyckpt.Writer(tmp_path / "w"), checkpoint_id=url,
                 no_dist=True)
    with pytest.raises(ValueError, match=match):
        dcp.load(sd, storage_reader=pyckpt.Reader(src), checkpoint_id=url, no_dist=True)
    assert not pyckpt.Reader.validate_checkpoint_id(url)
    with pytest.raises(ValueError, match=match):
        consolidate(src, url)
    with pytest.raises(ValueError, match=match):
        consolidate(url, tmp_path / "out")
    with pytest.raises(ValueError, match=match):
        tools.convert(src, url)
    with pytest.raises(ValueError, match=match):
        tools.verify(url)
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no gs:/ (or any other) directory appeared
    assert sd["w"].eq(0).all()


@pytest.mark.parametrize("path", ["a://b", "dir:with:colons/x", "my-ckpt_v2.0", "x:/y"])
def test_local_paths_that_merely_look_odd_stay_paths(
    path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-letter 'scheme' or a colon without '//' is a local path, as it always was."""
    monkeypatch.chdir(tmp_path)
    sd = {"w": torch.arange(8.0)}
    pyckpt.save(sd, path)
    assert (tmp_path / path / _format.METADATA_FILE).is_file()
    out = {"w": torch.zeros(8)}
    pyckpt.load(out, path)
    assert torch.equal(out["w"], sd["w"])
