"""The packing check of pyckpt.json's data files: the Python path for files with few chunks and
the numpy path for many give the same verdict and the same message on any layout."""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest

from pyckpt import _format_schema
from pyckpt.errors import CheckpointFormatError


class _Index:
    bytes_items: dict[str, Any] = {}
    tensors: dict[str, Any] = {}


def _verdict(ranges: array, size: int, python: bool, monkeypatch: pytest.MonkeyPatch) -> str:
    v = _format_schema._Validator("/ckpt", "/ckpt/pyckpt.json", 3)
    name = "0-0.0123456789ab.pyckpt"
    v.files, v.paths, v.ranges = {name: size}, {name: f"/ckpt/{name}"}, {name: ranges}
    monkeypatch.setattr(_format_schema, "_PACKING_IN_PYTHON", 1 << 30 if python else -1)
    try:
        v.check_packing(_Index())  # type: ignore[arg-type]
        return "ok"
    except CheckpointFormatError as e:
        return str(e)


def test_python_and_numpy_packing_checks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(0)
    failures = 0
    for _ in range(3000):
        pairs, pos = [], 0
        for _ in range(rng.randint(0, 6)):
            pos = max(0, pos + rng.choice([0, 0, 0, 1, -1]))  # packed, a gap or an overlap
            n = rng.randint(0, 5)
            pairs.append((pos, pos + n))
            pos += n
        rng.shuffle(pairs)
        ranges = array("Q", [x for p in pairs for x in p])
        size = max(0, pos + rng.choice([0, 0, 1, -1]))
        py = _verdict(ranges, size, True, monkeypatch)
        assert py == _verdict(ranges, size, False, monkeypatch), (pairs, size)
        failures += py != "ok"
    assert 500 < failures < 2900  # both verdicts occur often


def test_packing_messages_name_the_gap_and_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    gap = _verdict(array("Q", [0, 4, 6, 8]), 8, True, monkeypatch)
    assert "bytes [4, 6) of 0-0.0123456789ab.pyckpt belong to no chunk" in gap
    overlap = _verdict(array("Q", [0, 4, 3, 8]), 8, True, monkeypatch)
    assert "stored bytes at offset 3" in overlap and "which end at 4" in overlap
    short = _verdict(array("Q", [0, 4]), 8, True, monkeypatch)
    assert "records 8 bytes, its chunks end at 4" in short
    empty = _verdict(array("Q"), 8, True, monkeypatch)
    assert "8 bytes but no chunk is stored in it" in empty
