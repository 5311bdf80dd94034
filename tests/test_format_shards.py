"""Format version 4 (pyckpt._format_shards): metadata shards at the end of each rank's data
file, a global pyckpt.json that describes each tensor's split once, and loads that read only
the shards they need. Real gloo ranks; hostile shards are also in the attack corpus
(tests/attacks/generate.py, ``shard_*``)."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import warnings
from typing import Any

import pytest
import torch
from dist_utils import run_distributed

import pyckpt
from pyckpt import _C, _format, _format_shards
from pyckpt._format_shards import Grid, Holders, parse_grid
from pyckpt.errors import CheckpointFormatError

WORLD = 3


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ------------------------------------------------------------------------ grids and holders


def _dcp_overlap(a_off: Any, a_size: Any, b_off: Any, b_size: Any) -> bool:
    """DCP's rule (_check_shard_metadata_pair_overlap)."""
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        if ao >= bo + bsz or bo >= ao + asz:
            return False
    return True


def test_grid_finds_the_cells_dcp_would_and_refuses_what_is_not_a_grid() -> None:
    rng = random.Random(7)
    for _ in range(300):
        ndim = rng.randint(0, 3)
        shape, bounds = [], []
        for _ in range(ndim):
            cuts = sorted(rng.sample(range(1, 12), rng.randint(0, 4)))
            n = rng.choice([0, 12]) if rng.random() < 0.1 else 12
            b = (0, 0) if n == 0 else (0, *cuts, 12)
            shape.append(n)
            bounds.append(b)
        grid = Grid.from_bounds(shape, bounds)
        cells = [grid.cell(i) for i in range(grid.ncells)]
        assert Grid.of(shape, cells) == (grid, list(range(grid.ncells)))
        assert parse_grid(tuple(shape), grid.runs(), "x", "grid") == grid
        for _ in range(10):
            off = [rng.randint(0, max(n, 0)) for n in shape]
            size = [rng.randint(0, n - o) for n, o in zip(shape, off)]
            want = [i for i, (o, s) in enumerate(cells) if _dcp_overlap(o, s, off, size)]
            assert list(grid.overlapping(off, size)) == want, (grid, off, size)
        for i, (o, _) in enumerate(cells):
            assert grid.number(o) == i
    # an L-shaped tiling of a 4x4 tensor is no grid; nor are overlaps or holes
    assert Grid.of((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((2, 2), (2, 2))]) is None
    assert Grid.of((4,), [((0,), (3,)), ((2,), (2,))]) is None
    assert Grid.of((4,), [((0,), (2,))]) is None


def test_holders_round_trip_and_are_short_for_regular_splits() -> None:
    rng = random.Random(3)
    shards = {r: None for r in range(64)}
    for _ in range(200):
        per_cell = []
        for _ in range(rng.randint(1, 40)):
            k = rng.choice([1, 1, 1, 2, 0])
            per_cell.append(rng.sample(range(64), k))
        enc = Holders.encode(per_cell)
        h = Holders.parse(json.loads(json.dumps(enc)), len(per_cell), shards, "x", "h")
        assert [list(h.of(i)) for i in range(len(per_cell))] == per_cell
    assert Holders.encode([[r] for r in range(4096)]) == [[0, 1, 4096]]
    with pytest.raises(CheckpointFormatError, match="rank 64 has no shard"):
        Holders.parse([[0, 64, 2]], 2, shards, "x", "h")
    with pytest.raises(CheckpointFormatError, match="holders of 3 cells, the item has 2"):
        Holders.parse([[0, 1, 3]], 2, shards, "x", "h")


