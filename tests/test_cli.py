"""The pyckpt command line: inspect, verify, convert, bench (consolidate: test_consolidate)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import pyckpt
from pyckpt import _format
from pyckpt.cli import main


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    sd = {"layer.weight": (torch.randn(128, 64) * 0.02).to(torch.bfloat16),
          "layer.bias": torch.randn(64), "step": 4}
    path = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=pyckpt.Writer(path, compression="zstd", chunk_bytes=4096))
    return path


def test_inspect(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "2 tensors, 1 other values" in out
    assert "layer.weight" in out and "bfloat16" in out and "zstd/group_rotl1" in out
    assert "by rank:    1 rank(s), max/mean 1.000: 0: " in out


def test_inspect_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path)]) == 1
    assert "pyckpt.json is missing" in capsys.readouterr().err


def test_verify_ok_and_corrupt(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(ckpt)]) == 0
    assert capsys.readouterr().out.startswith("OK")
    index = _format.read_index(ckpt)
    path, _, _, chunks = index.tensors["layer.weight"].pieces[0].segments[0]
    with open(path, "r+b") as f:
        f.seek(chunks[1][0] + 1)
        b = f.read(1)
        f.seek(chunks[1][0] + 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert main(["verify", str(ckpt)]) == 2
    out = capsys.readouterr().out
    assert "CORRUPT layer.weight" in out and "FAILED" in out


def test_convert_both_ways(ckpt: Path, tmp_path: Path) -> None:
    assert main(["convert", str(ckpt), str(tmp_path / "dcp")]) == 0
    assert (tmp_path / "dcp" / ".metadata").is_file()
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "back"),
                 "--compression", "none"]) == 0
    a = {"layer.weight": torch.zeros(128, 64, dtype=torch.bfloat16), "layer.bias": torch.zeros(64),
         "step": 0}
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    dcp.load(a, storage_reader=pyckpt.Reader(ckpt))
    dcp.load(b, storage_reader=pyckpt.Reader(tmp_path / "back"))
    assert torch.equal(a["layer.weight"], b["layer.weight"])
    assert torch.equal(a["layer.bias"], b["layer.bias"]) and b["step"] == 4


def test_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--size-gib", "0.004", "--repeats", "1", "--methods",
               "pyckpt,pyckpt+zstd,dcp-t1", "--workdir", str(tmp_path),
               "--json", str(tmp_path / "r.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "pyckpt+zstd" in out and "dcp-t1" in out and "NO" not in out.split("exact", 1)[1]
    assert (tmp_path / "r.json").is_file()
