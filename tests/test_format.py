"""The metadata file: checksum, strict schema, names, tiling, codec records, limits, fuzzing."""

from __future__ import annotations

import copy
import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _docwalk import paths
from hypothesis import given
from hypothesis import strategies as st

import pyckpt
from pyckpt import _C, _format, tools
from pyckpt.errors import CheckpointFormatError, PyckptError, UnsupportedDtypeError

CHUNK = 4096
ROWS, COLS = 64, 1024  # float32 rows of exactly one chunk


def _save(path: Path, compression: str | None = "zstd") -> dict[str, Any]:
    torch.manual_seed(0)
    sd: dict[str, Any] = {
        "w": (torch.randn(ROWS, COLS) * 0.02),
        "h": (torch.randn(3 * CHUNK // 2 + 3) * 0.02).to(torch.bfloat16),
        "i": torch.randint(-100, 100, (5000,), dtype=torch.int8),
        "e": torch.zeros(0, 3),
        "extra": b"opaque bytes " * 40,  # a BYTE_IO item
    }
    dcp.save(sd, storage_writer=pyckpt.Writer(path, compression=compression, chunk_bytes=CHUNK))
    return sd


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    _save(tmp_path / "ck")
    return tmp_path / "ck"


@pytest.fixture
def raw_ckpt(tmp_path: Path) -> Path:
    _save(tmp_path / "raw", compression=None)
    return tmp_path / "raw"


def _meta(path: Path) -> Path:
    return path / _format.METADATA_FILE


def _doc(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(_meta(path).read_bytes())
    doc.pop("checksum", None)
    return doc


def _seal(body: bytes) -> bytes:
    """The documented seal, built independently of the writer: hash of everything before it."""
    head = body[:-1]
    return head + b',"checksum":"xxh64:' + f"{_C.xxh64(head):016x}".encode() + b'"}'


def _write_doc(path: Path, doc: Any, seal: bool = True) -> None:
    body = json.dumps(doc, separators=(",", ":")).encode()
    _meta(path).write_bytes(_seal(body) if seal else body)


def _refused(path: Path, *needles: str, exc: type[BaseException] = CheckpointFormatError) -> str:
    with pytest.raises(exc) as info:
        _format.read_index(path)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, msg
    return msg


def _load_w(path: Path) -> torch.Tensor:
    out = {"w": torch.zeros(ROWS, COLS)}
    dcp.load(out, storage_reader=pyckpt.Reader(path))
    return out["w"]


# ------------------------------------------------------------------------------- checksum


def test_metadata_ends_with_checksum_of_the_bytes_before_it(ckpt: Path) -> None:
    raw = _meta(ckpt).read_bytes()
    doc = json.loads(raw)
    assert doc["version"] == _format.FORMAT_VERSION == 3 and list(doc)[-1] == "checksum"
    body = json.dumps({k: v for k, v in doc.items() if k != "checksum"}, separators=(",", ":"),
                      ensure_ascii=False).encode()
    assert raw == _seal(body)  # exactly the documented layout
    assert _format.read_index(ckpt).version == 3


def test_damaged_metadata_is_refused_before_use(ckpt: Path) -> None:
    raw = bytearray(_meta(ckpt).read_bytes())
    # A damage that leaves valid JSON and a valid schema: only the checksum can find it.
    text = raw.decode()
    pos = text.index('"created_by":"pyckpt ') + len('"created_by":"')
    raw[pos] = ord("q")
    _meta(ckpt).write_bytes(bytes(raw))
    _refused(ckpt, str(_meta(ckpt)), "checksum mismatch")
    with pytest.raises(CheckpointFormatError):
        pyckpt.Reader(ckpt).read_metadata()  # construction is lazy; the read validates


def test_version2_without_checksum_is_refused(ckpt: Path) -> None:
    _write_doc(ckpt, _doc(ckpt), seal=False)
    _refused(ckpt, "checksum is missing")


def test_version1_files_stay_readable_under_the_strict_schema(raw_ckpt: Path) -> None:
    expect = _load_w(raw_ckpt)
    doc = _doc(raw_ckpt)
    _format.toggle_chunk_places(doc)  # version 1 checksums are not bound to their places
    doc["version"] = 1
    _write_doc(raw_ckpt, doc, seal=False)  # what pyckpt 0.1 wrote
    index = _format.read_index(raw_ckpt)
    assert index.version == 1
    assert torch.equal(_load_w(raw_ckpt), expect)
    # ... with a checksum member it is not a version 1 file
    _format.rewrite_metadata(raw_ckpt, lambda d: d.__setitem__("version", 1))
    _write_doc(raw_ckpt, doc, seal=True)
    _refused(raw_ckpt, "checksum: unknown key")
    doc["extra"] = 1
    _write_doc(raw_ckpt, doc, seal=False)
    _refused(raw_ckpt, "extra: unknown key")


# ------------------------------------------------------------------------------- chunk places


def _load_all(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {
        "w": torch.zeros(ROWS, COLS),
        "i": torch.zeros(5000, dtype=torch.int8),
    }
    pyckpt.load(out, path)  # typed errors, not DCP's wrapper
    return out


def _swap(a: list[Any], b: list[Any]) -> None:
    a[:], b[:] = list(b), list(a)


def _w_chunks(d: dict[str, Any], piece: int = 0) -> list[list[Any]]:
    chunks: list[list[Any]] = d["items"]["w"]["pieces"][piece]["segments"][0]["chunks"]
    return chunks


def test_chunk_checksums_are_bound_to_their_places_as_documented(raw_ckpt: Path) -> None:
    # docs/FORMAT.md: xxh64 = XXH64(stored bytes) ^ XXH64(LE64(raw offset), seed=XXH64(fqn \0
    # LE64(offsets)...)), recomputed here from the file without pyckpt's own helpers.
    (name,) = _doc(raw_ckpt)["files"]
    data = (raw_ckpt / name).read_bytes()
    seed = _C.xxh64(b"w\0" + (0).to_bytes(8, "little") * 2)
    for j, (off, raw_len, recorded, _, planes) in enumerate(_w_chunks(_doc(raw_ckpt))):
        stored = data[off:off + sum(planes[1::2])]
        key = _C.xxh64((j * raw_len).to_bytes(8, "little"), seed)
        assert recorded == _C.xxh64(stored) ^ key, j
    (extra,) = _doc(raw_ckpt)["items"]["extra"]["segments"]
    off, raw_len, recorded, _, planes = extra["chunks"][0]
    key = _C.xxh64((0).to_bytes(8, "little"), _C.xxh64(b"extra\0"))
    assert recorded == _C.xxh64(data[off:off + planes[1]]) ^ key


@pytest.mark.parametrize(
    "edit",
    [
        # two chunk records of one tensor swapped
        lambda d: _swap(_w_chunks(d)[3], _w_chunks(d)[17]),
        # a chunk of 'w' and one of 'i' (same raw length) swapped across tensors
        lambda d: _swap(_w_chunks(d)[0], d["items"]["i"]["pieces"][0]["segments"][0]["chunks"][0]),
    ],
    ids=["within-tensor", "across-tensors"],
)
def test_swapped_chunk_records_fail_their_checksum(raw_ckpt: Path, edit: Any) -> None:
    # The metadata stays valid (its own checksum recomputed, the schema satisfied): only the
    # binding of each chunk to its tensor and raw offset can tell, before a value is returned.
    _format.rewrite_metadata(raw_ckpt, edit)
    _format.read_index(raw_ckpt)
    with pytest.raises(pyckpt.ChecksumError, match="tensor '(w|i)'") as info:
        _load_all(raw_ckpt)
    assert "checksum mismatch" in str(info.value)
    report = tools.verify(raw_ckpt)
    assert not report.ok and all(e.startswith("ChecksumError") for e in report.errors.values())
    assert set(report.errors) <= {"w", "i"}


def test_swapped_piece_offsets_fail_their_checksum(raw_ckpt: Path) -> None:
    expect = _load_w(raw_ckpt)
    _format.rewrite_metadata(raw_ckpt, lambda d: _split_rows(d, [(0, 8), (8, 16), (16, 64)]),
                             rebind=True)
    assert torch.equal(_load_w(raw_ckpt), expect)  # moved with rebinding: still exact

    def swap_offsets(d: dict[str, Any]) -> None:
        a, b = d["items"]["w"]["pieces"][:2]
        a["offsets"], b["offsets"] = b["offsets"], a["offsets"]

    _format.rewrite_metadata(raw_ckpt, swap_offsets)
    with pytest.raises(pyckpt.ChecksumError, match="tensor 'w'"):
        pyckpt.load({"w": torch.zeros(ROWS, COLS)}, raw_ckpt)


def _v2_fixture_state() -> dict[str, Any]:
    """The state dict of tests/data/format_v2 (see its README), rebuilt without randomness."""
    n = torch.arange(64 * 256, dtype=torch.int64)
    return {
        "w": ((n * 2654435761) % 65521).to(torch.float32).reshape(64, 256) / 4096 - 8,
        "h": (((n[:5000] * 40503) % 4093).to(torch.float32) / 512 - 4).to(torch.bfloat16),
        "i": ((n[:5000] * 7919) % 251 - 125).to(torch.int8),
        "e": torch.zeros(0, 3),
        "extra": b"opaque bytes " * 40,
    }


def test_version2_checkpoint_still_loads_bit_exact(tmp_path: Path) -> None:
    import shutil

    src = Path(__file__).parent / "data" / "format_v2"
    ck = tmp_path / "v2"
    shutil.copytree(src, ck)  # a checked-in file written by the previous format version
    index = _format.read_index(ck)
    assert index.version == 2
    assert json.loads(_meta(ck).read_bytes())["version"] == 2
    expect = _v2_fixture_state()
    out: dict[str, Any] = {k: torch.zeros_like(v) for k, v in expect.items() if k != "extra"}
    out["extra"] = None
    dcp.load(out, storage_reader=pyckpt.Reader(ck))
    for k, v in expect.items():
        if isinstance(v, torch.Tensor):
            assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
        else:
            assert out[k] == v
    assert len(_format.read_index(ck).tensors["w"].pieces[0].segments[0][3]) == 16
    tools.verify(ck)
    # Re-saving writes the current version, with bound checksums.
    dcp.save(out, storage_writer=pyckpt.Writer(tmp_path / "v3", chunk_bytes=CHUNK))
    assert _format.read_index(tmp_path / "v3").version == _format.FORMAT_VERSION == 3


def test_a_newer_format_version_is_refused_by_name(ckpt: Path) -> None:
    _format.rewrite_metadata(ckpt, lambda d: d.__setitem__("version", 5))
    msg = _refused(ckpt, str(_meta(ckpt)), "format version 5 is not supported",
                   "reads versions 1, 2, 3, 4", "upgrade pyckpt")
    assert "checksum" not in msg
    with pytest.raises(CheckpointFormatError, match="format version 5"):
        pyckpt.load({"w": torch.zeros(ROWS, COLS)}, ckpt)


def test_a_version_4_label_on_a_single_document_is_refused(ckpt: Path) -> None:
    # The sharded reader takes it (by its first bytes) and finds no shards; members reordered,
    # the metadata reader says what a version-4 document must look like.
    _format.rewrite_metadata(ckpt, lambda d: d.__setitem__("version", 4))
    _refused(ckpt, str(_meta(ckpt)), "missing ['shards']")
    _format.rewrite_metadata(ckpt, lambda d: {"version": 4, **{k: v for k, v in d.items()
                                                               if k != "version"}})
    _refused(ckpt, str(_meta(ckpt)), 'must begin with {"format":"pyckpt","version":4,')


# ------------------------------------------------------------------------------- strict schema


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.__setitem__("extra", 1), "extra: unknown key"),
        (lambda d: d.pop("save_id"), "save_id: missing"),
        (lambda d: d["items"]["w"]["pieces"][0]["segments"][0].__setitem__("x", 0),
         "items['w'].pieces[0].segments[0].x: unknown key"),
        (lambda d: d["items"]["w"]["pieces"][0].pop("sizes"), "items['w'].pieces[0].sizes: missing"),
        (lambda d: d["items"]["w"]["pieces"][0]["segments"][0]["chunks"][3].append(0),
         "items['w'].pieces[0].segments[0].chunks[3]"),
        (lambda d: d.__setitem__("version", 2.0), "version: must be an integer"),
        (lambda d: d.__setitem__("version", True), "version: must be an integer"),
        (lambda d: d["items"]["w"]["pieces"][0]["segments"][0]["chunks"][0].__setitem__(0, False),
         "chunks[0][0]"),
        (lambda d: d["items"]["w"]["pieces"][0]["segments"][0].__setitem__("raw_begin", False),
         "raw_begin: must be an integer"),
        (lambda d: d["items"]["w"]["pieces"][0]["segments"][0]["chunks"][0].__setitem__(0, 0.0),
         "chunks[0][0]"),
        (lambda d: d["items"]["w"]["shape"].__setitem__(0, True), "shape[0]"),
        (lambda d: d["items"]["extra"].__setitem__("nbytes", float(d["items"]["extra"]["nbytes"])),
         "items['extra'].nbytes: must be an integer"),
        (lambda d: d["items"]["w"].__setitem__("requires_grad", 0), "requires_grad: must be true"),
        (lambda d: d["items"]["w"].__setitem__("memory_format", "sparse"), "memory_format"),
        (lambda d: d.__setitem__("created_by", 7), "created_by: must be a string"),
        (lambda d: d.__setitem__("dcp_version", 1), "dcp_version: must be a string"),
        (lambda d: d.__setitem__("save_id", "ABC"), "save_id"),
        (lambda d: d["storage_meta"].__setitem__("modules", [1]), "storage_meta.modules[0]"),
        (lambda d: d["storage_meta"].__setitem__("other", 1), "storage_meta.other: unknown key"),
        (lambda d: d.__setitem__("planner_data", {"__tuple__": 5}), "planner_data.__tuple__"),
        (lambda d: d.__setitem__("planner_data", {"__tuple__": [], "x": 1}),
         "planner_data.x: unknown key"),
        (lambda d: d["items"]["w"].__setitem__("type", "tensorx"), "unknown item type"),
        (lambda d: d["items"]["w"].pop("type"), "items['w'].type: missing"),
    ],
)
def test_strict_schema_names_the_key_path(ckpt: Path, mutate: Callable[[Any], Any],
                                          needle: str) -> None:
    _format.rewrite_metadata(ckpt, mutate)
    _refused(ckpt, str(_meta(ckpt)), needle)


def test_unknown_dtype_is_unsupported_dtype_error(ckpt: Path) -> None:
    _format.rewrite_metadata(ckpt, lambda d: d["items"]["w"].__setitem__("dtype", "float4"))
    _refused(ckpt, "items['w'].dtype", "float4", exc=UnsupportedDtypeError)
    _format.rewrite_metadata(ckpt, lambda d: d["items"]["w"].__setitem__("dtype", ["float32"]))
    _refused(ckpt, "items['w'].dtype: must be a string")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-8-sig"])
def test_only_plain_utf8_is_read(ckpt: Path, encoding: str) -> None:
    raw = _meta(ckpt).read_bytes()
    _meta(ckpt).write_bytes(raw.decode().encode(encoding))
    _refused(ckpt, str(_meta(ckpt)))


def test_invalid_utf8_is_a_format_error(ckpt: Path) -> None:
    body = json.dumps(_doc(ckpt), separators=(",", ":")).encode()
    body = body.replace(b'"created_by":"', b'"created_by":"\xff\xfe')
    _meta(ckpt).write_bytes(_seal(body))
    _refused(ckpt, "not UTF-8")


def test_duplicate_keys_are_refused(ckpt: Path) -> None:
    body = json.dumps(_doc(ckpt), separators=(",", ":")).encode()
    dup = body.replace(b'"requires_grad":false', b'"requires_grad":true,"requires_grad":false', 1)
    assert dup != body
    _meta(ckpt).write_bytes(_seal(dup))
    _refused(ckpt, "repeats the key 'requires_grad'", "items[")
    dup = body.replace(b'{"format":"pyckpt"', b'{"format":"pyckpt","format":"pyckpt"', 1)
    _meta(ckpt).write_bytes(_seal(dup))
    _refused(ckpt, "repeats the top-level key 'format'")


def _body_with_planner_data(ckpt: Path, text: bytes) -> bytes:
    doc = _doc(ckpt)
    doc["planner_data"] = "@@"
    body = json.dumps(doc, separators=(",", ":")).encode()
    return body.replace(b'"@@"', text)


def test_deep_nesting_is_a_format_error(ckpt: Path) -> None:
    depth = 100_000
    body = _body_with_planner_data(ckpt, b"[" * depth + b"]" * depth)
    deep: Any = 1
    for _ in range(_format.MAX_PLANNER_DEPTH + 1):
        deep = [deep]
    _format.rewrite_metadata(ckpt, lambda d: d.__setitem__("planner_data", deep))
    _refused(ckpt, "planner_data[0][0]", "nested deeper")
    _meta(ckpt).write_bytes(_seal(body))
    _refused(ckpt, "nested too deeply")


def test_json_constants_and_huge_integers_are_format_errors(ckpt: Path) -> None:
    _meta(ckpt).write_bytes(_seal(_body_with_planner_data(ckpt, b"NaN")))
    _refused(ckpt, "not valid JSON")
    _meta(ckpt).write_bytes(_seal(_body_with_planner_data(ckpt, b"9" * 5000)))
    _refused(ckpt, "not valid JSON")


def test_planner_data_round_trips_tuples(ckpt: Path) -> None:
    # The last entry has the shape of a segment object, whose chunk lists the parser compacts.
    seg = {"file": "f", "raw_begin": 0, "codec": [], "chunks": [[1, 2, 3, 4, [5, (6,)]]]}
    value = {"a": (1, "x", (2, [3])), "b": [None, 1.5, True], "c": seg}
    _format.rewrite_metadata(ckpt, lambda d: d.__setitem__(
        "planner_data", _format.encode_planner_data(value)))
    assert _format.read_index(ckpt).planner_data == value
    with pytest.raises(TypeError):
        _format.encode_planner_data({"__tuple__": [1]})  # ambiguous: refused when saving
    with pytest.raises(TypeError):
        _format.encode_planner_data([float("nan")])
    bad = {**seg, "chunks": [[1, 2, 3, 4, [{"__tuple__": 1}]]]}
    _format.rewrite_metadata(ckpt, lambda d: d.__setitem__("planner_data", bad))
    _refused(ckpt, "planner_data['chunks'][0][4][0].__tuple__")


# ------------------------------------------------------------------------------- names


def _rename_file(d: dict[str, Any], new: str) -> None:
    (old,) = d["files"]
    d["files"] = {new: d["files"][old]}
    for item in d["items"].values():
        for seg in [s for p in item.get("pieces", [item]) for s in p["segments"]]:
            seg["file"] = new


@pytest.mark.parametrize(
    "name",
    [
        "../0-0.0123456789ab.pyckpt",
        "/tmp/0-0.0123456789ab.pyckpt",
        "sub/0-0.0123456789ab.pyckpt",
        "0-0.0123456789ab.pyckpt\n",  # re.match with $ accepts a trailing newline
        "\u0660-0.0123456789ab.pyckpt",  # an Arabic-Indic digit matches \d
        "00-0.0123456789ab.pyckpt",
        "0-0.0123456789AB.pyckpt",
        "0-0.0123456789abc.pyckpt",
        "..",
    ],
)
def test_data_file_names_are_exactly_the_writers(ckpt: Path, name: str) -> None:
    _format.rewrite_metadata(ckpt, lambda d: _rename_file(d, name))
    _refused(ckpt, "illegal data file name")
    assert not _format.is_data_file(name)


def test_metadata_symlink_is_not_followed(ckpt: Path, tmp_path: Path) -> None:
    real = tmp_path / "elsewhere.json"
    _meta(ckpt).rename(real)
    _meta(ckpt).symlink_to(real)
    _refused(ckpt, str(_meta(ckpt)), "symbolic link")


def test_metadata_that_is_not_a_regular_file(ckpt: Path) -> None:
    _meta(ckpt).unlink()
    _meta(ckpt).mkdir()
    _refused(ckpt, str(_meta(ckpt)), "not a regular file")


def test_metadata_fifo_does_not_hang(ckpt: Path) -> None:
    meta = _meta(ckpt)
    meta.unlink()
    os.mkfifo(meta)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            _format.read_index(ckpt)
            outcome.append(None)
        except BaseException as e:  # handed to the test thread
            outcome.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # unblock the reader before failing
        fd = os.open(meta, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(20)
        pytest.fail("reading a FIFO named pyckpt.json blocked")
    assert isinstance(outcome[0], CheckpointFormatError), outcome
    assert str(meta) in str(outcome[0])


def test_data_file_symlink_is_refused(ckpt: Path, tmp_path: Path) -> None:
    (name,) = _doc(ckpt)["files"]
    data = ckpt / name
    data.rename(tmp_path / "moved")
    data.symlink_to(tmp_path / "moved")
    _refused(ckpt, str(data), "symbolic link")
    data.unlink()
    data.mkdir()
    _refused(ckpt, str(data), "not a regular file")


# ------------------------------------------------------------------------------- tiling


def _split_rows(d: dict[str, Any], bounds: list[tuple[int, int]]) -> None:
    """Splits tensor 'w' of a codec-none checkpoint (one chunk per row) into row pieces."""
    item = d["items"]["w"]
    (piece,) = item["pieces"]
    (seg,) = piece["segments"]
    assert len(seg["chunks"]) == ROWS
    item["pieces"] = [
        {"offsets": [r0, 0], "sizes": [r1 - r0, COLS],
         "segments": [{**seg, "raw_begin": 0, "chunks": seg["chunks"][r0:r1]}]}
        for r0, r1 in bounds
    ]


def test_row_pieces_that_tile_load_bit_exact(raw_ckpt: Path) -> None:
    expect = _load_w(raw_ckpt)
    _format.rewrite_metadata(raw_ckpt, lambda d: _split_rows(d, [(40, 64), (0, 7), (7, 40)]),
                             rebind=True)  # the chunks move to new pieces
    assert len(_format.read_index(raw_ckpt).tensors["w"].pieces) == 3
    assert torch.equal(_load_w(raw_ckpt), expect)


@pytest.mark.parametrize(
    ("bounds", "needle"),
    [
        ([(0, 32), (40, 64)], "a piece is missing"),
        ([(0, 40), (32, 64)], "pieces overlap"),
        ([(0, 32), (16, 48)], "overlaps"),  # as many elements as the tensor, but a hole
        ([], "a piece is missing"),
    ],
)
def test_pieces_must_tile_the_tensor(raw_ckpt: Path, bounds: list[tuple[int, int]],
                                     needle: str) -> None:
    _format.rewrite_metadata(raw_ckpt, lambda d: _split_rows(d, bounds))
    _refused(raw_ckpt, "items['w'].pieces", needle)


def _tiling_doc(shape: tuple[int, ...], boxes: list[Any]) -> bytes:
    """A version-2 document of one uint8 tensor ``t`` of ``shape`` stored as pieces ``boxes``
    ((offsets, sizes) each, one chunk per non-empty piece, back to back in one data file)."""
    name, pieces, end = "0-0.0123456789ab.pyckpt", [], 0
    for offsets, sizes in boxes:
        n = math.prod(sizes)
        segments = [{"file": name, "raw_begin": 0, "codec": ["none", 0, 1, "none"],
                     "chunks": [[end, n, 0, 0, [0, n]]]}] if n else []
        pieces.append({"offsets": list(offsets), "sizes": list(sizes), "segments": segments})
        end += n
    doc = {"format": "pyckpt", "version": 2, "created_by": "test", "save_id": "0123456789ab",
           "dcp_version": None, "storage_meta": {"modules": []}, "planner_data": None,
           "files": {name: end},
           "items": {"t": {"type": "tensor", "dtype": "uint8", "shape": list(shape),
                           "requires_grad": False, "memory_format": "contiguous_format",
                           "pieces": pieces}}}
    return _seal(json.dumps(doc, separators=(",", ":")).encode())


def _check(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    _C.parse_pyckpt_index(_tiling_doc(shape, boxes), "/ck/pyckpt.json")


def _tiles_by_counting(shape: tuple[int, ...], boxes: list[Any]) -> bool:
    grid = np.zeros(shape, dtype=np.int64)
    for o, s in boxes:
        grid[tuple(slice(a, a + b) for a, b in zip(o, s))] += 1
    return bool((grid == 1).all())


@st.composite
def _box_sets(draw: Any) -> tuple[tuple[int, ...], list[Any]]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    if draw(st.booleans()):  # a grid tiling, maybe perturbed
        cuts = [sorted({0, n} | set(draw(st.lists(st.integers(0, n), max_size=3))))
                for n in shape]
        boxes = [((), ())]
        for c in cuts:
            boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in zip(c, c[1:])]
        if boxes and draw(st.booleans()):
            boxes.pop(draw(st.integers(0, len(boxes) - 1)))
        if boxes and draw(st.booleans()):
            boxes.append(boxes[draw(st.integers(0, len(boxes) - 1))])
        return shape, boxes
    boxes = []
    for _ in range(draw(st.integers(0, 6))):
        o = tuple(draw(st.integers(0, n - 1)) for n in shape)
        s = tuple(draw(st.integers(1, n - a)) for a, n in zip(o, shape))
        boxes.append((o, s))
    return shape, boxes


@given(_box_sets())
def test_tiling_check_agrees_with_counting(case: tuple[tuple[int, ...], list[Any]]) -> None:
    shape, boxes = case
    if _tiles_by_counting(shape, boxes):
        _check(shape, boxes)
    else:
        with pytest.raises(CheckpointFormatError):
            _check(shape, boxes)


def test_tiling_check_scales_to_many_pieces() -> None:
    n = 20_000  # slices along one dimension: sort-based
    boxes = [((i, 0), (1, 8)) for i in range(n)]
    _check((n, 8), boxes[::-1])
    g = 150  # a 2-D grid of 22,500 pieces: grid cells, not pairwise comparisons
    _check((g * 2, g * 3), [((i * 2, j * 3), (2, 3)) for i in range(g) for j in range(g)])
    with pytest.raises(CheckpointFormatError, match="more than once"):
        _check((g * 2, g * 3), [((i * 2, j * 3), (2, 3)) for i in range(g) for j in range(g)]
               [:-1] + [((0, 0), (2, 3))])


def test_irregular_tilings_are_checked_exactly() -> None:
    # A pinwheel: no product grid, 5 pieces.
    boxes = [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((2, 0), (1, 2)), ((1, 2), (2, 1)),
             ((1, 1), (1, 1))]
    _check((3, 3), boxes)
    with pytest.raises(CheckpointFormatError):
        _check((3, 3), boxes[:-1] + [((1, 1), (1, 1)), ((1, 1), (1, 1))][:1] + [((0, 0), (1, 1))])


# ------------------------------------------------------------------------------- codec fields


def _chunk0(d: dict[str, Any], fqn: str = "w") -> list[Any]:
    return d["items"][fqn]["pieces"][0]["segments"][0]["chunks"][0]  # type: ignore[no-any-return]


def _codec(d: dict[str, Any], fqn: str = "w") -> list[Any]:
    return d["items"][fqn]["pieces"][0]["segments"][0]["codec"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: _codec(d).__setitem__(0, "lz4"), "unknown codec"),
        (lambda d: _codec(d).__setitem__(3, "shuffle"), "unknown transform"),
        (lambda d: _codec(d).__setitem__(1, 99), "codec[1]: 99 is outside"),
        (lambda d: _codec(d).__setitem__(1, True), "codec[1]: must be an integer"),
        (lambda d: _codec(d).__setitem__(2, 2), "do not fit dtype float32"),
        (lambda d: _codec(d).__setitem__(3, "group"), "do not fit dtype float32"),
        (lambda d: _codec(d, "i").__setitem__(3, "group"), "do not fit dtype int8"),
        (lambda d: _chunk0(d).__setitem__(3, 0), "chunks[0][3]: transform code 0 disagrees"),
        (lambda d: _chunk0(d).__setitem__(3, 7), "chunks[0][3]: transform code 7"),
        (lambda d: _chunk0(d).__setitem__(4, _chunk0(d)[4][:-2]), "chunks[0][4]: must list 4"),
        (lambda d: _chunk0(d)[4].__setitem__(0, 2), "plane 0 (mode 2"),
        (lambda d: _chunk0(d)[4].__setitem__(1, _chunk0(d)[4][1] + 1), "plane 0"),
        (lambda d: _chunk0(d).__setitem__(2, 1 << 64), "chunks[0][2]: xxh64"),
        (lambda d: _chunk0(d).__setitem__(2, -1), "chunks[0][2]: xxh64"),
        (lambda d: _chunk0(d).__setitem__(1, _format.MAX_CHUNK_BYTES + 1), "chunks[0][1]"),
    ],
)
def test_codec_fields_are_checked(ckpt: Path, mutate: Callable[[Any], Any], needle: str) -> None:
    _format.rewrite_metadata(ckpt, mutate)
    _refused(ckpt, needle)


