"""Chunk codec and XXH64 (pyckpt._C.encode_chunk / decode_chunk / xxh64).

Oracles: a pure-Python XXH64, a numpy byte-grouping reference, and the ``zstandard`` package
(every zstd plane must decompress with it to the expected grouped bytes).
"""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from pyckpt import _C
from pyckpt.errors import CheckpointFormatError, ChecksumError, CompressionError

PAGE = 4096
EDGE_SIZES = [0, 1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE - 1, 3 * PAGE + 1]  # STYLE X3
TRANSFORMS = ["none", "group", "group_rotl1"]
TRANSFORM_ID = {"none": 0, "group": 1, "group_rotl1": 2}

# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------

_M = (1 << 64) - 1
_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_P5 = 0x27D4EB2F165667C5


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M


def _round(acc: int, lane: int) -> int:
    return (_rotl((acc + lane * _P2) & _M, 31) * _P1) & _M


def _merge(acc: int, val: int) -> int:
    return ((acc ^ _round(0, val)) * _P1 + _P4) & _M


def xxh64_ref(data: bytes, seed: int = 0) -> int:
    """Straightforward XXH64 from the specification (independent of the C++ code)."""
    n, p = len(data), 0

    def u64(i: int) -> int:
        return int.from_bytes(data[i : i + 8], "little")

    if n >= 32:
        v = [(seed + _P1 + _P2) & _M, (seed + _P2) & _M, seed & _M, (seed - _P1) & _M]
        while p + 32 <= n:
            v = [_round(v[k], u64(p + 8 * k)) for k in range(4)]
            p += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _M
        for lane in v:
            h = _merge(h, lane)
    else:
        h = (seed + _P5) & _M
    h = (h + n) & _M
    while p + 8 <= n:
        h = (_rotl(h ^ _round(0, u64(p)), 27) * _P1 + _P4) & _M
        p += 8
    if p + 4 <= n:
        h = (_rotl(h ^ ((int.from_bytes(data[p : p + 4], "little") * _P1) & _M), 23) * _P2 + _P3) & _M
        p += 4
    while p < n:
        h = (_rotl(h ^ ((data[p] * _P5) & _M), 11) * _P1) & _M
        p += 1
    h ^= h >> 33
    h = (h * _P2) & _M
    h ^= h >> 29
    h = (h * _P3) & _M
    return h ^ (h >> 32)


def group_ref(raw: bytes, elem: int, rotl1: bool) -> list[bytes]:
    """Planes of ``raw``: plane p = byte p (little-endian) of every (rotated) element."""
    if elem == 1:
        return [raw]
    v = np.frombuffer(raw, dtype=np.dtype(f"<u{elem}")).astype(np.uint64)
    bits = np.uint64(8 * elem)
    if rotl1:
        mask = np.uint64((1 << (8 * elem)) - 1)
        v = ((v << np.uint64(1)) | (v >> (bits - np.uint64(1)))) & mask
    return [((v >> np.uint64(8 * p)) & np.uint64(0xFF)).astype(np.uint8).tobytes() for p in range(elem)]


def split_planes(stored: bytes, record: tuple) -> list[tuple[int, bytes]]:
    planes, off = [], 0
    flat = record[4]
    for mode, length in zip(flat[0::2], flat[1::2]):
        planes.append((mode, stored[off : off + length]))
        off += length
    assert off == len(stored)
    return planes


def check_against_oracles(raw: bytes, stored: bytes, record: tuple, params: _C.CodecParams) -> None:
    """The stored layout is exactly what codec.hpp documents, checked without the C++ decoder."""
    codec, elem, transform = params.codec, params.elem_size, params.transform
    file_offset, raw_len, checksum, tr_id, _flat = record
    assert (file_offset, raw_len) == (0, len(raw))
    assert checksum == xxh64_ref(stored)
    planes = split_planes(stored, record)
    grouped = (
        codec == "zstd" and transform != "none" and elem > 1 and len(raw) % elem == 0 and len(raw) > 0
    )
    if grouped:
        assert tr_id == TRANSFORM_ID[transform]
        expected = group_ref(raw, elem, transform == "group_rotl1")
    else:
        assert tr_id == 0
        expected = [raw]
    assert len(planes) == len(expected)
    for (mode, data), want in zip(planes, expected):
        if mode == 0:
            assert data == want
        else:
            assert mode == 1
            assert codec == "zstd"
            assert len(data) < len(want)
            assert zstandard.ZstdDecompressor().decompress(data) == want
            # Frames carry the content size, so any zstd can size its output.
            assert zstandard.get_frame_parameters(data).content_size == len(want)
            assert not zstandard.get_frame_parameters(data).has_checksum