def test_every_rank_of_a_holders_run_has_a_shard(tmp_path: Any) -> None:
    # A run names every rank between its first and its last: one without a shard in the middle
    # is refused with the global document (a reader would look its shard up: KeyError).
    from pyckpt._format_shards import _ShardTable
    from pyckpt._format_shards_read import parse_global

    sparse = {r: None for r in (0, 2, 3, 5, 7)}
    table = _ShardTable("0" * 12, tuple(sparse), (0,) * 5, (1,) * 5, (0,) * 5)
    for ranks in (sparse, table):
        for run, missing in (([0, 1, 3], 1), ([3, -1, 4], 1), ([0, 2, 3], 4), ([7, -2, 4], 1),
                             ([3, 2, 3], None), ([2, 1, 2], None), ([0, 0, 5], None),
                             ([0, 1, 2], 1)):
            if missing is None:
                assert Holders.parse([run], run[2], ranks, "x", "h").of(run[2] - 1) == \
                    (run[0] + (run[2] - 1) * run[1],)
            else:
                with pytest.raises(CheckpointFormatError, match=f"rank {missing} has no shard"):
                    Holders.parse([run], run[2], ranks, "x", "h")
    # in a real document: 'w' in three cells held by ranks 0, 1, 2; shards of 0, 2 and 3 only
    _, src, doc, _ = _saved_with_shard(tmp_path)
    doc.pop("checksum")
    entry = doc["shards"][0]
    doc["shards"] = [entry, [2, *entry[1:]], [3, *entry[1:]]]
    doc["items"]["w"].update(grid=[[[32, 3]], [[40, 1]]], holders=[[0, 1, 3]])
    body = json.dumps(doc, separators=(",", ":")).encode()[:-1]
    raw = body + b',"checksum":"xxh64:' + b"%016x" % _C.xxh64(body) + b'"}'
    with pytest.raises(CheckpointFormatError,
                       match=r"pyckpt.json: items\['w'\].holders\[0\]: rank 1 has no shard"):
        parse_global(raw, "pyckpt.json")


# ------------------------------------------------------------------------ one process


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(96, 40, generator=g).to(torch.bfloat16),
        "b": torch.randn(7, generator=g),
        "ids": torch.arange(50, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "extra": {"step": 11, "name": "run"},
    }


