"""Native safetensors header parser/emitter: round trips and agreement with the safetensors package."""

from __future__ import annotations

import json
import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyckpt import _C, CheckpointFormatError

DTYPES = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16",
          "I32", "U32", "F32", "C64", "F64", "I64", "U64"]

NAMES = st.text(min_size=1, max_size=12).filter(lambda s: s != "__metadata__")
SPEC = st.tuples(NAMES, st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=4))


@given(st.lists(SPEC, max_size=8, unique_by=lambda t: t[0]),
       st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
def test_emit_then_parse_round_trips(specs, metadata):
    header, layout, nbytes = _C.safetensors_header(specs, list(metadata.items()))
    assert len(header) % 8 == 0
    n = struct.unpack("<Q", header[:8])[0]
    assert n == len(header) - 8
    obj = json.loads(header[8:])  # the standard library agrees it is JSON
    assert [k for k in obj if k != "__metadata__"] == sorted(s[0] for s in specs)
    parsed = _C.parse_safetensors_header(header[8:], len(header) + nbytes)
    assert parsed["metadata"] == metadata
    by_name = {t[0]: t for t in parsed["tensors"]}
    for name, dt, shape in specs:
        assert by_name[name][1:3] == (dt, tuple(shape))
    assert [(t[0], t[3], t[4]) for t in sorted(parsed["tensors"], key=lambda t: t[0])] == [
        tuple(x) for x in layout
    ]


def test_reads_files_written_by_safetensors(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    path = str(tmp_path / "x.safetensors")
    save_file({"a": torch.zeros(3, 2), "b": torch.ones(5, dtype=torch.bool),
               "c": torch.zeros((), dtype=torch.float64)}, path, metadata={"k": "v"})
    h = _C.read_safetensors_header(path)
    assert h["metadata"] == {"k": "v"}
    assert h["file_size"] == os.path.getsize(path)
    assert {t[0]: t[1:3] for t in h["tensors"]} == {
        "a": ("F32", (3, 2)), "b": ("BOOL", (5,)), "c": ("F64", ())}


@pytest.mark.parametrize("blob,match", [
    (b"", "too short"),
    (b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "holds only 2 bytes"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00{}" + b"\x00" * 4, "data section holds 4 bytes"),
])
def test_file_level_checks(tmp_path, blob, match):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointFormatError, match=match):
        _C.read_safetensors_header(str(path))


def test_missing_file_is_file_not_found(tmp_path):
    missing = str(tmp_path / "none.safetensors")
    with pytest.raises(FileNotFoundError) as info:
        _C.read_safetensors_header(missing)
    assert info.value.filename == missing


def test_check_tiling_errors():
    _C.check_tiling("t", [4, 4], [([0, 0], [4, 2], "a"), ([0, 2], [4, 2], "b")])
    with pytest.raises(CheckpointFormatError, match="'a'.*overlaps.*'b'"):
        _C.check_tiling("t", [4, 4], [([0, 0], [4, 3], "a"), ([0, 2], [4, 2], "b")])
    with pytest.raises(CheckpointFormatError, match="cover 8 of 16"):
        _C.check_tiling("t", [4, 4], [([0, 0], [4, 2], "a")])
    with pytest.raises(CheckpointFormatError, match="leaves the tensor"):
        _C.check_tiling("t", [4, 4], [([0, 3], [4, 2], "a")])
    with pytest.raises(CheckpointFormatError, match="rank 1"):
        _C.check_tiling("t", [4, 4], [([0], [4], "a")])