def roundtrip(raw: bytes, params: tuple) -> tuple[bytes, tuple]:
    stored, record = _C.encode_chunk(raw, params)
    assert len(stored) <= _C.max_encoded_size(len(raw), params)
    out = bytearray(len(raw))
    _C.decode_chunk(stored, record, params, out)
    assert bytes(out) == raw
    return stored, record


# --------------------------------------------------------------------------------------------
# XXH64
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "seed", "expected"),
    [
        (b"", 0, 0xEF46DB3751D8E999),
        (b"a", 0, 0xD24EC4F1A98C6E5B),
        (b"abc", 0, 0x44BC2CF5AD770999),
        (b"Nobody inspects the spammish repetition", 0, 0xFBCEA83C8A378BF1),
        (b"xxhash", 20141025, 0xB559B98D844E0635),
    ],
)
def test_xxh64_known_vectors(data: bytes, seed: int, expected: int) -> None:
    assert _C.xxh64(data, seed) == expected
    assert xxh64_ref(data, seed) == expected


@pytest.mark.parametrize("n", [*range(0, 70), 100, 1000, PAGE - 1, PAGE + 1, 65537])
def test_xxh64_matches_reference(make_data, n: int) -> None:
    data = make_data("random", n)
    assert _C.xxh64(data) == xxh64_ref(data)
    # Unaligned start: the C++ loads must not assume alignment.
    assert _C.xxh64(memoryview(data)[1:]) == xxh64_ref(data[1:])


def test_xxh64_accepts_buffers() -> None:
    arr = np.arange(1000, dtype=np.float32)
    assert _C.xxh64(arr) == xxh64_ref(arr.tobytes())
    assert _C.xxh64(bytearray(b"abc")) == 0x44BC2CF5AD770999
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        _C.xxh64(arr[::2])  # numpy refuses a simple (contiguous) export


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "low_entropy", "bf16"])
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("elem", [1, 2, 4, 8])
@pytest.mark.parametrize("n", EDGE_SIZES)
def test_roundtrip_zstd_edge_sizes(make_data, n: int, elem: int, transform: str, kind: str) -> None:
    params = _C.CodecParams("zstd", 1, elem, transform)
    raw = make_data(kind, n)
    stored, record = roundtrip(raw, params)
    check_against_oracles(raw, stored, record, params)


@pytest.mark.parametrize("n", EDGE_SIZES)
def test_roundtrip_codec_none(make_data, n: int) -> None:
    params = _C.CodecParams("none", 1, 2, "group_rotl1")  # transform is ignored without compression
    raw = make_data("bf16", n)
    stored, record = roundtrip(raw, params)
    assert stored == raw
    assert record == (0, n, xxh64_ref(raw), 0, (0, n))


@pytest.mark.parametrize("level", [-3, 1, 3, 6])
@pytest.mark.parametrize(
    ("kind", "elem"),
    [("bf16", 2), ("fp32", 4), ("fp64", 8), ("low_entropy", 2), ("low_entropy", 4), ("low_entropy", 8)],
)
def test_roundtrip_large_compressible(make_data, kind: str, elem: int, level: int) -> None:
    params = _C.CodecParams("zstd", level, elem, "group_rotl1")
    raw = make_data(kind, 256 * 1024)
    stored, record = roundtrip(raw, params)
    check_against_oracles(raw, stored, record, params)
    assert 1 in record[4][0::2], "expected at least one zstd plane on compressible data"


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_random_data_is_stored_raw(make_data, transform: str) -> None:
    raw = make_data("random", 1 << 20)
    stored, record = roundtrip(raw, _C.CodecParams("zstd", 1, 2, transform))
    assert set(record[4][0::2]) == {0}
    assert len(stored) == len(raw)


def test_unaligned_length_falls_back_to_no_transform(make_data) -> None:
    raw = make_data("bf16", 4097)  # odd: not a whole number of bf16 elements
    stored, record = roundtrip(raw, _C.CodecParams("zstd", 1, 2, "group_rotl1"))
    assert record[3] == 0
    assert len(record[4]) == 2


def test_bf16_byte_grouping_ratio(make_data) -> None:
    """Rotated byte grouping on bf16 weights must reach <= 0.70x of raw (DESIGN target ~0.67x)."""
    raw = make_data("bf16", 4 << 20)
    stored, record = roundtrip(raw, _C.CodecParams("zstd", 1, 2, "group_rotl1"))
    assert len(stored) <= 0.70 * len(raw)
    # The near-random sign+mantissa plane is copied, the exponent plane compressed.
    assert record[4][0::2] == (0, 1)
    plain, _ = roundtrip(raw, _C.CodecParams("zstd", 1, 2, "none"))
    assert len(stored) < len(plain)