def _zeros(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0, "name": ""}
            for k, v in sd.items()}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _save(sd: dict[str, Any], path: str, **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pyckpt.save(sd, path, compression="zstd", chunk_bytes=4096, fsync=False, **kw)


def test_one_process_sharded_save_loads_and_reads_like_version_3(tmp_path: Any) -> None:
    sd = _state()
    v4, v3 = str(tmp_path / "v4"), str(tmp_path / "v3")
    _save(sd, v4, metadata_shards=True)
    _save(sd, v3)
    with open(os.path.join(v4, "pyckpt.json"), "rb") as f:
        raw = f.read()
    assert raw.startswith(_format_shards.PREFIX)
    doc = json.loads(raw)
    assert "chunks" not in raw.decode() and doc["items"]["w"]["grid"] == [[[96, 1]], [[40, 1]]]
    a, b = _format.read_index(v4), _format.read_index(v3)
    assert (a.version, b.version) == (4, 3)
    assert a.tensors.keys() == b.tensors.keys()
    for fqn, t in a.tensors.items():
        u = b.tensors[fqn]
        assert (t.dtype, t.shape) == (u.dtype, u.shape)
        assert [(p.offsets, p.sizes, p.nbytes) for p in t.pieces] == \
            [(p.offsets, p.sizes, p.nbytes) for p in u.pieces]
    out = _zeros(sd)
    pyckpt.load(out, v4)
    _equal(out, sd)
    # DCP's own planner over pyckpt.Reader
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    out = _zeros(sd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=pyckpt.Reader(v4), planner=DefaultLoadPlanner())
    _equal(out, sd)
    # the tools read every shard
    from pyckpt import tools

    report = tools.verify(v4)
    assert report.ok and report.items_checked == len(sd) + 1, report  # extra.name, extra.step
    summary = tools.summarize(v4)
    assert summary.tensors == 4 and summary.bytes_items == 2


def test_sharded_checkpoint_consolidates_to_safetensors(tmp_path: Any) -> None:
    from _st_workers import load_outputs

    sd = {k: v for k, v in _state().items() if isinstance(v, torch.Tensor) and v.numel()}
    src = str(tmp_path / "ckpt")
    _save(sd, src, metadata_shards=True)
    res = pyckpt.consolidate(src, str(tmp_path / "hf"), fsync=False)
    got = load_outputs(res.index_path)  # safetensors' own reader
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k


def _saved_with_shard(tmp_path: Any) -> tuple[dict[str, Any], str, dict[str, Any], str]:
    """A one-process sharded save of :func:`_state`: the state, the checkpoint, its parsed
    ``pyckpt.json`` and the data file holding the (one) shard."""
    sd = _state()
    src = str(tmp_path / "ckpt")
    _save(sd, src, metadata_shards=True)
    doc = json.loads(_bytes(os.path.join(src, "pyckpt.json")))
    return sd, src, doc, f"{doc['shards'][0][0]}-0.{doc['save_id']}.pyckpt"


def test_a_shard_is_one_zstd_frame_of_its_json_and_a_plain_one_still_loads(
        tmp_path: Any) -> None:
    import zstandard

    sd, src, doc, name = _saved_with_shard(tmp_path)
    assert "files" not in doc  # each data file ends with its shard: the shards give the sizes
    _, off, length, xxh = doc["shards"][0]
    data = _bytes(os.path.join(src, name))
    stored = data[off:off + length]
    assert len(data) == off + length and _C.xxh64(stored) == xxh
    text = zstandard.ZstdDecompressor().decompress(stored)  # an independent reader
    shard = json.loads(text)
    assert shard["format"] == "pyckpt-shard" and set(shard["items"]) >= {"w"}
    assert len(stored) < len(text)
    # the same shard stored as its JSON text (what the writer keeps when zstd does not pay)
    with open(os.path.join(src, name), "wb") as f:
        f.write(data[:off] + text)
    doc["shards"][0][2:] = [len(text), _C.xxh64(text)]
    _format.rewrite_metadata(src, lambda d: d.update(shards=doc["shards"]))
    out = _zeros(sd)
    pyckpt.load(out, src)
    _equal(out, sd)


def test_damaged_shards_are_typed_errors_naming_the_shard(tmp_path: Any) -> None:
    sd, src, doc, name = _saved_with_shard(tmp_path)
    _, off, length, _ = doc["shards"][0]
    data = _bytes(os.path.join(src, name))

    def case(label: str, mutate: Any, err: type[BaseException], match: str) -> None:
        d = str(tmp_path / label)
        shutil.copytree(src, d)
        mutate(d)
        with pytest.raises(err, match=match) as info:
            _format.read_index(d)
        assert name in str(info.value) or name in str(getattr(info.value, "filename", "")), \
            info.value
        with pytest.raises(err):
            pyckpt.load(_zeros(sd), d)

    def flip(d: str) -> None:
        with open(os.path.join(d, name), "r+b") as f:
            f.seek(off + 10)
            f.write(bytes([data[off + 10] ^ 4]))

    case("flipped", flip, CheckpointFormatError, "metadata shard of rank 0.*digest mismatch")
    case("truncated", lambda d: os.truncate(os.path.join(d, name), off + length - 5),
         CheckpointFormatError, "truncated")
    case("missing", lambda d: os.unlink(os.path.join(d, name)), FileNotFoundError, "missing")


@pytest.mark.parametrize("stored", ["zstd", "text"])
def test_a_shard_of_json_far_denser_than_records_is_refused_before_it_is_parsed(
        tmp_path: Any, stored: str) -> None:
    # 8 MiB of "[]," sealed and digested like a real shard: parsed, about 60 bytes of Python
    # per 3 bytes of text (a 64 MiB one: gigabytes). As a zstd frame it is a few KiB: more text
    # than 32x its stored bytes is refused from the frame header; as text, by its density.
    sd, src, doc, name = _saved_with_shard(tmp_path)
    _, off, _, _ = doc["shards"][0]
    body = (b'{"format":"pyckpt-shard","version":4,"save_id":"' + doc["save_id"].encode()
            + b'","rank":0,"items":{"w":[' + b"[]," * ((8 << 20) // 3) + b'[]]}}')
    data = _format_shards._seal(body)
    if stored == "zstd":
        data = _C.zstd_frame(data, 3)
        assert len(data) < 64 << 10
        match = r"metadata shard of rank 0\): not one zstd frame of a shard: .*declares \d+ " \
                r"decoded bytes, more than the \d+ allowed"
    else:
        match = r"metadata shard of rank 0\): \d+ JSON arrays and objects in \d+ bytes"
    with open(os.path.join(src, name), "r+b") as f:
        f.truncate(off)
        f.seek(off)
        f.write(data)
    doc["shards"][0][2:] = [len(data), _C.xxh64(data)]
    _format.rewrite_metadata(src, lambda d: d.update(shards=doc["shards"]))
    with pytest.raises(CheckpointFormatError, match=match):
        _format.read_index(src)
    with pytest.raises(CheckpointFormatError, match=match):
        pyckpt.load(_zeros(sd), src)


def test_a_grid_of_more_non_empty_pieces_than_shards_is_refused_before_planning(
        tmp_path: Any) -> None:
    # A few bytes of grid could name millions of one-element pieces of a large tensor: a loading
    # rank would plan a read of each (gigabytes of read items) before any shard says otherwise.
    # Each rank writes at most one piece of a tensor in a version-4 save.
    sd, src, doc, _ = _saved_with_shard(tmp_path)

    def many(d: dict[str, Any]) -> None:
        d["items"]["w"].update(grid=[[[1, 96]], [[40, 1]]], holders=[[0, 0, 96]])

    _format.rewrite_metadata(src, many)
    match = r"pyckpt\.json: items\['w'\]\.grid: 96 non-empty pieces, more than the 1 shards"
    with pytest.raises(CheckpointFormatError, match=match):
        _format.read_index(src)
    with pytest.raises(CheckpointFormatError, match=match):
        pyckpt.load(_zeros(sd), src)


def test_a_global_document_of_the_first_version_4_writers_still_loads(tmp_path: Any) -> None:
    sd, src, doc, name = _saved_with_shard(tmp_path)
    _, off, length, _ = doc["shards"][0]
    # they also listed every data file's size in "files" (the shards give it)
    _format.rewrite_metadata(src, lambda d: d.update(files={name: off + length}))
    assert "files" in json.loads(_bytes(os.path.join(src, "pyckpt.json")))
    out = _zeros(sd)
    pyckpt.load(out, src)
    _equal(out, sd)
    assert dict(_format.read_index(src).files) == {name: off + length}


# ------------------------------------------------------------------------ real ranks


def _rank_state(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(9)
    return {
        "w": distribute_tensor(torch.randn(12 * world, 8, generator=g), mesh, [Shard(0)]),
        "v": distribute_tensor(torch.randn(5 * world + 1, 3, generator=g).to(torch.bfloat16),
                               mesh, [Shard(0)]),  # uneven: the last shard is shorter
        "norm": torch.randn(1 << 20, generator=g),  # replicated, split between ranks by bytes
        "step": 3,
    }


def _sharded_only(sd: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    return {k: DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                  shape=v.shape, stride=v.stride())
            for k, v in sd.items() if k in ("w", "v")}


def _save_worker(rank: int, world: int, path: str) -> None:
    from pyckpt._loadplan import GridChunks

    sd = _rank_state(rank, world)
    md = pyckpt.save(sd, path, compression="zstd", chunk_bytes=4096, fsync=False)
    # every rank got the metadata with each tensor's chunks as its grid (a few bytes), equal
    # to DCP's list of chunks
    chunks = md.state_dict_metadata["w"].chunks
    assert isinstance(chunks, GridChunks) and len(chunks) == world
    assert [tuple(c.offsets) for c in chunks] == [(12 * r, 0) for r in range(world)]
    assert chunks == list(chunks)
    pyckpt.save(sd, path, compression="zstd", chunk_bytes=4096, fsync=False)  # cached plan
    # each rank loads its own shards of the sharded tensors: it reads its own metadata shard
    # only (with a Reader of its own, to count)
    import torch.distributed.checkpoint as dcp

    dest = _sharded_only(sd)
    reader = pyckpt.Reader(path)
    dcp.load(dest, storage_reader=reader, planner=pyckpt.LoadPlanner(allow_partial_load=True))
    for k, v in dest.items():
        assert torch.equal(v.to_local(), sd[k].to_local()), k
    assert reader._storage.sharded.shards_read == 1, reader._storage.sharded.shards_read
    # everything, the replicated tensor split between the ranks and the step included: its own
    # shard still (those are stored in pyckpt.json). (A cooperative load's coordinator reads
    # the shards of every rank's cells, to share out the chunks several ranks want.)
    dest = _sharded_only(sd) | {"norm": torch.zeros(1 << 20), "step": 0}
    reader = pyckpt.Reader(path, cooperative=False)
    dcp.load(dest, storage_reader=reader, planner=pyckpt.LoadPlanner())
    assert torch.equal(dest["norm"], sd["norm"]) and dest["step"] == 3
    assert reader._storage.sharded.shards_read == 1, reader._storage.sharded.shards_read


def test_ranks_write_shards_and_each_rank_reads_only_its_own(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save_worker, WORLD, path)
    raw = _bytes(os.path.join(path, "pyckpt.json"))
    doc = json.loads(raw)
    assert doc["version"] == 4 and len(doc["shards"]) == WORLD
    assert doc["items"]["w"]["grid"][0] == [[12, WORLD]]
    assert doc["items"]["w"]["holders"] == [[0, 1, WORLD]]
    assert doc["items"]["v"]["grid"][0] == [[6, WORLD - 1], [5 * WORLD + 1 - 6 * (WORLD - 1), 1]]
    norm = doc["items"]["norm"]  # split between ranks: its records are here, not in shards
    assert norm["grid"] == [[[1 << 20, 1]]] and len(norm["holders"][0][0]) > 1
    assert sorted({s[0] for s in norm["segments"]}) == sorted(norm["holders"][0][0])
    assert doc["items"]["step"]["segments"][0][0] in range(WORLD)
    assert '"chunks"' not in raw.decode()
    # resharded WORLD -> 1: every shard read and checked
    g = torch.Generator().manual_seed(9)
    w, v = torch.randn(12 * WORLD, 8, generator=g), torch.randn(
        5 * WORLD + 1, 3, generator=g).to(torch.bfloat16)
    norm_full = torch.randn(1 << 20, generator=g)
    dest = {"w": torch.zeros_like(w), "v": torch.zeros_like(v), "norm": torch.zeros(1 << 20),
            "step": 0}
    pyckpt.load(dest, path)
    assert torch.equal(dest["w"], w) and torch.equal(dest["v"], v)
    assert torch.equal(dest["norm"], norm_full) and dest["step"] == 3
    from pyckpt import tools

    assert tools.verify(path).ok


def _swap_worker(rank: int, world: int, path: str) -> None:
    pyckpt.save(_rank_state(rank, world), path, fsync=False)


def test_shards_swapped_between_ranks_are_refused_naming_the_shard(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_swap_worker, 2, path)
    meta = os.path.join(path, "pyckpt.json")
    doc = json.loads(_bytes(meta))
    doc.pop("checksum")
    sid = doc["save_id"]
    f0, f1 = (os.path.join(path, f"{r}-0.{sid}.pyckpt") for r in (0, 1))
    # rank 1's data file (and shard) in rank 0's place, pyckpt.json made to agree on sizes
    shutil.copyfile(f1, f0)
    doc["shards"][0][1:] = doc["shards"][1][1:]
    body = json.dumps(doc, separators=(",", ":")).encode()
    with open(meta, "wb") as f:
        f.write(body[:-1] + b',"checksum":"xxh64:' + b"%016x" % _C.xxh64(body[:-1]) + b'"}')
    with pytest.raises(CheckpointFormatError,
                       match=r"0-0\.[0-9a-f]{12}\.pyckpt \(metadata shard of rank 0\): rank: 1: "
                             "this is not rank 0's shard"):
        _format.read_index(path)


def test_sharded_saves_take_any_layout_and_fall_back_when_pieces_are_no_grid() -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    def item(offsets: Any, sizes: Any) -> WriteItem:
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        return WriteItem(index=MetadataIndex("t", torch.Size(offsets)), type=WriteItemType.SHARD,
                         tensor_data=TensorWriteData(chunk, TensorProperties(dtype=torch.float32),
                                                     torch.Size((4, 4))))

    grid = [SavePlan([item((0, 0), (2, 4))]), SavePlan([item((2, 0), (2, 4))])]
    layout = _format_shards.Layout.of_plans(grid)
    assert layout is not None and json.loads(layout.items_json({}))["t"]["holders"] == \
        [[0, 1, 2]]
    ell = [SavePlan([item((0, 0), (2, 4))]),
           SavePlan([item((2, 0), (2, 2)), item((2, 2), (2, 2))])]
    assert _format_shards.Layout.of_plans(ell) is None
    # a grid, but more non-empty cells than ranks writing (a reader refuses that): version 3
    rows = [SavePlan([item((r, 0), (1, 4))]) for r in range(4)]
    assert _format_shards.Layout.of_plans(rows) is not None
    two_each = [SavePlan([item((0, 0), (1, 4)), item((1, 0), (1, 4))]),
                SavePlan([item((2, 0), (1, 4)), item((3, 0), (1, 4))])]
    assert _format_shards.Layout.of_plans(two_each) is None


def test_the_cells_of_an_uneven_3d_grid_tile_it() -> None:
    # Grid.cell / number agree for a 3-d grid with uneven cells
    grid = Grid.from_bounds((5, 4, 3), ((0, 2, 5), (0, 1, 4), (0, 3)))
    seen = set()
    for i in range(grid.ncells):
        off, size = grid.cell(i)
        assert grid.number(off) == i
        seen.update(itertools.product(*(range(o, o + s) for o, s in zip(off, size))))
    assert len(seen) == 5 * 4 * 3


@pytest.mark.parametrize("shards", [False, True])
def test_an_item_name_with_a_lone_surrogate_is_a_format_error(tmp_path: Any, shards: bool) -> None:
    # JSON reads "\ud800w"; no tensor name is one, and the native readers and writers cannot take
    # it (a RuntimeError or TypeError deep in a load, verify or consolidation before)
    from pyckpt import tools

    path = str(tmp_path / "ckpt")
    _save({"w": torch.randn(8, 4), "step": 3}, path, metadata_shards=shards)
    meta = os.path.join(path, "pyckpt.json")
    with open(meta, "rb") as f:
        doc = json.loads(f.read())
    doc.pop("checksum")
    doc["items"] = {("\ud800" + k if k == "step" else k): v for k, v in doc["items"].items()}
    body = json.dumps(doc, separators=(",", ":")).encode()  # the name as a \u escape
    with open(meta, "wb") as f:
        f.write(_format_shards._seal(body))
    with pytest.raises(CheckpointFormatError, match=r"pyckpt\.json: items\['\\ud800step'\]"):
        _format.read_index(path)
    with pytest.raises(CheckpointFormatError, match="lone surrogate"):
        pyckpt.load({"w": torch.zeros(8, 4), "\ud800step": 0}, path)
    with pytest.raises(CheckpointFormatError, match="lone surrogate"):
        tools.verify(path)