def test_chunk_layout_matches_the_writer(raw_ckpt: Path, ckpt: Path) -> None:
    for path in (raw_ckpt, ckpt):
        index = _format.read_index(path)
        for t in index.tensors.values():
            for p in t.pieces:
                for _, _, params, chunks in p.segments:
                    e = params.elem_size
                    for _, raw_len, _, tcode, planes in chunks:
                        if params.codec == "none":
                            assert (tcode, planes) == (0, (0, raw_len))
                        else:
                            assert len(planes) == 2 * (e if tcode else 1)
    _format.rewrite_metadata(raw_ckpt, lambda d: _chunk0(d)[4].__setitem__(0, 1))
    _refused(raw_ckpt, "plane 0 (mode 1")  # codec none stores no zstd plane
    _format.rewrite_metadata(raw_ckpt, lambda d: _codec(d).__setitem__(1, 3))
    _refused(raw_ckpt, "codec 'none' is stored as")


# ------------------------------------------------------------------------------- absurd values


def test_absurd_shape_is_refused(ckpt: Path) -> None:
    _format.rewrite_metadata(ckpt, lambda d: d["items"]["w"].__setitem__("shape", [1 << 40] * 2))
    _refused(ckpt, "items['w'].shape", "more than")


def test_huge_bytes_item_with_a_small_file_is_refused(ckpt: Path) -> None:
    def claim(d: dict[str, Any]) -> None:
        item = d["items"]["extra"]
        chunk = item["segments"][0]["chunks"][0]
        chunk[1] = 1 << 40  # one chunk claiming 1 TiB of raw bytes
        item["nbytes"] = 1 << 40

    _format.rewrite_metadata(ckpt, claim)
    _refused(ckpt, "items['extra'].segments[0].chunks[0][1]")


