"""Chunk codec throughput per thread count on bf16-like data.

Each chunk is encoded/decoded with ``encode_chunk_into`` / ``decode_chunk`` from a Python thread
pool; the native calls release the GIL, so threads scale like native workers (the per-chunk Python
overhead is microseconds against milliseconds of work per 4 MiB chunk). ``extra_info`` records
raw bytes/s (total and per thread) and the stored/raw ratio.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pyckpt import _C

CHUNK = 4 << 20
CODECS = {
    "none": _C.CodecParams("none", 1, 2, "none"),
    "zstd": _C.CodecParams("zstd", 1, 2, "none"),
    "group_rotl1": _C.CodecParams("zstd", 1, 2, "group_rotl1"),
}
THREADS = sorted({1, 2, os.cpu_count() or 1})


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("op", ["encode", "decode"])
def test_codec_throughput(benchmark, scaled, run_timed, bf16_bytes, op, codec, threads) -> None:
    params = CODECS[codec]
    data = bf16_bytes(scaled(32 << 20, CHUNK))
    chunks = [data[i : i + CHUNK] for i in range(0, data.nbytes, CHUNK)]
    outs = [np.empty(_C.max_encoded_size(CHUNK, params), np.uint8) for _ in chunks]
    records = [_C.encode_chunk_into(c, params, o) for c, o in zip(chunks, outs)]
    stored = sum(sum(r[4][1::2]) for r in records)
    decoded = [np.empty(CHUNK, np.uint8) for _ in chunks]

    with ThreadPoolExecutor(threads) as ex:
        if op == "encode":

            def work() -> None:
                list(ex.map(lambda i: _C.encode_chunk_into(chunks[i], params, outs[i]), range(len(chunks))))

        else:

            def work() -> None:
                list(ex.map(lambda i: _C.decode_chunk(outs[i], records[i], params, decoded[i]), range(len(chunks))))

        best = run_timed(work)

    if op == "decode":
        assert all(np.array_equal(c, d) for c, d in zip(chunks, decoded))
    benchmark.extra_info.update(
        raw_bytes=data.nbytes,
        stored_bytes=stored,
        ratio=stored / data.nbytes,
        bytes_per_s=data.nbytes / best,
        bytes_per_s_per_thread=data.nbytes / best / threads,
    )
    if codec == "group_rotl1":
        assert stored <= 0.70 * data.nbytes


@pytest.mark.parametrize("elem", [2, 4])
@pytest.mark.parametrize("op", ["group", "ungroup"])
def test_byte_grouping_throughput(benchmark, scaled, run_timed, bf16_bytes, op, elem) -> None:
    """The transform alone (single thread): it must stay far faster than zstd."""
    data = bf16_bytes(scaled(32 << 20))
    out = np.empty_like(data)
    grouped = np.empty_like(data)
    _C.group_bytes(data, elem, True, grouped)
    if op == "group":
        best = run_timed(lambda: _C.group_bytes(data, elem, True, out))
    else:
        best = run_timed(lambda: _C.ungroup_bytes(grouped, elem, True, out))
        assert np.array_equal(out, data)
    benchmark.extra_info.update(bytes_per_s=data.nbytes / best)
