"""The named tuple types of ``pyckpt._C`` (csrc/bindings/records.cpp): every tuple a binding
takes or returns has one. The stub declares the same fields; outputs come as instances (chunk
and segment records excepted: plain tuples of their layout); inputs are accepted named or plain.
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import numpy as np
import pytest

import pyckpt
from pyckpt import _C

STUB = Path(pyckpt.__file__).with_name("_C.pyi")


def _stub_named_tuples() -> dict[str, tuple[list[str], int]]:
    """Class name -> (field names, number of fields with a default) of each NamedTuple."""
    out = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id == "NamedTuple" for b in node.bases
        ):
            fields = [s for s in node.body if isinstance(s, ast.AnnAssign)]
            names = [f.target.id for f in fields if isinstance(f.target, ast.Name)]
            out[node.name] = (names, sum(f.value is not None for f in fields))
    return out


STUB_TYPES = _stub_named_tuples()


def test_the_stub_declares_every_named_tuple_the_module_defines() -> None:
    runtime = {
        name for name, obj in vars(_C).items()
        if isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields")
    }
    assert runtime == set(STUB_TYPES)
    assert len(runtime) == 20


@pytest.mark.parametrize("name", sorted(STUB_TYPES))
def test_fields_match_the_stub_and_instances_behave_as_tuples(name: str) -> None:
    cls = getattr(_C, name)
    fields, optional = STUB_TYPES[name]
    assert list(cls._fields) == fields
    assert len(cls._field_defaults) == optional
    assert cls.__module__ == "pyckpt._C" and cls.__doc__
    values = tuple(range(len(fields)))
    rec = cls(**dict(zip(fields, values)))  # by keyword
    assert rec == values and isinstance(rec, tuple)
    assert pickle.loads(pickle.dumps(rec)) == rec
    assert type(pickle.loads(pickle.dumps(rec))) is cls


def _written(tmp_path: Path, pool: _C.ThreadPool,
             ) -> tuple[str, np.ndarray, list[_C.WrittenItem]]:
    data = np.arange(3 * 4096, dtype=np.uint8)
    params = _C.CodecParams("zstd", 1, 4, "group")
    path = str(tmp_path / "data")
    with _C.FileWriter(path, "off") as w:
        written = w.write_items(
            [_C.WriteItem("x", data.ctypes.data, data.nbytes, params),
             ("y", data.ctypes.data, 100, params)],  # a plain tuple of the layout
            4096, pool, _C.BufferPool(1 << 16, 4),
        )
        w.commit()
    return path, data, written


def test_write_and_read_results_are_named(tmp_path: Path) -> None:
    with _C.ThreadPool(2) as pool:
        path, data, written = _written(tmp_path, pool)
        assert [type(w) for w in written] == [_C.WrittenItem] * 2
        x, y = written
        assert x.offset == 0 and y.offset == x.stored_bytes and len(x.chunks) == 3
        # Chunk records are plain tuples of the Chunk layout (made in bulk, pickled).
        assert all(type(c) is tuple and len(c) == len(_C.Chunk._fields) for c in x.chunks)
        assert sum(c[1] for c in x.chunks) == data.nbytes

        params = _C.CodecParams("zstd", 1, 4, "group")
        named = _C.Segment(path, 0, params, [_C.Chunk(*c) for c in x.chunks])
        plain = (path, 0, params, list(x.chunks))
        for seg in (named, plain):
            out = np.zeros(data.nbytes, dtype=np.uint8)
            stats = _C.read_requests(
                [_C.ReadRequest("x", [seg], 0, data.nbytes, out.ctypes.data)], pool)
            assert type(stats) is _C.ReadStats
            assert stats.chunks == 3 and stats.bytes_read > 0
            assert np.array_equal(out, data)
            checked = _C.verify_segments("x", [seg], pool)
            assert type(checked) is _C.ReadStats and checked.chunks == 3


def test_memory_sources_are_accepted_named_or_plain(tmp_path: Path) -> None:
    with _C.ThreadPool(2) as pool:
        path, data, (x, _) = _written(tmp_path, pool)
        raw = Path(path).read_bytes()
        params = _C.CodecParams("zstd", 1, 4, "group")
        seg = _C.Segment("mem", 0, params, x.chunks)
        for sources in ({"mem": _C.MemorySource(len(raw), [_C.MemoryRange(0, raw)])},
                        {"mem": (len(raw), [(0, raw)])}):
            out = np.zeros(data.nbytes, dtype=np.uint8)
            _C.read_requests([_C.ReadRequest("x", [seg], 0, data.nbytes, out.ctypes.data)],
                             pool, sources)
            assert np.array_equal(out, data)


def test_a_tuple_of_the_wrong_shape_is_named_in_the_error(tmp_path: Path) -> None:
    with _C.ThreadPool(1) as pool:
        with pytest.raises(TypeError, match="ReadRequest"):
            _C.read_requests([("x", [], 0)], pool)
        with pytest.raises(TypeError, match="Segment"):
            _C.verify_segments("x", [("p", 0)], pool)
        with pytest.raises(TypeError, match="MemorySource"):
            _C.read_requests([], pool, {"m": (1,)})
        with _C.FileWriter(str(tmp_path / "d"), "off") as w:
            with pytest.raises(TypeError, match="WriteItem"):
                w.write_items([("x", 0)], 4096, pool, _C.BufferPool(4096, 1))


def test_codec_and_safetensors_results_are_named() -> None:
    params = _C.CodecParams("zstd", 1)
    enc = _C.encode_chunk(b"a" * 4096, params)
    assert type(enc) is _C.EncodedChunk and type(enc.record) is tuple
    out = bytearray(4096)
    _C.decode_chunk(enc.stored, _C.Chunk(*enc.record), params, out)
    assert out == b"a" * 4096

    emitted = _C.safetensors_header(
        [_C.TensorSpec("b", "F32", [2, 3]), ("a", "U8", [4])], {"format": "pt"})
    assert type(emitted) is _C.EmittedHeader
    assert emitted.layout == [_C.TensorSpan("a", 0, 4), _C.TensorSpan("b", 4, 28)]
    assert all(type(s) is _C.TensorSpan for s in emitted.layout)
    assert emitted.data_bytes == 28
    parsed = _C.parse_safetensors_header(emitted.header[8:], len(emitted.header) + 28)
    tensors = parsed["tensors"]
    assert isinstance(tensors, list) and all(type(t) is _C.HeaderTensor for t in tensors)
    assert {t.name: (t.dtype, t.shape, t.begin, t.end) for t in tensors} == {
        "a": ("U8", (4,), 0, 4), "b": ("F32", (2, 3), 4, 28)}

    _C.check_tiling("t", [4], [_C.TileBlock([0], [2], "first"), ([2], [2], "second")])
    with pytest.raises(pyckpt.CheckpointFormatError, match="first"):
        _C.check_tiling("t", [4], [_C.TileBlock([0], [3], "first"), ([2], [2], "second")])