def test_many_records_pointing_at_one_frame_are_refused(ckpt: Path) -> None:
    def bomb(d: dict[str, Any]) -> None:
        item = d["items"]["extra"]
        (seg,) = item["segments"]
        seg["chunks"] = seg["chunks"][:1] * 16384
        item["nbytes"] = 16384 * seg["chunks"][0][1]

    _format.rewrite_metadata(ckpt, bomb)
    _refused(ckpt, "overlap")


def test_data_files_are_their_chunks_back_to_back(ckpt: Path) -> None:
    (name,) = _doc(ckpt)["files"]
    with open(ckpt / name, "ab") as f:
        f.write(b"\0" * 10)
    _format.rewrite_metadata(ckpt, lambda d: d["files"].__setitem__(name, d["files"][name] + 10))
    _refused(ckpt, f"files[{name!r}]", "chunks end at")


def test_metadata_size_limit(ckpt: Path) -> None:
    with open(_meta(ckpt), "r+b") as f:
        f.truncate(_format.MAX_METADATA_BYTES + 1)  # sparse: nothing is read
    _refused(ckpt, str(_meta(ckpt)), f"more than the {_format.MAX_METADATA_BYTES} bytes")


@pytest.mark.parametrize("limit", ["MAX_ITEMS", "MAX_CHUNKS", "MAX_PIECES", "MAX_FILES"])
def test_count_limits(ckpt: Path, limit: str) -> None:
    # The reader's limits lowered (the real ones take documents of millions of entries).
    with pytest.raises(CheckpointFormatError, match="more than 0"):
        _C.parse_pyckpt_index(_meta(ckpt).read_bytes(), str(_meta(ckpt)), limits={limit: 0})


