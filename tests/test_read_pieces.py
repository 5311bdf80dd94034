"""Native file reads go out in calls of at most ``PYCKPT_READ_BYTES`` (default 128 KiB): Linux
reads a cold local file ahead of such calls, into large page-cache folios that later reads copy
from about twice as fast (BENCHMARKS.md, "Reads in 128 KiB pieces"). The read calls are counted
by the kernel (``syscr`` in ``/proc/self/io``), not timed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import pyckpt
from pyckpt import _C, _knobs


def _read_calls(fn: Callable[[], None]) -> int:
    def syscr() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("syscr:"))

    before = syscr()
    fn()
    return syscr() - before


@pytest.fixture(autouse=True)
def _default_after() -> object:
    yield
    _C.set_read_piece_bytes(_knobs.READ_BYTES)  # the knob is process-wide


def test_a_load_reads_in_calls_of_the_knobs_size(tmp_path: Path) -> None:
    sd = {"w": torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))}  # 4 MiB
    pyckpt.save(sd, tmp_path / "ck")  # one raw chunk of 4 MiB
    out = {"w": torch.zeros(1024, 1024)}
    with _knobs.override(read_bytes=4 << 20):
        whole = _read_calls(lambda: pyckpt.load(out, tmp_path / "ck"))
        assert _C.read_piece_bytes() == 4 << 20
    assert torch.equal(out["w"], sd["w"])
    out["w"].zero_()
    pieces = _read_calls(lambda: pyckpt.load(out, tmp_path / "ck"))
    assert _C.read_piece_bytes() == 128 << 10
    assert torch.equal(out["w"], sd["w"])
    # 32 calls of 128 KiB instead of one of 4 MiB; the metadata reads are the same both times.
    assert pieces - whole >= 28, (pieces, whole)


def test_an_export_reads_in_pieces_and_matches(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = {"a": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7, 5)}
    pyckpt.save(sd, tmp_path / "ck", compression="zstd")
    with _knobs.override(read_bytes=4096):
        res = pyckpt.consolidate(tmp_path / "ck", tmp_path / "hf", fsync=False)
        assert _C.read_piece_bytes() == 4096
    got = load_file(res.files[0])
    assert all(torch.equal(got[k], sd[k]) for k in sd)


def test_a_bad_value_is_refused_with_the_variables_name(tmp_path: Path) -> None:
    pyckpt.save({"w": torch.ones(4)}, tmp_path / "ck")
    with _knobs.override(read_bytes=100), pytest.raises(
        ValueError, match=r"PYCKPT_READ_BYTES='100' must be >= 4096"
    ):
        pyckpt.load({"w": torch.zeros(4)}, tmp_path / "ck")
    with pytest.raises(ValueError, match="at least 4096"):
        _C.set_read_piece_bytes(100)
