"""The metadata reader (csrc/core/pyckpt_index.cpp) against the Python validator kept as its
oracle (tests/_index_oracle.py).

The reader is pyckpt's one metadata reader: every version, any key order, every error worded
with the file and the key path. It must accept exactly the documents the oracle accepts, read
them alike, and refuse the others with the same error type and message. The suite's conftest
compares every document the suite reads; this module checks the tables and limits the two
share, real checkpoints, older versions and other spellings, and thousands of mutated
documents.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _docwalk import get, paths
from _index_compare import both_readers, native_index, plain
from _index_oracle import oracle_index

import pyckpt
from pyckpt import _C, _format, _format_spec
from pyckpt.errors import CheckpointFormatError


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(48, 100, generator=g) * 0.02,
        "h": (torch.randn(3000, generator=g) * 0.02).to(torch.bfloat16),
        "i": torch.randint(-9, 9, (700,), dtype=torch.int64, generator=g),
        "c": torch.randn(5, 3, dtype=torch.complex64, generator=g),
        "f8": torch.randn(33, generator=g).to(torch.float8_e4m3fn),
        "b": torch.rand(17, generator=g) > 0.5,
        "s": torch.tensor(2.5, dtype=torch.float64),
        "e": torch.zeros(0, 3),
        "cl": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "step": 7,
        "extra": {"lr": 0.5, "names": ["a", "b"], "t": (1, 2)},
    }


@pytest.fixture(params=["zstd", None])
def ckpt(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    dcp.save(_state(), storage_writer=pyckpt.Writer(path, compression=request.param,
                                                     chunk_bytes=4096, fsync=False))
    return path


def _native_outcomes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, per call of the native reader, whether it accepted the document."""
    outcomes: list[bool] = []
    parse = _C.parse_pyckpt_index

    def recorded(raw: bytes, origin: str, **options: Any) -> Any:
        try:
            x = parse(raw, origin, **options)
        except CheckpointFormatError:
            outcomes.append(False)
            raise
        outcomes.append(True)
        return x

    monkeypatch.setattr(_C, "parse_pyckpt_index", recorded)
    return outcomes


def test_tables_and_limits_match_the_format_spec() -> None:
    limits, dtypes = _C.pyckpt_index_tables()
    for name, value in limits.items():
        assert getattr(_format_spec, name) == value, name
    assert dtypes.keys() == _format_spec.DTYPE_SIZES.keys()
    for name, (size, planes, transform) in dtypes.items():
        assert size == _format_spec.DTYPE_SIZES[name], name
        assert (planes, transform) == _format_spec._GROUPING.get(name, (1, "none")), name


def test_checkpoints_this_pyckpt_writes_are_read_as_the_oracle_reads_them(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = (ckpt / _format.METADATA_FILE).read_bytes()
    meta = str(ckpt / _format.METADATA_FILE)
    assert plain(native_index(raw, meta)) == plain(oracle_index(raw, meta))
    outcomes = _native_outcomes(monkeypatch)
    index = _format.read_index(ckpt)
    assert outcomes == [True] and index.path == str(ckpt)
    assert len(index.tensors) == 9 and len(index.bytes_items) == 4  # step, extra.*
    assert any(len(p.segments[0][3]) > 1 for p in index.tensors["w"].pieces)  # several chunks
    sd = _state()
    into: dict[str, Any] = {k: torch.zeros_like(v) for k, v in sd.items()
                            if isinstance(v, torch.Tensor)}
    into.update(step=0, extra={"lr": 0.0, "names": None, "t": None})
    pyckpt.load(into, ckpt)
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    assert all(torch.equal(bits(into[k]), bits(v)) for k, v in sd.items()
               if isinstance(v, torch.Tensor))
    assert into["step"] == 7 and into["extra"] == sd["extra"]
    assert outcomes and all(outcomes)  # the load read it natively too


@pytest.mark.parametrize("compression", ["zstd", None])
@pytest.mark.parametrize("state", ["scalar-only", "scalar-first"])
def test_a_scalar_read_first_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             compression: str | None, state: str) -> None:
    # The reader's tables are empty when the first tensor (a scalar: no dimensions) is read:
    # nothing may index into them then (the sanitizer stage runs this file).
    sd = {"a": torch.tensor(1.5)}
    if state == "scalar-first":
        sd["b"] = torch.randn(40)
    path = tmp_path / "ck"
    pyckpt.save(sd, path, compression=compression, fsync=False)
    raw = (path / _format.METADATA_FILE).read_bytes()
    native, reference = both_readers(raw)
    assert native == reference and native[0] == "index"
    outcomes = _native_outcomes(monkeypatch)
    assert len(_format.read_index(path).tensors) == len(sd) and outcomes == [True]
    into = {k: torch.zeros_like(v) for k, v in sd.items()}
    pyckpt.load(into, path)
    assert all(torch.equal(into[k], v) for k, v in sd.items())


