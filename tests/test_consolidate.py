"""pyckpt.consolidate: DCP-HF sharded safetensors -> full Hugging Face safetensors.

Oracle: ``safetensors.torch.load_file`` of every output equals the original full tensors, bit for
bit. Multi-rank cases run CPU gloo groups on 127.0.0.1 in spawned processes.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import struct
import subprocess
import sys

import pytest
import torch
from _ports import free_port
from _st_workers import (
    dcp_state,
    grid_blocks,
    load_outputs,
    progress_seen_during_stitch,
    same_bits,
    sample_tensor,
    worker_consolidate,
    worker_dcp_save,
    worker_failures_free_the_group,
    worker_subgroup,
    write_dcp_shards,
)

import pyckpt
from pyckpt import _C, CheckpointFormatError, PyckptError, UnsupportedDtypeError
from pyckpt._consolidate import INDEX_NAME

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.float8_e5m2,
    torch.float8_e4m3fn,
    torch.float8_e8m0fnu,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.int16,
    torch.uint16,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.uint32,
    torch.float32,
    torch.complex64,
    torch.float64,
    torch.int64,
    torch.uint64,
]


def _final_names(dst: str) -> list[str]:
    if not os.path.isdir(dst):
        return []
    return sorted(n for n in os.listdir(dst) if not n.startswith("."))


def _roundtrip(tmp_path, full, blocks_of, nfiles, **kwargs):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_dcp_shards(src, full, blocks_of, nfiles)
    res = pyckpt.consolidate(src, dst, fsync=False, **kwargs)
    out = load_outputs(res.index_path)
    assert sorted(out) == sorted(full)
    for name, t in full.items():
        assert same_bits(out[name], t), name
    return res, out


# ----------------------------------------------------------------------------- single process


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("dim", [0, 1])
def test_every_dtype_and_shard_dim(tmp_path, dtype, dim):
    shape = (7, 10)
    parts = [1, 1]
    parts[dim] = 3
    full = {"t": sample_tensor(shape, dtype, 1), "other": sample_tensor((5,), dtype, 2)}
    blocks = {"t": grid_blocks(shape, parts, uneven=True), "other": grid_blocks((5,), [2])}
    res, _ = _roundtrip(tmp_path, full, blocks, nfiles=3)
    assert res.rank_bytes == res.total_bytes


def test_float4_packed_dim0(tmp_path):
    # float4_e2m1fn_x2 is stored as F4 (4-bit elements, last dim doubled): dim-0 shards.
    full = {"q": sample_tensor((6, 4), torch.float4_e2m1fn_x2, 3)}
    _roundtrip(tmp_path, full, {"q": grid_blocks((6, 4), [3, 1])}, nfiles=3)


@pytest.mark.parametrize(
    "shape,parts",
    [
        ((4, 5, 6), (2, 1, 1)),
        ((4, 5, 6), (1, 3, 1)),
        ((4, 5, 6), (1, 1, 4)),
        ((4, 5, 6), (2, 2, 2)),
        ((3, 2, 4, 5), (1, 2, 1, 3)),
        ((64, 48), (4, 3)),
    ],
)
def test_any_rank_any_dims_uneven(tmp_path, shape, parts):
    full = {"x": sample_tensor(shape, torch.float32, 5)}
    nblocks = 1
    for p in parts:
        nblocks *= p
    _roundtrip(tmp_path, full, {"x": grid_blocks(shape, parts, uneven=True)}, nfiles=nblocks)


def test_scalar_empty_and_replicated_whole(tmp_path):
    full = {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty((0, 4), dtype=torch.float32),
        "vec": torch.arange(11, dtype=torch.int64),
    }
    blocks = {"scalar": [((), ())], "empty": [((0, 0), (0, 4))], "vec": grid_blocks((11,), [2])}
    _roundtrip(tmp_path, full, blocks, nfiles=2)


def test_output_is_standard_safetensors(tmp_path):
    full = {name: sample_tensor((3, 5), torch.bfloat16, i) for i, name in enumerate("cab")}
    full["z"] = sample_tensor((3,), torch.bool, 9)
    blocks = {k: grid_blocks(tuple(v.shape), [2] + [1] * (v.dim() - 1)) for k, v in full.items()}
    res, _ = _roundtrip(tmp_path, full, blocks, nfiles=2)
    (path,) = res.files
    assert os.path.basename(path) == "model-00001-of-00001.safetensors"
    with open(path, "rb") as fh:
        blob = fh.read()
    n = struct.unpack("<Q", blob[:8])[0]
    assert n % 8 == 0
    header = json.loads(blob[8 : 8 + n])
    assert header["__metadata__"] == {"format": "pt"}
    names = [k for k in header if k != "__metadata__"]
    assert names == sorted(names)
    cursor = 0
    for name in names:
        begin, end = header[name]["data_offsets"]
        assert begin == cursor
        cursor = end
    assert 8 + n + cursor == len(blob)
    with open(res.index_path) as fh:
        index = json.load(fh)
    assert index["metadata"]["total_size"] == cursor == res.total_bytes
    assert index["weight_map"] == {k: os.path.basename(path) for k in full}


def test_max_file_bytes_and_fqn_to_file(tmp_path):
    full = {f"layer{i}.w": sample_tensor((16, 8), torch.float32, i) for i in range(5)}
    blocks = {k: grid_blocks((16, 8), [2, 1]) for k in full}
    res, _ = _roundtrip(tmp_path / "a", full, blocks, nfiles=2, max_file_bytes=1100)
    assert [os.path.basename(f) for f in res.files] == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    mapping = {k: 1 + (i % 2) for i, k in enumerate(sorted(full))}
    res, _ = _roundtrip(tmp_path / "b", full, blocks, nfiles=2, fqn_to_file=mapping)
    with open(res.index_path) as fh:
        wm = json.load(fh)["weight_map"]
    assert wm == {k: f"model-0000{v}-of-00002.safetensors" for k, v in mapping.items()}
    with pytest.raises(ValueError, match="no entry"):
        pyckpt.consolidate(str(tmp_path / "b" / "src"), str(tmp_path / "c"), fqn_to_file={})


def test_progress_and_threads(tmp_path):
    full = {"w": sample_tensor((512, 256), torch.float32, 1)}
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_dcp_shards(src, full, {"w": grid_blocks((512, 256), [1, 4])}, 4)
    seen = []
    res = pyckpt.consolidate(src, dst, threads=4, progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (0, res.total_bytes) and seen[-1] == (res.total_bytes, res.total_bytes)
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == res.total_bytes, seen  # never past the total
    assert same_bits(load_outputs(res.index_path)["w"], full["w"])


def test_gil_released_during_stitch(tmp_path):
    # A concurrent Python thread observes the byte counter move while the native copy runs.
    n = 48 << 20
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(1 << 20) * 48)
    out = tmp_path / "out.bin"
    with open(out, "wb") as fh:
        fh.truncate(n)
    rows, cols = 3072, 4096  # two dim-1 blocks of a (3072, 8192) u16 tensor -> scattered copies
    half = rows * cols * 2
    items = [
        ("w", [rows, 2 * cols], [0, c * cols], [rows, cols], 2, str(src), c * half, str(out), 0,
         0, rows * 2 * cols, 0, 2**64 - 1)
        for c in (0, 1)
    ]
    assert progress_seen_during_stitch(items, 64 << 10, n)


@pytest.mark.parametrize("mode", ["pread", "mmap"])
def test_input_modes(tmp_path, mode):
    from pyckpt import _knobs

    full = {"w": sample_tensor((37, 29), torch.int32, 4)}
    with _knobs.override(consolidate_input=mode):
        _roundtrip(tmp_path, full, {"w": grid_blocks((37, 29), [3, 2], uneven=True)}, nfiles=6)


# ----------------------------------------------------------------------------- bad input


def _good_src(tmp_path, parts=(3, 1)):
    full = {"w": sample_tensor((9, 4), torch.float32, 1), "b": sample_tensor((6,), torch.int8, 2)}
    src = str(tmp_path / "src")
    blocks = {"w": grid_blocks((9, 4), list(parts)), "b": grid_blocks((6,), [3])}
    paths = write_dcp_shards(src, full, blocks, 3)
    return src, paths


def _expect_format_error(src, dst, match):
    with pytest.raises(CheckpointFormatError, match=match):
        pyckpt.consolidate(src, dst, fsync=False)
    assert _final_names(dst) == []
    assert not os.path.isdir(dst) or os.listdir(dst) == []


def test_missing_shard_is_a_coverage_hole(tmp_path):
    src, paths = _good_src(tmp_path)
    os.rename(paths[1], paths[1] + ".lost")
    _expect_format_error(src, str(tmp_path / "dst"), r"tensor '[wb]'.*a shard is missing")


def test_coverage_hole_names_tensor(tmp_path):
    full = {"w": sample_tensor((9, 4), torch.float32, 1)}
    blocks = grid_blocks((9, 4), [3, 1])
    src = str(tmp_path / "src")
    # Keep the first and last rows only: a hole in the middle of 'w'.
    write_dcp_shards(src, full, {"w": [blocks[0], blocks[2]]}, 2)
    _expect_format_error(src, str(tmp_path / "dst"), r"tensor 'w'.*cover 24 of 36 elements")


def test_a_lone_shard_away_from_the_origin_is_a_coverage_hole(tmp_path):
    # One shard per tensor is taken as the whole tensor only when it starts at the origin.
    full = {"w": sample_tensor((9, 4), torch.float32, 1), "v": sample_tensor((5,), torch.int8, 2)}
    src = str(tmp_path / "src")
    write_dcp_shards(src, full, {"w": [grid_blocks((9, 4), [3, 1])[1]], "v": [((0,), (5,))]}, 1)
    _expect_format_error(src, str(tmp_path / "dst"), r"tensor 'w'.*cover 12 of 24 elements")


def test_overlapping_shards(tmp_path):
    full = {"w": sample_tensor((8, 4), torch.float32, 1)}
    src = str(tmp_path / "src")
    write_dcp_shards(src, full, {"w": [((0, 0), (5, 4)), ((4, 0), (4, 4))]}, 2)
    _expect_format_error(src, str(tmp_path / "dst"), r"tensor 'w'.*shard-0000[12].*overlaps")


def test_inconsistent_dtype_and_rank(tmp_path):
    from safetensors.torch import save_file

    for i, (dt, shape, offs) in enumerate(
        [(torch.float32, (2, 4), [0, 0]), (torch.float16, (2, 4), [2, 0])]
    ):
        save_file(
            {"w": torch.zeros(shape, dtype=dt)},
            str(tmp_path / f"s{i}" / "x.safetensors") if False else _mk(tmp_path / "a", i),
            metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": offs}})},
        )
    _expect_format_error(str(tmp_path / "a"), str(tmp_path / "d1"), r"'w' is F32 in .* but F16")
    for i, (shape, offs) in enumerate([((2, 4), [0, 0]), ((2, 4, 1), [2, 0, 0])]):
        save_file(
            {"w": torch.zeros(shape)},
            _mk(tmp_path / "b", i),
            metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": offs}})},
        )
    _expect_format_error(str(tmp_path / "b"), str(tmp_path / "d2"), r"'w' has rank 2 .* rank 3")


@pytest.mark.parametrize(
    "sharding",
    [
        json.dumps({"a": {"saved_offsets": [2**64, 0]}}),
        json.dumps({"a": {"saved_offsets": [2**64 - 1, 0]}}),
        json.dumps({"a": {"saved_offsets": [0, -1]}}),
        json.dumps({"a": {"saved_offsets": [True, 0]}}),
        json.dumps({"a": {"saved_offsets": [0, 1.0]}}),
        json.dumps({"a": {"saved_offsets": "0,0"}}),
        json.dumps({"a": {"saved_offsets": [0, [0]]}}),
        "[" * 100000 + "]" * 100000,
    ],
    ids=["offset-2**64", "offset-2**64-1", "negative", "bool", "float", "string", "nested",
         "deeply-nested"],
)
def test_hostile_sharding_info_is_a_format_error_naming_the_file(tmp_path, sharding):
    from safetensors.torch import save_file

    path = _mk(tmp_path / "src", 0)
    save_file({"a": torch.zeros(2, 4)}, path, metadata={"DCP_SHARDING_INFO": sharding})
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    # Not TypeError from check_tiling() nor RecursionError: a typed error naming the shard.
    _expect_format_error(src, dst, re.escape(path) + ".*DCP_SHARDING_INFO|" + re.escape(path)
                         + ".*saved_offsets")
    proc = subprocess.run(
        [sys.executable, "-m", "pyckpt", "consolidate", src, dst, "--quiet"],
        env=dict(os.environ), capture_output=True, timeout=120,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert os.path.basename(path) in err, err


def _mk(d, i):
    os.makedirs(d, exist_ok=True)
    return str(d / f"shard-{i + 1:05d}-model-00001-of-00001.safetensors")


def _patch_header(path, mutate):
    with open(path, "rb") as fh:
        blob = fh.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header, data = mutate(blob[8 : 8 + n]), blob[8 + n :]
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header + data)


def test_offsets_beyond_file(tmp_path):
    src, paths = _good_src(tmp_path)
    with open(paths[0], "r+b") as fh:
        fh.truncate(os.path.getsize(paths[0]) - 5)
    _expect_format_error(src, str(tmp_path / "dst"), r"shard-00001.*tensor 'w'.*exceed")


def test_absurd_header_length(tmp_path):
    src, paths = _good_src(tmp_path)
    with open(paths[2], "r+b") as fh:
        fh.write(struct.pack("<Q", 1 << 60))
    _expect_format_error(src, str(tmp_path / "dst"), r"shard-00003.*above the 100000000-byte")
    with open(paths[2], "r+b") as fh:
        fh.write(struct.pack("<Q", 5000))
    _expect_format_error(src, str(tmp_path / "dst"), r"shard-00003.*5000-byte header")


def test_overlap_inside_a_file_header(tmp_path):
    src, paths = _good_src(tmp_path)

    def mutate(h):
        obj = json.loads(h)
        obj["b"]["data_offsets"] = [0, 2]
        obj["w"]["data_offsets"] = [0, 48]
        return json.dumps(obj).encode()

    # Sizes no longer sum up either; the overlap is reported first.
    _patch_header(paths[0], mutate)
    _expect_format_error(src, str(tmp_path / "dst"), r"overlaps tensor")


@pytest.mark.parametrize(
    "header,match",
    [
        (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32",'
         b'"shape":[2],"data_offsets":[8,16]}}', "twice"),
        (b'{"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}}', "unknown dtype"),
        (b'{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', "need 12"),
        (b'{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', "non-negative"),
        (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}', "not valid JSON"),
        (b'[1]', "does not start"),
        (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', "belong to no tensor"),
        (b'{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}', "whole number"),
        (b'{"__metadata__":{"k":1}}', "not a string"),
        (b'{"a":{"dtype":"F32","shape":[99999999999,99999999999,99999999999],'
         b'"data_offsets":[0,8]}}', "overflows"),
        (b'{"a":\xff}', "UTF-8"),
        (b'{' * 100 + b'}' * 100, "not valid JSON"),
    ],
)
def test_header_parser_rejects(header, match):
    file_size = 8 + len(header) + 16
    with pytest.raises(CheckpointFormatError, match=match):
        _C.parse_safetensors_header(header, file_size, "bad.safetensors")


def test_header_parser_accepts_every_dtype_and_escapes():
    for dt in ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
               "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
               "C64", "F64", "I64", "U64"]:
        bits = _C.safetensors_dtype_bits(dt)
        header, layout, nbytes = _C.safetensors_header(
            [("na\"me\n\u00e9", dt, [4, 2]), ("a", dt, [])] if bits >= 8 else
            [("na\"me\n\u00e9", dt, [4, 2])],
            {"format": "pt", "k\\": "v\u2603"},
        )
        parsed = _C.parse_safetensors_header(header[8:], len(header) + nbytes)
        assert parsed["metadata"] == {"format": "pt", "k\\": "v\u2603"}
        assert {t[0]: (t[1], t[2]) for t in parsed["tensors"]}["na\"me\n\u00e9"] == (dt, (4, 2))
        assert len(header) % 8 == 0
    with pytest.raises(ValueError, match="unknown safetensors dtype"):
        _C.safetensors_dtype_bits("F7")


def test_sub_byte_split_off_byte_boundary():
    from pyckpt._consolidate.plan import _byte_geometry
    from pyckpt._consolidate.scan import _Block, _Tensor

    t = _Tensor("q", "F4", (2, 6), 4, [_Block("a", 0, (0, 0), (2, 3)), _Block("b", 0, (0, 3), (2, 3))])
    with pytest.raises(UnsupportedDtypeError, match="not a byte boundary"):
        _byte_geometry(t, t.blocks[0])
    t2 = _Tensor("q", "F4", (2, 8), 4, [_Block("a", 0, (0, 0), (2, 4)), _Block("b", 0, (0, 4), (2, 4))])
    assert _byte_geometry(t2, t2.blocks[1]) == ([2, 4], [0, 2], [2, 2], 1)


def test_missing_input_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        pyckpt.consolidate(str(tmp_path / "nope"), str(tmp_path / "dst"))


def test_crash_mid_export_leaves_no_final_file(tmp_path):
    full = {"w": sample_tensor((64, 32), torch.float32, 1)}
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_dcp_shards(src, full, {"w": grid_blocks((64, 32), [2, 1])}, 2)
    code = (
        "import os, pyckpt\n"
        f"pyckpt.consolidate({src!r}, {dst!r}, progress=lambda d, t: os._exit(17))\n"
    )
    env = dict(os.environ)  # the installed pyckpt (or the caller's PYTHONPATH), never the checkout
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 17, proc.stderr.decode()
    leftovers = os.listdir(dst)
    assert leftovers and all(n.startswith(".") and ".tmp-" in n for n in leftovers)
    assert _final_names(dst) == []


def test_error_during_copy_removes_temps(tmp_path, monkeypatch):
    src, paths = _good_src(tmp_path)
    dst = str(tmp_path / "dst")
    mod = importlib.import_module("pyckpt._consolidate.run")

    real = mod._C.stitch

    def failing(*args, **kwargs):
        os.truncate(paths[0], 10)  # the input shrinks after planning
        return real(*args, **kwargs)

    monkeypatch.setattr(mod._C, "stitch", failing)
    with pytest.raises(CheckpointFormatError, match="shard-00001"):
        pyckpt.consolidate(src, dst, fsync=False)
    assert os.listdir(dst) == []


# ----------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_workers(tmp_path):
    full = {"w": sample_tensor((40, 12), torch.bfloat16, 3), "v": sample_tensor((7,), torch.int64, 4)}
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_dcp_shards(src, full, {"w": grid_blocks((40, 12), [1, 3]), "v": grid_blocks((7,), [3])}, 3)
    # the installed pyckpt (or the caller's PYTHONPATH), never the checkout; two workers however
    # small the input
    env = {**os.environ, "PYCKPT_WORKER_BYTES": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "pyckpt", "consolidate", src, dst, "--workers", "2", "--no-fsync"],
        env=env, capture_output=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"wrote 1 file(s)" in proc.stderr and b"starting 2 worker processes" in proc.stderr
    out = load_outputs(os.path.join(dst, INDEX_NAME))
    assert all(same_bits(out[k], v) for k, v in full.items())
    bad = subprocess.run(
        [sys.executable, "-m", "pyckpt", "consolidate", str(tmp_path / "none"), dst, "--quiet"],
        env=env, capture_output=True, timeout=120,
    )
    assert bad.returncode == 1 and b"error:" in bad.stderr


# ----------------------------------------------------------------------------- multi-rank


def _spawn(fn, world, *args):
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def _read_json(path):
    with open(path) as fh:
        return json.load(fh)


def _results(d, world, tag=""):
    out = []
    for r in range(world):
        with open(os.path.join(d, f"{tag}rank{r}.json")) as fh:
            out.append(json.load(fh))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_multi_rank_balanced(tmp_path, world):
    full = {f"l{i}.w": sample_tensor((48, 20 + i), torch.float32, i) for i in range(3)}
    full["l0.bias"] = sample_tensor((48,), torch.bfloat16, 9)
    blocks = {k: grid_blocks(tuple(v.shape), [1] * (v.dim() - 1) + [3], uneven=True)
              for k, v in full.items()}
    src = str(tmp_path / "src")
    write_dcp_shards(src, full, blocks, 3)
    # One output file (split across ranks by byte range) and several files.
    jobs = [
        (f"f{mfb}-", src, str(tmp_path / f"dst{mfb}"), {"fsync": False, "max_file_bytes": mfb,
                                                       "threads": 1})
        for mfb in (None, 3000)
    ]
    _spawn(worker_consolidate, world, jobs, str(tmp_path))
    for tag, _, dst, _ in jobs:
        results = _results(str(tmp_path), world, tag)
        assert all(r["error"] is None for r in results), results
        per_rank = [r["rank_bytes"] for r in results]
        total = results[0]["total"]
        assert sum(per_rank) == total
        assert max(per_rank) <= 1.10 * total / world, per_rank
        out = load_outputs(os.path.join(dst, INDEX_NAME))
        assert all(same_bits(out[k], v) for k, v in full.items())
        assert [n for n in os.listdir(dst) if n.startswith(".")] == []


@pytest.mark.slow
@pytest.mark.distributed
def test_multi_rank_error_reaches_every_rank(tmp_path):
    src, paths = _good_src(tmp_path)
    os.truncate(paths[1], os.path.getsize(paths[1]) - 3)
    dst = str(tmp_path / "dst")
    _spawn(worker_consolidate, 2, [("", src, dst, {"fsync": False})], str(tmp_path))
    results = _results(str(tmp_path), 2)
    assert [r["error"] for r in results] == ["CheckpointFormatError"] * 2
    assert all("shard-00002" in r["message"] for r in results)
    assert not os.path.isdir(dst) or os.listdir(dst) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failed_consolidation_does_not_keep_the_default_group_alive(tmp_path):
    src, paths = _good_src(tmp_path)
    os.truncate(paths[1], os.path.getsize(paths[1]) - 3)
    _spawn(worker_failures_free_the_group, 2, src, str(tmp_path), str(tmp_path))
    for r in _results(str(tmp_path), 2):
        assert r["error"] == "CheckpointFormatError" and r["alive"] is False, r


@pytest.mark.distributed
def test_subgroup_of_world(tmp_path):
    full = {"w": sample_tensor((30, 8), torch.int32, 2)}
    src, dst, res_dir = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path)
    write_dcp_shards(src, full, {"w": grid_blocks((30, 8), [1, 2])}, 2)
    _spawn(worker_subgroup, 3, src, dst, res_dir)
    assert not os.path.exists(os.path.join(res_dir, "rank1.json"))
    r0, r2 = (_read_json(os.path.join(res_dir, f"rank{r}.json")) for r in (0, 2))
    assert r0["rank_bytes"] + r2["rank_bytes"] == r0["total"] and r0["rank_bytes"] > 0
    assert same_bits(load_outputs(os.path.join(dst, INDEX_NAME))["w"], full["w"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("use_async", [False, True])
def test_real_dcp_hf_writer(tmp_path, use_async):
    _spawn(worker_dcp_save, 2, str(tmp_path), use_async)
    full = dcp_state(7)
    out = load_outputs(str(tmp_path / "dst" / INDEX_NAME))
    assert sorted(out) == sorted(full)
    for k, v in full.items():
        assert same_bits(out[k], v), k
    results = _results(str(tmp_path), 2)
    assert sum(r["rank_bytes"] for r in results) == results[0]["total"]


def test_pyckpt_error_type_for_remote_failures():
    assert issubclass(CheckpointFormatError, PyckptError)


def test_symlinked_input_shard_is_refused(tmp_path):
    src, _ = _good_src(tmp_path)
    outside = tmp_path / "outside.safetensors"
    victim = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))[0]
    os.replace(os.path.join(src, victim), outside)
    os.symlink(outside, os.path.join(src, victim))
    dst = tmp_path / "dst"
    with pytest.raises(CheckpointFormatError, match=f"{victim}.*symlinks"):
        pyckpt.consolidate(src, dst, fsync=False)
    assert not dst.exists()


@pytest.mark.parametrize("bad", ["../x.safetensors", "/tmp/x.safetensors", "a/b.safetensors"])
def test_output_names_are_plain(tmp_path, bad):
    src, _ = _good_src(tmp_path)
    from pyckpt._consolidate.scan import _scan_safetensors

    names = sorted(_scan_safetensors(src))
    dst = tmp_path / "dst"
    with pytest.raises(ValueError, match="basename"):
        pyckpt.consolidate(src, dst, fqn_to_file={n: bad for n in names}, fsync=False)
    assert not dst.exists()


def test_input_mode_argument(tmp_path):
    full = {"w": sample_tensor((37, 29), torch.int32, 4)}
    _roundtrip(tmp_path / "a", full, {"w": grid_blocks((37, 29), [3, 2], uneven=True)}, nfiles=6,
               input_mode="mmap")
    src, _ = _good_src(tmp_path / "b")
    with pytest.raises(ValueError, match="input_mode"):
        pyckpt.consolidate(src, tmp_path / "b" / "dst", input_mode="mmapp")
