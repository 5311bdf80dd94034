"""pyckpt.tools: inspect summary, verify, convert between DCP and pyckpt formats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import pyckpt
from pyckpt import _format, tools


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "w": (torch.randn(300, 200) * 0.02).to(torch.bfloat16),
        "b": torch.randn(200),
        "ids": torch.arange(1000, dtype=torch.int64),
        "meta": {"step": 12},
    }


def test_summarize(tmp_path: Path) -> None:
    dcp.save(_state(), storage_writer=pyckpt.Writer(tmp_path, compression="zstd"))
    s = tools.summarize(tmp_path)
    assert s.tensors == 3 and s.bytes_items == 1
    assert s.dtypes == {"bfloat16": 300 * 200 * 2, "float32": 800, "int64": 8000}
    assert s.stored_bytes == sum(p.stat().st_size for p in tmp_path.glob("*.pyckpt"))
    assert s.stored_bytes < s.raw_bytes
    assert s.largest[0][0] == "w"


def test_verify_clean_and_corrupted(tmp_path: Path) -> None:
    dcp.save(_state(), storage_writer=pyckpt.Writer(tmp_path, compression="zstd",
                                                     chunk_bytes=8192))
    report = tools.verify(tmp_path, threads=2)
    assert report.ok and report.items_checked == 4 and report.chunks_checked > 4
    index = _format.read_index(tmp_path)
    path, _, _, chunks = index.tensors["b"].pieces[0].segments[0]
    with open(path, "r+b") as f:
        f.seek(chunks[0][0])
        byte = f.read(1)
        f.seek(chunks[0][0])
        f.write(bytes([byte[0] ^ 1]))
    report = tools.verify(tmp_path)
    assert not report.ok
    assert list(report.errors) == ["b"] and "ChecksumError" in report.errors["b"]


def test_verify_missing_metadata(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        tools.verify(tmp_path)


def test_convert_roundtrip(tmp_path: Path) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"))
    assert tools.convert(tmp_path / "dcp", tmp_path / "pk") == "pyckpt"
    assert tools.convert(tmp_path / "pk", tmp_path / "back") == "dcp"
    for src, reader in ((tmp_path / "pk", pyckpt.Reader), (tmp_path / "back",
                                                         dcp.FileSystemReader)):
        out = {"w": torch.zeros(300, 200, dtype=torch.bfloat16), "b": torch.zeros(200),
               "ids": torch.zeros(1000, dtype=torch.int64), "meta": {"step": 0}}
        dcp.load(out, storage_reader=reader(src))
        for k in ("w", "b", "ids"):
            assert torch.equal(out[k], sd[k])
        assert out["meta"] == {"step": 12}


def test_convert_rejects_non_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        tools.convert(tmp_path, tmp_path / "out")


def test_bytes_per_rank_counts_only_this_saves_files(tmp_path: Path) -> None:
    dcp.save(_state(), storage_writer=pyckpt.Writer(tmp_path))
    (tmp_path / "7-0.0123456789ab.pyckpt").write_bytes(b"x" * 100)  # not listed by the metadata
    (data,) = (p for p in tmp_path.glob("0-0.*.pyckpt"))
    assert tools.bytes_per_rank(tmp_path) == {0: data.stat().st_size}
