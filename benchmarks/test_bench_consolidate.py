"""pytest-benchmark: pyckpt.consolidate vs torch's consolidate_safetensors_files.

Scaled by PYCKPT_BENCH_SCALE (default 0.03, about 30 MiB); `pytest benchmarks --benchmark-disable`
is a quick smoke run. Every timed output is checked against the original tensors afterwards.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _consolidate_data import nbytes, scale, state_dict, write_shards  # noqa: E402

import pyckpt  # noqa: E402


@pytest.fixture(scope="module")
def sd():
    return state_dict(int(scale() * (1 << 30)))


def _check(dst, sd):
    from safetensors.torch import load_file

    out = load_file(os.path.join(dst, "model-00001-of-00001.safetensors"))
    assert all(torch.equal(out[k], v) for k, v in sd.items())


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("impl", ["pyckpt", "torch"])
def test_consolidate(benchmark, tmp_path, sd, dim, impl):
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_shards(src, sd, 2, dim)

    def setup():
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)

    def run():
        if impl == "torch":
            consolidate_safetensors_files(src, dst, dict.fromkeys(sd, 1), num_threads=1)
        else:
            pyckpt.consolidate(src, dst, threads=2, fsync=False)

    benchmark.pedantic(run, setup=setup, rounds=3, warmup_rounds=1)
    _check(dst, sd)
    if benchmark.stats is not None:
        benchmark.extra_info["bytes_per_s"] = nbytes(sd) / benchmark.stats.stats.median
