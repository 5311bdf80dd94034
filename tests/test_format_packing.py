"""The packing check of pyckpt.json's data files (each file is its chunks back to back): the
reader's verdict and message on any layout, the same as the Python validator's (its oracle)."""

from __future__ import annotations

import json
import random

from _index_compare import both_readers

from pyckpt import _C

_NAME = "0-0.0123456789ab.pyckpt"


def _doc(ranges: list[tuple[int, int]], size: int) -> bytes:
    """A version-2 document of one bytes item whose chunks (codec none) are stored at
    ``ranges`` ([begin, end) each, in this order) of one data file of ``size`` bytes."""
    chunks = [[a, b - a, 0, 0, [0, b - a]] for a, b in ranges]
    segments = [{"file": _NAME, "raw_begin": 0, "codec": ["none", 0, 1, "none"],
                 "chunks": chunks}] if chunks else []
    doc = {"format": "pyckpt", "version": 2, "created_by": "test", "save_id": "0123456789ab",
           "dcp_version": None, "storage_meta": {"modules": []}, "planner_data": None,
           "files": {_NAME: size},
           "items": {"b": {"type": "bytes", "nbytes": sum(b - a for a, b in ranges),
                           "segments": segments}}}
    head = json.dumps(doc, separators=(",", ":")).encode()[:-1]
    return head + b',"checksum":"xxh64:' + b"%016x" % _C.xxh64(head) + b'"}'


def _verdict(ranges: list[tuple[int, int]], size: int) -> str:
    native, reference = both_readers(_doc(ranges, size))
    assert native == reference, (ranges, size)
    return "ok" if native[0] == "index" else str(native[2])


def test_packing_verdicts_match_the_oracle() -> None:
    rng = random.Random(0)
    failures = 0
    for _ in range(1500):
        pairs, pos = [], 0
        for _ in range(rng.randint(0, 6)):
            pos = max(0, pos + rng.choice([0, 0, 0, 1, -1]))  # packed, a gap or an overlap
            n = rng.randint(1, 5)
            pairs.append((pos, pos + n))
            pos += n
        rng.shuffle(pairs)
        failures += _verdict(pairs, max(0, pos + rng.choice([0, 0, 1, -1]))) != "ok"
    assert 300 < failures < 1450  # both verdicts occur often


def test_packing_messages_name_the_gap_and_the_end() -> None:
    gap = _verdict([(0, 4), (6, 8)], 8)
    assert "items['b'].segments[0].chunks[1]: bytes [4, 6) of " + _NAME + " belong to no chunk" \
        in gap
    overlap = _verdict([(0, 4), (3, 8)], 8)
    assert "stored bytes at offset 3" in overlap and "which end at 4" in overlap
    short = _verdict([(0, 4)], 8)
    assert f"files['{_NAME}']: records 8 bytes, its chunks end at 4" in short
    empty = _verdict([], 8)
    assert "8 bytes but no chunk is stored in it" in empty
