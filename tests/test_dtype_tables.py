"""The dtype tables of the Python layer and the native safetensors parser agree.

pyckpt keeps one element-size table per layer (``_format.DTYPE_SIZES`` for the checkpoint format,
``_consolidate.scan._ST_DTYPES`` for the torch -> safetensors names, the C++ ``safetensors`` table for
header parsing); this test ties them together so that none can drift.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from pyckpt import _C, _format
from pyckpt._consolidate.scan import _PACKED, _ST_DTYPES
from pyckpt.errors import CheckpointFormatError


def _header_file(path: Path, st_dtype: str, nbytes: int) -> Path:
    header = json.dumps({"t": {"dtype": st_dtype, "shape": [2], "data_offsets": [0, nbytes]}})
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(nbytes))
    return path


def test_every_format_dtype_is_a_torch_dtype_of_that_size() -> None:
    for name, size in _format.DTYPE_SIZES.items():
        dtype = getattr(torch, name)
        assert torch.empty(0, dtype=dtype).element_size() == size, name


@pytest.mark.parametrize("torch_name", sorted(_ST_DTYPES))
def test_native_safetensors_table_agrees(tmp_path: Path, torch_name: str) -> None:
    st_name = _ST_DTYPES[torch_name]
    # Two safetensors values: two torch elements, or one of a packed dtype (F4: two per byte).
    nbytes = 2 * _format.DTYPE_SIZES[torch_name] // _PACKED.get(torch_name, 1)
    header = _C.read_safetensors_header(str(_header_file(tmp_path / "ok.st", st_name, nbytes)))
    (name, dtype, shape, begin, end), = header["tensors"]
    assert (name, dtype, list(shape), end - begin) == ("t", st_name, [2], nbytes)
    # One byte more or less than two values is refused: the native size is the same.
    for wrong in (nbytes - 1, nbytes + 1):
        with pytest.raises(CheckpointFormatError):
            _C.read_safetensors_header(str(_header_file(tmp_path / "bad.st", st_name, wrong)))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated
def test_quantized_tensor_refusal_names_the_way_out(tmp_path) -> None:
    # The format has no quantizer fields: a qint8 tensor is refused before anything is written,
    # with a message saying what to store instead (the values and the quantizer parameters).
    import pyckpt

    q = torch.quantize_per_tensor(torch.linspace(-1, 1, 8), 0.01, 3, torch.qint8)
    with pytest.raises(pyckpt.UnsupportedDtypeError, match=r"'w'.*qint8.*int_repr\(\)"):
        pyckpt.save({"w": q}, tmp_path / "q")
    assert not (tmp_path / "q").exists()
    # The way out round-trips bit-exact.
    sd = {"w": q.int_repr(), "w_scale": torch.tensor(q.q_scale(), dtype=torch.float64),
          "w_zero_point": torch.tensor(q.q_zero_point())}
    pyckpt.save(sd, tmp_path / "q")
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    pyckpt.load(back, tmp_path / "q")
    again = torch._make_per_tensor_quantized_tensor(
        back["w"], float(back["w_scale"]), int(back["w_zero_point"]))
    assert torch.equal(again.int_repr(), q.int_repr()) and again.q_scale() == q.q_scale()