def test_writer_chunk_size_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        pyckpt.Writer(tmp_path, chunk_bytes=_format.MAX_CHUNK_BYTES + 4096)
    monkeypatch.setenv("PYCKPT_CHUNK_BYTES", str(_format.MAX_CHUNK_BYTES + 4096))
    from pyckpt import _knobs

    with pytest.raises(ValueError, match="PYCKPT_CHUNK_BYTES"):
        _knobs.chunk_bytes()


# ------------------------------------------------------------------------------- entry points


def test_every_entry_point_validates_through_read_index(ckpt: Path, tmp_path: Path) -> None:
    _format.rewrite_metadata(ckpt, lambda d: d["items"]["w"]["pieces"][0].__setitem__("x", 1))
    calls: list[Callable[[], Any]] = [
        lambda: pyckpt.Reader(ckpt).read_metadata(),
        lambda: pyckpt.load({"w": torch.zeros(ROWS, COLS)}, ckpt),
        lambda: tools.summarize(ckpt),
        lambda: tools.verify(ckpt),
        lambda: tools.bytes_per_rank(ckpt),
        lambda: tools.convert(ckpt, tmp_path / "out"),
        lambda: pyckpt.consolidate(ckpt, tmp_path / "st"),
    ]
    for call in calls:
        with pytest.raises(CheckpointFormatError, match=r"pieces\[0\]\.x: unknown key"):
            call()