def test_older_versions_and_other_spellings_are_read(ckpt: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 2, version 1 (no checksum) and every object's members in reverse order with
    whitespace between tokens: read by the reader, alike."""
    meta = ckpt / _format.METADATA_FILE
    expect = plain(_format.read_index(ckpt))
    doc = json.loads(meta.read_bytes())
    doc.pop("checksum")

    def reverse(node: Any, entries: bool = False) -> Any:
        """Members of every object reversed (the entries of items and files, whose order is the
        index's, and planner_data, a value read as is, kept)."""
        if isinstance(node, dict):
            pairs = list(node.items()) if entries else list(reversed(node.items()))
            return {k: v if k == "planner_data" else reverse(v, k in ("items", "files"))
                    for k, v in pairs}
        return [reverse(v) for v in node] if isinstance(node, list) else node

    body = json.dumps(reverse(doc), indent=1).encode()
    raw = body[:-1] + b',"checksum":"xxh64:' + b"%016x" % _C.xxh64(body[:-1]) + b'"}'
    meta.write_bytes(raw)
    native, reference = both_readers(raw)
    assert native == reference and native[0] == "index"
    outcomes = _native_outcomes(monkeypatch)
    assert plain(_format.read_index(ckpt)) == expect and outcomes == [True]
    for version in (2, 1):
        old = json.loads(json.dumps(doc))
        _format.toggle_chunk_places(old)  # versions 1 and 2: checksums not bound to places
        old["version"] = version
        raw = _seal(old) if version == 2 else json.dumps(old, separators=(",", ":")).encode()
        meta.write_bytes(raw)
        native, reference = both_readers(raw)
        assert native == reference and native[0] == "index"
        index = _format.read_index(ckpt)
        assert index.version == version and plain(index)[:9] == expect[:9]
    assert outcomes == [True, True, True]


def test_damaged_checksum_is_reported_before_anything(ckpt: Path) -> None:
    meta = ckpt / _format.METADATA_FILE
    raw = bytearray(meta.read_bytes())
    raw[10] ^= 1
    meta.write_bytes(bytes(raw))
    with pytest.raises(CheckpointFormatError, match="metadata checksum mismatch"):
        _format.read_index(ckpt)


def _seal(doc: Any) -> bytes:
    return _format.encode_metadata(doc)


# ---------------------------------------------------------------- mutations: read alike


_VALUES = [0, 1, -1, 2, 3, 4, 7, 8, 4095, 4096, 4097, 2**31, 2**60, 2**60 + 1, 2**62, 2**63 - 1,
           2**63, 2**64 - 1, 2**64, -(2**17), 23, True, False, None, 1.0, "", "zstd", "none",
           "group", "group_rotl1", "float32", "bfloat16", "uint8", "channels_last", [], {}, [0], [1, 2],
           {"__tuple__": [1]}, {"__tuple__": 1}]


def _mutate(doc: dict[str, Any], rng: random.Random) -> None:
    """One random change: a value replaced, a key dropped or added, a list entry dropped,
    duplicated or swapped, or a number nudged."""
    where = [p for p in paths(doc) if p and p[-1] != "checksum"]
    path = rng.choice(where)
    parent, key = get(doc, path[:-1]), path[-1]
    value = parent[key]
    kind = rng.randrange(6)
    if kind == 0:
        parent[key] = rng.choice(_VALUES)
    elif kind == 1 and type(value) is int:
        parent[key] = value + rng.choice((-4096, -1, 1, 4096, 2**32))
    elif kind == 2 and isinstance(parent, dict):
        del parent[key]
    elif kind == 3 and isinstance(parent, dict):
        parent[rng.choice(["x", "type", "file", "__tuple__", "offsets"])] = rng.choice(_VALUES)
    elif kind == 4 and isinstance(parent, list):
        parent.insert(key, value if rng.random() < 0.5 else json.loads(json.dumps(value)))
    elif kind == 5 and isinstance(parent, list) and len(parent) > 1:
        j = rng.randrange(len(parent))
        parent[key], parent[j] = parent[j], parent[key]
    else:
        parent[key] = rng.choice(_VALUES)


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["zstd", None])
def test_mutated_documents_never_accepted_more_or_read_differently(
        tmp_path: Path, compression: str | None) -> None:
    """2,000 documents a step away from a real one (resealed, so each reaches both readers):
    both accept and read them alike, or both refuse them with the same error and message."""
    path = tmp_path / "ck"
    dcp.save(_state(), storage_writer=pyckpt.Writer(path, compression=compression,
                                                     chunk_bytes=4096, fsync=False))
    meta = path / _format.METADATA_FILE
    original = json.loads(meta.read_bytes())
    original.pop("checksum")
    rng = random.Random(7)
    accepted = refused_both = 0
    for n in range(2000):
        doc = json.loads(json.dumps(original))
        for _ in range(1 + n % 3):
            _mutate(doc, rng)
        raw = _seal(doc)
        native, reference = both_readers(raw)
        assert native == reference, (n, native[:3], reference[:3])
        accepted += native[0] == "index"
        refused_both += native[0] == "error"
    # Both outcomes are exercised: some mutations keep the document valid (a planner_data value,
    # created_by), most break it.
    assert accepted >= 20 and refused_both >= 1000, (accepted, refused_both)


def test_text_level_mutations_never_accepted_more(tmp_path: Path) -> None:
    """Bytes of the JSON text flipped, deleted or repeated (then resealed): spellings the
    writer never produces (escapes, whitespace, repeated keys, broken syntax), read alike."""
    path = tmp_path / "ck"
    dcp.save(_state(), storage_writer=pyckpt.Writer(path, chunk_bytes=4096, fsync=False))
    body = (path / _format.METADATA_FILE).read_bytes()[: -_format_spec._SEAL_LEN]
    rng = random.Random(11)
    accepted = 0
    for n in range(3000):
        text = bytearray(body)
        i = rng.randrange(len(text))
        op = n % 4
        if op == 0:
            text[i] = rng.choice(b'{}[]",:0129-. \\u"aetx\x00\xff\xc3')
        elif op == 1:
            del text[i: i + rng.randrange(1, 8)]
        elif op == 2:
            j = rng.randrange(len(text))
            text[i:i] = text[j: j + rng.randrange(1, 40)]
        else:
            text[i] ^= 1 << rng.randrange(8)
        head = bytes(text)
        raw = head + b',"checksum":"xxh64:' + b"%016x" % _C.xxh64(head) + b'"}'
        native, reference = both_readers(raw)
        assert native == reference, (n, native[:3], reference[:3])
        accepted += native[0] == "index"
    assert accepted >= 10, accepted


def test_many_tensors_and_pieces_read_alike(tmp_path: Path) -> None:
    """3,000 tensors: the packing and place-binding checks over many records."""
    path = tmp_path / "ck"
    sd = {f"layer.{i}.w": torch.full((4, 2), float(i)) for i in range(3000)}
    pyckpt.save(sd, path, compression=None, fsync=False)
    raw = (path / _format.METADATA_FILE).read_bytes()
    native, reference = both_readers(raw)
    assert native == reference and len(native[1][1]) == 3000


def test_irregular_and_overlapping_tilings(tmp_path: Path) -> None:
    """Pieces rewritten into a valid 2 x 2 grid read alike; an overlap or a gap is refused by
    both readers."""
    path = tmp_path / "ck"
    pyckpt.save({"w": torch.arange(16, dtype=torch.uint8).reshape(4, 4)}, path,
                compression=None, fsync=False)
    raw = (path / _format.METADATA_FILE).read_bytes()
    doc = json.loads(raw)
    doc.pop("checksum")
    [piece] = doc["items"]["w"]["pieces"]
    [seg] = piece["segments"]
    [rec] = seg["chunks"]
    data = (path / seg["file"]).read_bytes()[rec[0]: rec[0] + 16]
    full = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(4, 4)

    def grid(boxes: list[tuple[int, int, int, int]]) -> bytes:
        blob, pieces = b"", []
        for r0, c0, nr, nc in boxes:
            block = full[r0:r0 + nr, c0:c0 + nc].contiguous().numpy().tobytes()
            seed = _format_spec.chunk_place_seed("w", (r0, c0))
            key = _format_spec.chunk_place_key(seed, 0)
            pieces.append({"offsets": [r0, c0], "sizes": [nr, nc], "segments": [{
                "file": seg["file"], "raw_begin": 0, "codec": ["none", 0, 1, "none"],
                "chunks": [[len(blob), len(block), _C.xxh64(block) ^ key, 0, [0, len(block)]]]}]})
            blob += block
        (path / seg["file"]).write_bytes(blob)
        doc["files"][seg["file"]] = len(blob)
        doc["items"]["w"]["pieces"] = pieces
        return _seal(doc)

    good = grid([(0, 0, 2, 3), (0, 3, 2, 1), (2, 0, 2, 1), (2, 1, 2, 3)])  # not a product grid
    native, reference = both_readers(good)
    assert native == reference and native[0] == "index"
    assert [p[:2] for p in native[1][1][0][6]] == [((0, 0), (2, 3)), ((0, 3), (2, 1)),
                                                   ((2, 0), (2, 1)), ((2, 1), (2, 3))]
    for bad in ([(0, 0, 2, 3), (0, 2, 2, 2), (2, 0, 2, 4)],   # overlap
                [(0, 0, 2, 3), (2, 0, 2, 4)]):                # gap
        native, reference = both_readers(grid(bad))
        assert native == reference and native[:2] == ("error", "CheckpointFormatError")


def test_the_reader_names_the_problem(ckpt: Path) -> None:
    _format.rewrite_metadata(ckpt, lambda d: d["items"]["w"].__setitem__("dtype", "float33"))
    raw = (ckpt / _format.METADATA_FILE).read_bytes()
    with pytest.raises(pyckpt.UnsupportedDtypeError, match=r"m: items\['w'\]\.dtype: .*float33"):
        _C.parse_pyckpt_index(raw, "m")
    with pytest.raises(pyckpt.UnsupportedDtypeError, match="float33"):
        _format.read_index(ckpt)


def test_limits_are_enforced(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    pyckpt.save({"w": torch.zeros(3)}, path, compression=None, fsync=False)
    doc = json.loads((path / _format.METADATA_FILE).read_bytes())
    doc.pop("checksum")
    doc["items"]["w"]["shape"] = [1] * (_format_spec.MAX_NDIM + 1)
    with pytest.raises(CheckpointFormatError, match=r"shape: has 65 entries, more than 64"):
        _C.parse_pyckpt_index(_seal(doc), "m")
    doc["items"]["w"]["shape"] = [2**61]
    with pytest.raises(CheckpointFormatError, match=r"shape\[0\]: must be an integer in"):
        _C.parse_pyckpt_index(_seal(doc), "m")


@pytest.mark.parametrize("limit", ["MAX_ITEMS", "MAX_FILES", "MAX_PIECES", "MAX_SEGMENTS",
                                   "MAX_CHUNKS"])
def test_count_limits_alike(ckpt: Path, limit: str) -> None:
    raw = (ckpt / _format.METADATA_FILE).read_bytes()
    native, reference = both_readers(raw, limits={limit: 0})
    assert native == reference and native[0] == "error" and "more than 0" in native[2]


def test_backends_read_through_the_native_reader_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-memory backend (the manager's fast tier) validates pyckpt.json through the same
    reader as a directory, with its own data-file checks (the S3 backend shares the path:
    tests/test_s3.py runs under the conftest's comparison)."""
    from pyckpt.backends import memory

    url = "memory://native-index-test"
    sd = _state()
    pyckpt.save(sd, url, compression="zstd")
    try:
        outcomes = _native_outcomes(monkeypatch)
        into: dict[str, Any] = {k: torch.zeros_like(v) for k, v in sd.items()
                                if isinstance(v, torch.Tensor)}
        into.update(step=0, extra={"lr": 0.0, "names": None, "t": None})
        pyckpt.load(into, url)
        assert outcomes and all(outcomes)
        assert torch.equal(into["w"], sd["w"]) and into["step"] == 7
        backend = memory.MemoryBackend(url)
        del backend.files[next(n for n in backend.files if n.endswith(".pyckpt"))]
        with pytest.raises(FileNotFoundError, match="data file of checkpoint"):
            pyckpt.load(into, url)  # the backend's own check, after the reader accepted
        assert outcomes[-1] is True
    finally:
        memory.drop(url)