@pytest.mark.parametrize("elem", [2, 4, 8])
@pytest.mark.parametrize("rotl1", [False, True])
@pytest.mark.parametrize("n_elems", [0, 1, 15, 16, 17, 31, 33, 1000])
def test_group_bytes_matches_reference(make_data, elem: int, rotl1: bool, n_elems: int) -> None:
    raw = make_data("random", elem * n_elems)
    out = bytearray(len(raw))
    _C.group_bytes(raw, elem, rotl1, out)
    assert bytes(out) == b"".join(group_ref(raw, elem, rotl1))
    back = bytearray(len(raw))
    _C.ungroup_bytes(bytes(out), elem, rotl1, back)
    assert bytes(back) == raw


def test_rotl1_puts_bf16_exponent_in_high_byte() -> None:
    # 1.0 in bf16 is 0x3F80: sign 0, exponent 0x7F, mantissa 0. Rotated: 0x7F00.
    # -1.0 is 0xBF80: rotated 0x7F01 (sign in the lowest bit).
    raw = np.array([0x3F80, 0xBF80], dtype="<u2").tobytes()
    out = bytearray(4)
    _C.group_bytes(raw, 2, True, out)
    assert bytes(out) == bytes([0x00, 0x01, 0x7F, 0x7F])


@given(
    data=st.binary(max_size=5000),
    elem=st.sampled_from([1, 2, 4, 8]),
    transform=st.sampled_from(TRANSFORMS),
    level=st.sampled_from([1, 3]),
)
def test_roundtrip_property(data: bytes, elem: int, transform: str, level: int) -> None:
    params = _C.CodecParams("zstd", level, elem, transform)
    stored, record = roundtrip(data, params)
    check_against_oracles(data, stored, record, params)


def test_encode_chunk_into_matches_encode_chunk(make_data) -> None:
    params = _C.CodecParams("zstd", 1, 2, "group_rotl1")
    raw = make_data("bf16", 100_000)
    stored, record = _C.encode_chunk(raw, params)
    out = bytearray(_C.max_encoded_size(len(raw), params))
    assert _C.encode_chunk_into(raw, params, out) == record
    assert bytes(out[: len(stored)]) == stored
    with pytest.raises(ValueError, match="needs"):
        _C.encode_chunk_into(raw, params, bytearray(10))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("position", [0, 1, -1])
def test_flipped_byte_is_a_checksum_error(make_data, position: int) -> None:
    params = _C.CodecParams("zstd", 1, 2, "group_rotl1")
    raw = make_data("bf16", 65536)
    stored, record = _C.encode_chunk(raw, params)
    bad = bytearray(stored)
    bad[position] ^= 0x01
    with pytest.raises(ChecksumError, match="checksum mismatch") as info:
        _C.decode_chunk(bytes(bad), record, params, bytearray(len(raw)))
    # The hash of the bytes read is never shown: for a data file swapped for another file it
    # would disclose that file's contents.
    assert f"{xxh64_ref(bytes(bad)):016x}" not in str(info.value)


def test_wrong_checksum_in_record_is_a_checksum_error(make_data) -> None:
    raw = make_data("random", 100)
    stored, record = _C.encode_chunk(raw, _C.CodecParams("none", 1, 1, "none"))
    bad = (record[0], record[1], record[2] ^ 1, record[3], record[4])
    with pytest.raises(ChecksumError):
        _C.decode_chunk(stored, bad, _C.CodecParams("none", 1, 1, "none"), bytearray(100))


def test_inconsistent_record_is_a_header_error(make_data) -> None:
    raw = make_data("random", 100)
    params = _C.CodecParams("none", 1, 1, "none")
    stored, record = _C.encode_chunk(raw, params)
    bad = (record[0], 99, record[2], record[3], record[4])  # raw plane of 100 for raw_len 99
    with pytest.raises(CheckpointFormatError) as info:
        _C.decode_chunk(stored, bad, params, bytearray(99))
    assert not isinstance(info.value, ChecksumError)
    # Grouped record with a plane count that does not match elem_size.
    raw2 = make_data("bf16", 8192)
    p2 = _C.CodecParams("zstd", 1, 2, "group_rotl1")
    stored2, rec2 = _C.encode_chunk(raw2, p2)
    with pytest.raises(CheckpointFormatError, match="planes"):
        _C.decode_chunk(stored2, rec2, _C.CodecParams("zstd", 1, 4, "group_rotl1"), bytearray(8192))


