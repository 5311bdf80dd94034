"""libFuzzer (atheris) harness: chunk decoding, ``_C.decode_chunk``, on arbitrary stored bytes
and chunk records.

The input chooses the codec params, the record (transform code, plane modes and lengths, raw
length up to 64 KiB) and the stored bytes; the checksum is the true XXH64 of the stored bytes
most of the time, so inputs reach the decoders. Every input must decode or be refused with a
typed error (pyckpt.PyckptError / OSError); the output buffer is exactly ``raw_len`` bytes, so
an overrun is a sanitizer report in an instrumented build.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["pyckpt"]):  # not torch: minutes of start-up
    from pyckpt import _C
    from pyckpt.errors import PyckptError

_CODECS = ["none", "zstd"]
_TRANSFORMS = ["none", "group", "group_rotl1"]


@atheris.instrument_func
def _encoded_then_damaged(fdp: atheris.FuzzedDataProvider) -> None:
    """A real encoded chunk whose stored bytes, record or params are then damaged: reaches the
    zstd and ungrouping paths with almost-valid input (the checksum is re-computed)."""
    elem = [1, 2, 4, 8][fdp.ConsumeIntInRange(0, 3)]
    params = _C.CodecParams("zstd", fdp.ConsumeIntInRange(1, 3), elem,
                            _TRANSFORMS[fdp.ConsumeIntInRange(0, 2)] if elem > 1 else "none")
    raw = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8192))
    stored, rec = _C.encode_chunk(raw, params)
    stored = bytearray(stored)
    off, raw_len, _sum, tcode, planes = rec
    planes = list(planes)
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        what = fdp.ConsumeIntInRange(0, 4)
        if what == 0 and stored:
            stored[fdp.ConsumeIntInRange(0, len(stored) - 1)] ^= 1 << fdp.ConsumeIntInRange(0, 7)
        elif what == 1 and planes:
            planes[fdp.ConsumeIntInRange(0, len(planes) - 1)] = fdp.ConsumeIntInRange(0, 1 << 14)
        elif what == 2:
            raw_len = fdp.ConsumeIntInRange(0, 1 << 14)
        elif what == 3:
            tcode = fdp.ConsumeIntInRange(0, 3)
        elif stored:
            del stored[fdp.ConsumeIntInRange(0, len(stored) - 1):]
    out = bytearray(raw_len)
    try:
        _C.decode_chunk(bytes(stored), (off, raw_len, _C.xxh64(bytes(stored)), tcode,
                                        tuple(planes)), params, out)
    except (PyckptError, OSError):
        return
    if raw_len == len(raw) and tcode == rec[3] and planes == list(rec[4]) and \
            bytes(stored) == _C.encode_chunk(raw, params)[0]:
        assert bytes(out) == raw, "an undamaged chunk decoded to different bytes"


@atheris.instrument_func
def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    if fdp.ConsumeBool():
        _encoded_then_damaged(fdp)
        return
    codec = _CODECS[fdp.ConsumeIntInRange(0, 1)]
    elem = [1, 2, 4, 8][fdp.ConsumeIntInRange(0, 3)]
    transform = _TRANSFORMS[fdp.ConsumeIntInRange(0, 2)]
    tcode = fdp.ConsumeIntInRange(0, 3)
    raw_len = fdp.ConsumeIntInRange(0, 1 << 16)
    nplanes = fdp.ConsumeIntInRange(0, 9)
    planes: list[int] = []
    for _ in range(nplanes):
        planes += [fdp.ConsumeIntInRange(0, 2), fdp.ConsumeIntInRange(0, 1 << 12)]
    good_sum = fdp.ConsumeIntInRange(0, 7) != 0
    stored = fdp.ConsumeBytes(fdp.remaining_bytes())
    checksum = _C.xxh64(stored) if good_sum else fdp.ConsumeIntInRange(0, (1 << 64) - 1)
    out = bytearray(raw_len)
    try:
        # Params are validated where they are made (a ValueError naming the field): only valid
        # ones reach the decoder, as in the library.
        params = _C.CodecParams(codec, 1, elem, transform)
    except ValueError:
        return
    try:
        _C.decode_chunk(stored, (0, raw_len, checksum, tcode, tuple(planes)), params, out)
    except (PyckptError, OSError):
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
