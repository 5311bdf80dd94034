"""pytest-benchmark: dcp.save/dcp.load through pyckpt vs DCP FileSystemWriter/Reader.

Each pyckpt benchmark has its DCP twin on the same state dict; outputs are checked after timing
and bytes/s recorded in extra_info. Full comparison with cold/warm loads: compare_e2e.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

import pyckpt
from pyckpt import bench

WRITERS = {
    "pyckpt": lambda p: pyckpt.Writer(p),
    "pyckpt+zstd": lambda p: pyckpt.Writer(p, compression="zstd"),
    "dcp-t2": lambda p: bench.dcp_writer("dcp-t2", p),
    "dcp+zstd-t2": lambda p: bench.dcp_writer("dcp+zstd-t2", p),
}


@pytest.fixture(scope="module")
def state_dict(bench_scale: float) -> dict:
    return bench.llm_state_dict(int(32 * bench_scale * (1 << 20)))


@pytest.mark.parametrize("method", list(WRITERS))
def test_save(benchmark, tmp_path: Path, state_dict: dict, method: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "ckpt"

    def setup():  # type: ignore[no-untyped-def]
        shutil.rmtree(path, ignore_errors=True)

    benchmark.pedantic(lambda: dcp.save(state_dict, storage_writer=WRITERS[method](path)),
                       setup=setup, rounds=3)
    target = bench.zeros_like_tree(state_dict)
    reader = pyckpt.Reader(path) if method.startswith("pyckpt") else bench.dcp_reader(method, path)
    dcp.load(target, storage_reader=reader)
    assert bench.equal_tree(state_dict, target)
    raw = bench.state_dict_bytes(state_dict)
    benchmark.extra_info["raw_bytes"] = raw
    benchmark.extra_info["disk_bytes"] = bench.dir_bytes(path)
    if benchmark.stats is not None:
        benchmark.extra_info["bytes_per_s"] = raw / benchmark.stats.stats.median


@pytest.mark.parametrize("method", list(WRITERS))
def test_load_warm(benchmark, tmp_path: Path, state_dict: dict, method: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "ckpt"
    dcp.save(state_dict, storage_writer=WRITERS[method](path))
    bench.warm_cache(path)
    target = bench.zeros_like_tree(state_dict)

    def load():  # type: ignore[no-untyped-def]
        reader = (pyckpt.Reader(path) if method.startswith("pyckpt")
                  else bench.dcp_reader(method, path))
        dcp.load(target, storage_reader=reader)

    benchmark.pedantic(load, rounds=3)
    assert bench.equal_tree(state_dict, target)
    if benchmark.stats is not None:
        benchmark.extra_info["bytes_per_s"] = bench.state_dict_bytes(state_dict) / (
            benchmark.stats.stats.median)