def test_short_stored_buffer_is_truncated(make_data) -> None:
    raw = make_data("random", 100)
    stored, record = _C.encode_chunk(raw, _C.CodecParams("none", 1, 1, "none"))
    with pytest.raises(CheckpointFormatError, match="needs"):
        _C.decode_chunk(stored[:50], record, _C.CodecParams("none", 1, 1, "none"), bytearray(100))


def test_corrupt_frame_with_valid_checksum_is_a_compression_error() -> None:
    garbage = b"\x28\xb5\x2f\xfd" + bytes(range(60))  # zstd magic, nonsense after it
    record = (0, 1000, xxh64_ref(garbage), 0, (1, len(garbage)))
    with pytest.raises(CompressionError, match="zstd"):
        _C.decode_chunk(garbage, record, _C.CodecParams("zstd", 1, 1, "none"), bytearray(1000))


def test_frame_of_wrong_size_is_a_header_error() -> None:
    """A frame that decodes to more than its record promises (a decompression bomb) is refused
    from its header as a format error, before any output; so is one that decodes to less."""
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"x" * 500)
    record = (0, 400, xxh64_ref(frame), 0, (1, len(frame)))
    with pytest.raises(CheckpointFormatError, match="declares 500 decoded bytes") as info:
        _C.decode_chunk(frame, record, _C.CodecParams("zstd", 1, 1, "none"), bytearray(400))
    assert not isinstance(info.value, CompressionError)
    record = (0, 600, xxh64_ref(frame), 0, (1, len(frame)))
    with pytest.raises(CheckpointFormatError, match="declares 500 decoded bytes"):
        _C.decode_chunk(frame, record, _C.CodecParams("zstd", 1, 1, "none"), bytearray(600))


def test_trailing_bytes_after_the_frame_are_a_header_error() -> None:
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"x" * 500)
    stored = frame + frame  # two frames in one plane: the format has exactly one
    record = (0, 500, xxh64_ref(stored), 0, (1, len(stored)))
    with pytest.raises(CheckpointFormatError, match="its frame is"):
        _C.decode_chunk(stored, record, _C.CodecParams("zstd", 1, 1, "none"), bytearray(500))


@pytest.mark.parametrize(
    ("record", "params", "match"),
    [
        ((0, 8, 0, 0, (0, 4, 0, 4)), _C.CodecParams("zstd", 1, 1, "none"), "1 plane"),
        ((0, 8, 0, 1, (0, 4, 0, 4)), _C.CodecParams("zstd", 1, 4, "group"), "needs 4 planes"),
        ((0, 8, 0, 0, (1, 9)), _C.CodecParams("zstd", 1, 1, "none"), "stores 9 bytes for 8"),
        ((0, 8, 0, 0, (1, 4)), _C.CodecParams("none", 1, 1, "none"), "codec 'none'"),
    ],
)
def test_impossible_records_are_rejected(record, params, match) -> None:
    with pytest.raises(CheckpointFormatError, match=match):
        _C.decode_chunk(bytes(16), record, params, bytearray(8))


@pytest.mark.parametrize(
    "record",
    [
        (0, 10, 0, 5, (0, 10)),  # unknown transform
        (0, 10, 0, 0, (7, 10)),  # unknown plane mode
        (0, 10, 0, 0, (0,)),  # odd plane tuple
        (0, -1, 0, 0, (0, 10)),  # negative length
        (0, 10, 0, 0),  # too short
        "not a record",
    ],
)
def test_malformed_record_is_a_format_error(record) -> None:
    with pytest.raises(CheckpointFormatError):
        _C.decode_chunk(bytes(10), record, _C.CodecParams("none", 1, 1, "none"), bytearray(10))


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (("lz4", 1, 1, "none"), "codec"),
        (("zstd", 1, 3, "group"), "elem_size"),
        (("zstd", 1, 2, "shuffle"), "transform"),
        (("zstd", 1000, 2, "group"), "zstd level"),
        (("zstd", 1, 2, "group", 1.5), "raw_threshold"),
        (("zstd", 1, 2, "group", 0.0), "raw_threshold"),
    ],
)
def test_bad_params_are_value_errors_naming_the_field(params, field) -> None:
    with pytest.raises(ValueError, match=field):
        _C.CodecParams(*params)