# ------------------------------------------------------------------------------- fuzzing


class _Dup:
    """An object that repeats its first key, for the serializer below."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj = obj


def _dump(node: Any) -> str:
    if isinstance(node, _Dup):
        (k, v), *rest = node.obj.items() or [("k", 0)]
        pairs = [(k, v), (k, v), *rest]
        return "{" + ",".join(f"{json.dumps(a)}:{_dump(b)}" for a, b in pairs) + "}"
    if isinstance(node, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_dump(v)}" for k, v in node.items()) + "}"
    if isinstance(node, list):
        return "[" + ",".join(_dump(v) for v in node) + "]"
    return json.dumps(node)


_VALUES: list[Any] = [None, True, False, 0, 1, -1, 2, 3, 4096, 1 << 63, 1 << 64, 1.5, 0.0, "",
                      "x", "none", "zstd", "group", "bytes", "tensor", "0-0.000000000000.pyckpt",
                      "../evil", [], [0], [0, 0], {}, {"__tuple__": 5}, {"__tuple__": []}]


def _mutate(doc: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    where = paths(doc)[1:]
    path = where[int(rng.integers(len(where)))]
    parent: Any = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    value = parent[key]
    op = ["set", "delete", "duplicate", "retype", "flip"][int(rng.integers(5))]
    if op == "set":
        parent[key] = copy.deepcopy(_VALUES[int(rng.integers(len(_VALUES)))])
    elif op == "delete":
        del parent[key]
    elif op == "duplicate":
        if isinstance(value, dict):
            parent[key] = _Dup(value)
        elif isinstance(parent, list):
            parent.insert(key, copy.deepcopy(value))
        else:
            parent[key] = [value, value]
    elif op == "retype":
        parent[key] = [str(value), [value], {"v": value}, float(value) if type(value) is int
                       else value][int(rng.integers(4))]
    elif isinstance(value, bool):
        parent[key] = not value
    elif isinstance(value, int):
        parent[key] = value + int(rng.choice([-1, 1, 1 << int(rng.integers(63))]))
    elif isinstance(value, str):
        parent[key] = value[:-1] + chr(ord(value[-1]) ^ 1) if value else "a"
    elif isinstance(value, list):
        parent[key] = value[::-1]
    return doc


def _layout(index: _format.CheckpointIndex) -> Any:
    """Where every stored byte is and how it decodes; free-form fields are left out."""

    def segs(segments: list[Any]) -> Any:
        return [(os.path.basename(p), b, (c.codec, c.elem_size, c.transform),
                 [(ch[0], ch[1], ch[3], ch[4]) for ch in cs])
                for p, b, c, cs in segments]

    return (
        sorted(index.files.items()),
        [(_format.DTYPE_SIZES[t.dtype], t.shape,
          [(p.offsets, p.sizes, p.nbytes, segs(p.segments)) for p in t.pieces])
         for t in index.tensors.values()],
        [(b.nbytes, segs(b.segments)) for b in index.bytes_items.values()],
    )


def _decode_all(index: _format.CheckpointIndex) -> None:
    pool = _C.ThreadPool(1)
    try:
        pieces = [(b.segments, b.nbytes) for b in index.bytes_items.values()] + [
            (p.segments, p.nbytes) for t in index.tensors.values() for p in t.pieces]
        for segments, nbytes in pieces:
            if nbytes:
                buf = np.empty(nbytes, dtype=np.uint8)
                _C.read_requests([("x", segments, 0, nbytes, buf.ctypes.data)], pool)
    finally:
        pool.shutdown()


@pytest.mark.parametrize("compression", ["zstd", None])
def test_structural_mutations_are_refused_or_harmless(tmp_path: Path,
                                                      compression: str | None) -> None:
    _save(tmp_path, compression)
    original = _doc(tmp_path)
    expect = _layout(_format.read_index(tmp_path))
    rng = np.random.default_rng(1234)
    outcomes = {"refused": 0, "accepted": 0}
    for _ in range(300):
        doc = _mutate(original, rng)
        _meta(tmp_path).write_bytes(_seal(_dump(doc).encode()))  # checksum recomputed
        try:
            index = _format.read_index(tmp_path)
        except PyckptError:
            outcomes["refused"] += 1
            continue
        except FileNotFoundError as e:  # a listed data file that does not exist
            assert os.path.dirname(e.filename) == str(tmp_path)
            outcomes["refused"] += 1
            continue
        outcomes["accepted"] += 1
        assert _layout(index) == expect, doc
        try:
            _decode_all(index)
        except (CheckpointFormatError, pyckpt.ChecksumError):
            pass  # e.g. a changed chunk checksum: found when the data is read
    assert outcomes["refused"] > 150 and outcomes["accepted"] > 10, outcomes


def test_any_byte_flip_is_refused(ckpt: Path) -> None:
    raw = _meta(ckpt).read_bytes()
    rng = np.random.default_rng(99)
    positions = sorted(set(rng.integers(0, len(raw), 300).tolist())
                       | set(range(len(raw) - 48, len(raw))) | set(range(48)))
    for pos in positions:
        damaged = bytearray(raw)
        damaged[pos] ^= int(rng.integers(1, 256))
        _meta(ckpt).write_bytes(bytes(damaged))
        with pytest.raises(CheckpointFormatError):
            _format.read_index(ckpt)
        _meta(ckpt).write_bytes(raw[:pos])  # truncated
        with pytest.raises(CheckpointFormatError):
            _format.read_index(ckpt)


def test_index_shares_repeated_values(raw_ckpt: Path) -> None:
    """Memory: one path string per data file, one tuple per raw plane layout, no lists."""
    index = _format.read_index(raw_ckpt)
    segments = [s for t in index.tensors.values() for p in t.pieces for s in p.segments]
    assert len({id(s[0]) for s in segments}) == 1
    chunks = [c for s in segments for c in s[3]]
    full = [c for c in chunks if c[1] == CHUNK]
    assert len(full) > 10 and len({id(c[4]) for c in full}) == 1
    assert len({id(c[1]) for c in full}) == 1
    assert all(type(c) is tuple and type(c[4]) is tuple for c in chunks)
