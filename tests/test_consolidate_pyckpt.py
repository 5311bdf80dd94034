"""pyckpt.consolidate with a pyckpt checkpoint as input (chunks decoded natively on the way).

Oracle: ``safetensors.torch.load_file`` of every output equals the saved tensors bit for bit.
Checkpoints are produced by the real writer (``dcp.save`` with ``pyckpt.Writer``), raw and zstd;
multi-rank cases save DTensors on 2 gloo ranks and consolidate on 2 ranks and on 1 process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _st_workers import load_outputs, progress_seen_during_stitch, same_bits, sample_tensor
from dist_utils import run_distributed

import pyckpt
from pyckpt import _C, ChecksumError, UnsupportedDtypeError
from pyckpt._consolidate import INDEX_NAME
from pyckpt._format import read_index

COMPRESSIONS = [None, "zstd"]

# Every pyckpt dtype that safetensors can hold.
SUPPORTED = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.complex64,
    torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool,
    torch.float4_e2m1fn_x2,  # safetensors' F4, two values per element
]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _save(path, sd, compression, chunk_bytes=4096):
    dcp.save(sd, storage_writer=pyckpt.Writer(path, compression=compression,
                                              chunk_bytes=chunk_bytes, fsync=False))


def _check(index_path, full):
    out = load_outputs(index_path)
    assert sorted(out) == sorted(full)
    for k, v in full.items():
        assert same_bits(out[k], v), k


def _listing(d):
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


# ----------------------------------------------------------------------------- single process


@pytest.mark.parametrize("compression", COMPRESSIONS, ids=["raw", "zstd"])
def test_every_dtype_bit_exact(tmp_path, compression):
    # (37, 29) elements: several 4 KiB chunks for the wide dtypes, a partial last chunk for all.
    full = {f"t.{_name(dt)}": sample_tensor((37, 29), dt, i) for i, dt in enumerate(SUPPORTED)}
    # Smooth values so that zstd actually compresses (grouped planes, zstd frames on the path).
    full["smooth.bf16"] = torch.linspace(-1, 1, 64 * 48).reshape(64, 48).to(torch.bfloat16)
    full["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    full["empty"] = torch.empty((0, 3), dtype=torch.float32)
    full["cube"] = sample_tensor((3, 5, 7), torch.int16, 99)
    src, dst = tmp_path / "src", tmp_path / "dst"
    _save(src, {**full, "step": 11, "note": {"lr": 0.1}}, compression)
    if compression == "zstd":
        chunks = [c for p in read_index(src).tensors["smooth.bf16"].pieces
                  for _, _, _, cs in p.segments for c in cs]
        assert any(mode == 1 for c in chunks for mode in c[4][0::2]), "no zstd plane stored"
    res = pyckpt.consolidate(src, dst, fsync=False, threads=2)
    _check(res.index_path, full)  # non-tensor items ("step", "note") are skipped
    assert res.rank_bytes == res.total_bytes == sum(
        v.numel() * v.element_size() for v in full.values()
    )
    assert [n for n in _listing(dst) if n.startswith(".")] == []


def test_max_file_bytes_and_mmap_input(tmp_path, monkeypatch):
    full = {f"layer{i}.w": sample_tensor((40, 24), torch.float32, i) for i in range(4)}
    src = tmp_path / "src"
    _save(src, full, "zstd")
    res = pyckpt.consolidate(src, tmp_path / "a", fsync=False, max_file_bytes=8000)
    assert len(res.files) == 2
    _check(res.index_path, full)
    monkeypatch.setenv("PYCKPT_CONSOLIDATE_INPUT", "mmap")
    res = pyckpt.consolidate(src, tmp_path / "b", fsync=False, threads=3)
    _check(res.index_path, full)


@pytest.mark.parametrize("compression", COMPRESSIONS, ids=["raw", "zstd"])
def test_corrupted_chunk_raises_checksum_error(tmp_path, compression):
    full = {"a.w": sample_tensor((64, 32), torch.float32, 1),
            "b.w": sample_tensor((64, 32), torch.bfloat16, 2)}
    src, dst = tmp_path / "src", tmp_path / "dst"
    _save(src, full, compression)
    (piece,) = read_index(src).tensors["b.w"].pieces
    path, _, _, chunks = piece.segments[0]
    off = chunks[-1][0]  # the last chunk of "b.w"
    with open(path, "r+b") as fh:
        fh.seek(off)
        byte = fh.read(1)
        fh.seek(off)
        fh.write(bytes([byte[0] ^ 0x5A]))
    with pytest.raises(ChecksumError) as info:
        pyckpt.consolidate(src, dst, fsync=False, threads=2)
    msg = str(info.value)
    assert "'b.w'" in msg and os.path.basename(path) in msg and "checksum mismatch" in msg
    assert _listing(dst) == []  # neither final files nor temps


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex32], ids=["c128", "c32"])
def test_unsupported_dtype_names_the_tensor(tmp_path, dtype):
    sd = {"ok": torch.ones(4), "freq.cis": torch.ones(3, dtype=dtype)}
    src, dst = tmp_path / "src", tmp_path / "dst"
    _save(src, sd, None)
    # Asked for everything (select=None): refused, naming the tensor, nothing written.
    with pytest.raises(UnsupportedDtypeError, match=r"'freq\.cis'.*" + _name(dtype)):
        pyckpt.consolidate(src, dst, fsync=False, select=None)
    assert not os.path.exists(dst)
    # The default selection skips it with a warning naming it, and exports the rest.
    with pytest.warns(UserWarning, match=r"skipping 1 tensor.*'freq\.cis' \(" + _name(dtype)):
        res = pyckpt.consolidate(src, dst, fsync=False)
    assert res.skipped == ["freq.cis"]
    _check(os.path.join(dst, INDEX_NAME), {"ok": sd["ok"]})


def test_cli_pyckpt_input(tmp_path):
    full = {"w": sample_tensor((50, 40), torch.bfloat16, 3), "v": sample_tensor((7,), torch.int64, 4)}
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _save(src, full, "zstd")
    env = dict(os.environ)  # the installed pyckpt (or the caller's PYTHONPATH), never the checkout
    proc = subprocess.run(
        [sys.executable, "-m", "pyckpt", "consolidate", src, dst, "--workers", "1", "--no-fsync",
         "--quiet"],
        env=env, capture_output=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    _check(os.path.join(dst, INDEX_NAME), full)


# ----------------------------------------------------------------------------- native primitive


def _chunk_items(seg_list, shape, offsets, sizes, out_path, lo, hi, shift=0):
    """Stitcher items for chunks of segments, the first raw byte of the piece at ``shift``."""
    items = []
    for path, raw_begin, params, chunks in seg_list:
        pos = raw_begin + shift
        for rec in chunks:
            items.append(("t", shape, offsets, sizes, 1, path, (rec, params), out_path, 0,
                          lo, hi, pos, pos + rec[1]))
            pos += rec[1]
    return items


@pytest.mark.parametrize("input_mode", ["pread", "mmap"])
@pytest.mark.parametrize(
    ("cols", "task_bytes", "tasks"),
    [(16384, 1 << 20, 6), (64, 1 << 20, 1), (64, 256, 3)],
    ids=["pwrite-runs", "window", "mapped-runs"],
)
def test_stitch_encoded_chunks_scatter(tmp_path, input_mode, cols, task_bytes, tasks):
    # Three (4, cols) f32 blocks stored by the writer in 128 KiB zstd chunks, stitched as the
    # column bands of a (4, 3*cols) tensor: every chunk lands in scattered rows. 64 KiB runs are
    # written one pwrite each (a task per chunk); 256-byte runs of a range that fits 4 x
    # task_bytes are assembled in one window (one task, one pwrite); of a larger range, copied
    # into the output mapping (a task per chunk).
    g = torch.Generator().manual_seed(3)
    bands = [(torch.randn(4, cols, generator=g) * 0.02).float() for _ in range(3)]
    _save(tmp_path / "ck", {f"b{i}": b for i, b in enumerate(bands)}, "zstd",
          chunk_bytes=128 << 10)
    tensors = read_index(tmp_path / "ck").tensors
    row = 4 * cols
    shape, n = [4, 3 * row], 4 * 3 * row
    out = tmp_path / "out.bin"
    sentinel = np.full(n, 0xAB, dtype=np.uint8)
    sentinel.tofile(out)
    # The caller's range cuts rows in two: only that part may be written.
    lo, hi = row + 5, n - row - 3
    items = []
    for i in range(3):
        (piece,) = tensors[f"b{i}"].pieces
        items += _chunk_items(piece.segments, shape, [0, i * row], [4, row], str(out), lo, hi)
    stats = _C.stitch(items, 2, task_bytes, input_mode, False)
    expect = sentinel.copy()
    full = torch.cat(bands, dim=1).contiguous().view(torch.uint8).reshape(-1).numpy()
    expect[lo:hi] = full[lo:hi]
    assert np.array_equal(np.fromfile(out, dtype=np.uint8), expect)
    assert stats["bytes"] == hi - lo
    assert stats["tasks"] == tasks
    assert stats["runs"] >= 3 * 4 - 2  # one run per row of each band reached


@pytest.mark.parametrize("task_bytes", [1 << 20, 256], ids=["window", "mapped-runs"])
def test_stitch_scattered_corrupt_chunk_names_file_tensor_and_offset(tmp_path, task_bytes):
    g = torch.Generator().manual_seed(4)
    bands = [(torch.randn(4, 64, generator=g) * 0.02).float() for _ in range(3)]
    _save(tmp_path / "ck", {f"b{i}": b for i, b in enumerate(bands)}, "zstd")
    tensors = read_index(tmp_path / "ck").tensors
    row = 4 * 64
    shape, n = [4, 3 * row], 4 * 3 * row
    out = tmp_path / "out.bin"
    np.zeros(n, dtype=np.uint8).tofile(out)
    items = []
    for i in range(3):
        (piece,) = tensors[f"b{i}"].pieces
        items += _chunk_items(piece.segments, shape, [0, i * row], [4, row], str(out), 0, n)
    path, _, _, chunks = tensors["b1"].pieces[0].segments[0]
    off = chunks[0][0]
    with open(path, "r+b") as fh:
        fh.seek(off + 3)
        byte = fh.read(1)
        fh.seek(off + 3)
        fh.write(bytes([byte[0] ^ 0x5A]))
    with pytest.raises(ChecksumError) as info:
        _C.stitch(items, 2, task_bytes, "pread", False)
    msg = str(info.value)
    assert f"file '{path}', tensor 't', chunk at file offset {off}" in msg, msg
    assert "checksum mismatch" in msg


def test_gil_released_while_decoding(tmp_path):
    # A concurrent Python thread sees the byte counter move while encoded chunks are stitched.
    g = torch.Generator().manual_seed(6)
    bands = [torch.randint(0, 1 << 15, (2048, 4096), dtype=torch.int16, generator=g)
             for _ in range(2)]
    _save(tmp_path / "ck", {"b0": bands[0], "b1": bands[1]}, None, chunk_bytes=64 << 10)
    tensors = read_index(tmp_path / "ck").tensors
    row = 4096 * 2
    shape, n = [2048, 2 * row], 2048 * 2 * row
    out = tmp_path / "out.bin"
    with open(out, "wb") as fh:
        fh.truncate(n)
    items = []
    for i in range(2):
        (piece,) = tensors[f"b{i}"].pieces
        items += _chunk_items(piece.segments, shape, [0, i * row], [2048, row], str(out), 0, n)
    seen = progress_seen_during_stitch(items, 1 << 20, n, enough=2)
    assert len(seen) >= 2, seen
    full = torch.cat(bands, dim=1).contiguous().view(torch.uint8).reshape(-1).numpy()
    assert np.array_equal(np.fromfile(out, dtype=np.uint8), full)


def test_stitch_piece_from_segments_split_mid_element(tmp_path):
    # One piece whose raw bytes come from two segments of different files, split at byte 4099
    # (inside a float32 element); each segment is a real writer-encoded zstd byte stream.
    g = torch.Generator().manual_seed(4)
    block = torch.randn(30, 70, generator=g)  # 8400 bytes
    raw = block.view(torch.uint8).reshape(-1)
    cut = 4099
    _save(tmp_path / "s0", {"x": raw[:cut].clone()}, "zstd")
    _save(tmp_path / "s1", {"x": raw[cut:].clone()}, None)
    seg0 = read_index(tmp_path / "s0").tensors["x"].pieces[0].segments
    seg1 = read_index(tmp_path / "s1").tensors["x"].pieces[0].segments
    shape, offsets, sizes = [30, 70 * 4], [0, 0], [30, 70 * 4]
    out = tmp_path / "out.bin"
    np.zeros(8400, np.uint8).tofile(out)
    items = _chunk_items(seg0, shape, offsets, sizes, str(out), 0, 8400)
    items += _chunk_items(seg1, shape, offsets, sizes, str(out), 0, 8400, shift=cut)
    stats = _C.stitch(items, 2, 4096, "pread", False)
    assert stats["bytes"] == 8400
    assert np.array_equal(np.fromfile(out, np.uint8), raw.numpy())
    # A chunk given the wrong raw range is refused before anything runs.
    bad = list(items[0])
    bad[12] = bad[11] + 1
    with pytest.raises(ValueError, match="decodes to"):
        _C.stitch([tuple(bad)], 1, 4096, "pread", False)
    # Chunks that do not cover the requested range are a format error.
    with pytest.raises(pyckpt.CheckpointFormatError, match="chunks supply"):
        _C.stitch(items[:-1], 1, 4096, "pread", False)


def test_piece_split_into_segments_by_save_planner(tmp_path):
    try:
        planner_cls = pyckpt.SavePlanner
    except (ImportError, AttributeError):
        pytest.skip("pyckpt.SavePlanner (which splits a replicated piece into segments written "
                    "by several ranks) is not in this build; covered at the stitcher level by "
                    "test_stitch_piece_from_segments_split_mid_element")
    run_distributed(_planner_save_worker, 2, str(tmp_path / "src"), planner_cls)
    idx = read_index(tmp_path / "src")
    assert any(len(p.segments) > 1 for t in idx.tensors.values() for p in t.pieces)
    res = pyckpt.consolidate(tmp_path / "src", tmp_path / "dst", fsync=False)
    _check(res.index_path, _replicated_state())


def _replicated_state():
    # Larger than two 1 MiB split steps, so the planner gives each rank a byte range of it.
    return {"emb": sample_tensor((1024, 1024), torch.float32, 8),
            "norm": sample_tensor((51,), torch.bfloat16, 9)}


def _planner_save_worker(rank, world, path, planner_cls):
    dcp.save(_replicated_state(), storage_writer=pyckpt.Writer(path, chunk_bytes=256 << 10),
             planner=planner_cls())


# ----------------------------------------------------------------------------- multi-rank


def _dtensor_state():
    """Full tensors and their placements: dim-0, dim-1 and 3-D shards, uneven over 2 ranks."""
    full = {
        "rows": sample_tensor((13, 6), torch.float32, 1),          # Shard(0), 7 + 6 rows
        "cols": sample_tensor((64, 97), torch.bfloat16, 2),        # Shard(1), 49 + 48 columns
        "wide": (torch.randn(4, 32768, generator=torch.Generator().manual_seed(5)) * 0.02),
        "cube": sample_tensor((3, 4, 7), torch.int16, 3),          # Shard(2)
        "cube1": sample_tensor((5, 3, 9), torch.float8_e4m3fn, 4),  # Shard(1), 2 + 1
        "flags": sample_tensor((9,), torch.bool, 6),               # Shard(0)
        "scale": sample_tensor((), torch.float64, 7),              # Replicate
        "fp4": sample_tensor((6, 11), torch.float4_e2m1fn_x2, 8),  # Shard(1): F4 [6, 22] in all
    }
    dims = {"rows": 0, "cols": 1, "wide": 1, "cube": 2, "cube1": 1, "flags": 0, "scale": None,
            "fp4": 1}
    return full, dims


def _dist_worker(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full, dims = _dtensor_state()
    sd = {k: distribute_tensor(v, mesh, [Replicate() if dims[k] is None else Shard(dims[k])],
                               src_data_rank=None) for k, v in full.items()}
    sd["step"] = 3
    out = {}
    for comp in ("raw", "zstd"):
        src = os.path.join(root, f"src-{comp}")
        # 128 KiB chunks: "wide" pieces (4 x 64 KiB rows) decode into scattered 64 KiB runs.
        dcp.save(sd, storage_writer=pyckpt.Writer(src, compression=None if comp == "raw" else comp,
                                                  chunk_bytes=128 << 10, fsync=False))
        res = pyckpt.consolidate(src, os.path.join(root, f"dst2-{comp}"), fsync=False, threads=2)
        out[comp] = (res.rank_bytes, res.total_bytes)
    return out


@pytest.mark.distributed
def test_dtensor_shards_two_ranks_and_one_process(tmp_path):
    results = run_distributed(_dist_worker, 2, str(tmp_path))
    full, _ = _dtensor_state()
    for comp in ("raw", "zstd"):
        src = tmp_path / f"src-{comp}"
        idx = read_index(src)
        assert len(idx.tensors["cols"].pieces) == 2 and len(idx.tensors["cube"].pieces) == 2
        assert len({os.path.basename(s[0]) for p in idx.tensors["cols"].pieces
                    for s in p.segments}) == 2  # one data file per rank
        per_rank = [r[comp][0] for r in results]
        total = results[0][comp][1]
        assert sum(per_rank) == total and max(per_rank) <= 1.05 * total / 2, per_rank
        _check(str(tmp_path / f"dst2-{comp}" / INDEX_NAME), full)
        res = pyckpt.consolidate(src, tmp_path / f"dst1-{comp}", fsync=False, threads=2)
        assert res.total_bytes == total
        _check(res.index_path, full)


def test_an_export_after_async_save_sees_what_it_commits(tmp_path, monkeypatch):
    """As pyckpt.load does, an export first waits for this process's async save in flight;
    before, an export of a directory being saved again read the checkpoint it replaced."""
    import time

    from safetensors.torch import load_file

    path = tmp_path / "ck"
    pyckpt.save({"w": torch.zeros(64, 8)}, path)
    finish = pyckpt.Writer.finish

    def slow_finish(self, *args, **kwargs):
        time.sleep(1.0)  # the commit comes after the export has started
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(pyckpt.Writer, "finish", slow_finish)
    fut = pyckpt.async_save({"w": torch.ones(64, 8)}, path)
    pyckpt.consolidate(path, tmp_path / "hf")
    fut.result()
    exported = load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    assert torch.equal(exported["w"], torch.ones(64, 8))