def test_codec_params_fields_equality_and_pickling() -> None:
    import pickle

    p = _C.CodecParams("zstd", level=3, elem_size=2, transform="group_rotl1", raw_threshold=0.5)
    assert (p.codec, p.level, p.elem_size, p.transform, p.raw_threshold) == (
        "zstd", 3, 2, "group_rotl1", 0.5)
    assert _C.CodecParams("none") == _C.CodecParams("none", 1, 1, "none", 0.97)
    assert p != _C.CodecParams("zstd", 3, 2, "group_rotl1") and p != ("zstd", 3, 2, "group_rotl1")
    q = pickle.loads(pickle.dumps(p))
    assert q == p and hash(q) == hash(p)
    assert len({p, q, _C.CodecParams("none")}) == 2
    assert "group_rotl1" in repr(p)
    with pytest.raises(AttributeError):
        p.level = 4  # type: ignore[misc]


@pytest.mark.parametrize("call", ["encode", "decode", "max_encoded_size"])
def test_params_must_be_codec_params_objects(call) -> None:
    """Tuples are no longer converted: the typed object is the only way in."""
    raw = b"abcd" * 100
    stored, record = _C.encode_chunk(raw, _C.CodecParams("none"))
    as_tuple = ("none", 1, 1, "none")
    with pytest.raises(TypeError):
        if call == "encode":
            _C.encode_chunk(raw, as_tuple)  # type: ignore[arg-type]
        elif call == "decode":
            _C.decode_chunk(stored, record, as_tuple, bytearray(len(raw)))  # type: ignore[arg-type]
        else:
            _C.max_encoded_size(len(raw), as_tuple)  # type: ignore[arg-type]


def test_raw_threshold_decides_which_planes_are_stored_raw() -> None:
    # Half zeros, half random: zstd takes it to about half its size.
    rng = np.random.default_rng(5)
    raw = bytes(4096) + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    for threshold, mode in ((0.97, 1), (0.4, 0)):
        stored, record = _C.encode_chunk(raw, _C.CodecParams("zstd", 1, 1, "none", threshold))
        assert record[4][0] == mode, threshold  # plane 0: 1 = zstd frame, 0 = raw
        out = bytearray(len(raw))
        _C.decode_chunk(stored, record, _C.CodecParams("zstd", 1, 1, "none"), out)
        assert bytes(out) == raw


def test_records_accept_lists() -> None:
    """Records read back from JSON metadata arrive as lists."""
    raw = b"hello world" * 100
    params = _C.CodecParams("zstd", 1, 1, "none")
    stored, record = _C.encode_chunk(raw, params)
    as_list = [record[0], record[1], record[2], record[3], list(record[4])]
    out = bytearray(len(raw))
    _C.decode_chunk(stored, as_list, params, out)
    assert bytes(out) == raw


def test_the_formats_codec_table_is_the_native_cores() -> None:
    """pyckpt._format's codec table (the writer's compression option, the CLI, the metadata
    schema) names exactly the codecs and transforms the native core encodes."""
    from pyckpt import _format
    from pyckpt._format_spec import _TRANSFORM_CODES

    assert _TRANSFORM_CODES == TRANSFORM_ID
    for codec in _format.CODECS:
        assert _C.CodecParams(codec).codec == codec
    with pytest.raises(ValueError):
        _C.CodecParams("lz4")
    raw = _C.CodecParams(*_format.RAW_CODEC_PARAMS)
    assert _format.codec_params_json(raw) == list(_format.RAW_CODEC_PARAMS)


def test_zstd_frames_of_metadata_read_back_by_zstandard_and_are_checked_before_decoding() -> None:
    data = b'{"items":' + b"[1,2,3]," * 5000 + b"0}"
    frame = _C.zstd_frame(data)
    assert zstandard.ZstdDecompressor().decompress(frame) == data
    assert _C.zstd_unframe(frame, len(data)) == data
    assert _C.zstd_unframe(zstandard.compress(data), len(data)) == data
    with pytest.raises(CheckpointFormatError, match="declares 40011 decoded bytes, more than"):
        _C.zstd_unframe(frame, len(data) - 1)
    with pytest.raises(CheckpointFormatError, match="hold a zstd frame of"):
        _C.zstd_unframe(frame + b"\0", len(data))
    with pytest.raises(CompressionError, match="without its content size"):
        _C.zstd_unframe(zstandard.ZstdCompressor(write_content_size=False).compress(data), 10**6)
    with pytest.raises(CompressionError):
        _C.zstd_unframe(frame[:-3], len(data))
    with pytest.raises(CompressionError, match="not a valid zstd frame"):
        _C.zstd_unframe(data, len(data))
