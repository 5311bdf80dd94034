"""pytest-benchmark: pyckpt.consolidate vs torch's consolidate_safetensors_files.

Inputs: DCP-HF sharded safetensors (2 shard files, read by both) and pyckpt checkpoints of the
same DTensor pieces saved by 2 gloo ranks, raw and zstd (read by pyckpt). Scaled by
PYCKPT_BENCH_SCALE (default 0.03, about 30 MiB); `pytest benchmarks --benchmark-disable` is a
quick smoke run. Every timed output is checked against the original tensors afterwards.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _consolidate_data import nbytes, scale, state_dict, write_pyckpt, write_shards

import pyckpt


@pytest.fixture(scope="module")
def sd():
    return state_dict(int(scale() * (1 << 30)))


def _check(dst, sd):
    from safetensors.torch import load_file

    out = load_file(os.path.join(dst, "model-00001-of-00001.safetensors"))
    assert all(torch.equal(out[k], v) for k, v in sd.items())


@pytest.fixture(scope="module")
def pyckpt_inputs(tmp_path_factory):
    """(dim, compression) -> pyckpt checkpoint directory, saved on first use."""
    made: dict[tuple[int, str], str] = {}

    def get(dim: int, comp: str) -> str:
        if (dim, comp) not in made:
            path = str(tmp_path_factory.mktemp(f"pyckpt{dim}{comp}"))
            write_pyckpt(path, int(scale() * (1 << 30)), 2, dim, None if comp == "raw" else comp)
            made[(dim, comp)] = path
        return made[(dim, comp)]

    return get


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize(
    "impl,source", [("pyckpt", "hf"), ("torch", "hf"), ("pyckpt", "raw"), ("pyckpt", "zstd")]
)
def test_consolidate(benchmark, tmp_path, sd, pyckpt_inputs, dim, impl, source):
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    dst = str(tmp_path / "dst")
    if source == "hf":
        src = str(tmp_path / "src")
        write_shards(src, sd, 2, dim)
    else:
        src = pyckpt_inputs(dim, source)

    def setup():
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)

    def run():
        if impl == "torch":
            consolidate_safetensors_files(src, dst, dict.fromkeys(sd, 1), num_threads=1)
        else:
            pyckpt.consolidate(src, dst, threads=2, fsync=False)

    benchmark.extra_info["input"] = source
    benchmark.pedantic(run, setup=setup, rounds=3, warmup_rounds=1)
    _check(dst, sd)
    if benchmark.stats is not None:
        benchmark.extra_info["bytes_per_s"] = nbytes(sd) / benchmark.stats.stats.median


def test_export_ranks_script_runs_and_checks_its_exports(tmp_path):
    """Smoke run of benchmarks/export_ranks.py (2 gloo ranks, the demo's model, one run of
    each method): it exits 0 only when both pyckpt exports equal torch's, bit for bit, and
    prints a row per scale and the phases of each rank."""
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "export_ranks.py")
    out = subprocess.run([sys.executable, script, "--scales", "1", "--repeats", "1", "--dir",
                          str(tmp_path), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| 19 (39) |" in out.stdout  # MiB (tensors)
    assert "19 MiB, pyckpt zstd: rank 0:" in out.stdout
    assert "19 MiB, pyckpt shards: rank 0:" in out.stdout
    assert os.listdir(tmp_path) == ["r.json"]  # its work directory is gone


def test_export_tail_script_runs_and_checks_its_export(tmp_path):
    """Smoke run of benchmarks/export_tail.py (2 gloo ranks, the demo's model, 4 exports): it
    exits 0 only when the last export equals the saved tensors, and prints the three medians."""
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "export_tail.py")
    out = subprocess.run([sys.executable, script, "--repeats", "4", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("19 MiB from zstd on 2 ranks, 1 runs:")
    assert "last copy's end -> return" in out.stdout
    assert os.listdir(tmp_path) == []  # its work directory is gone


def test_many_tensors_script_runs_and_checks_its_results(tmp_path):
    """Smoke run of benchmarks/many_tensors.py (one process, a few hundred tensors, one run of
    each method): it exits 0 only when every load and export equals the saved state dict."""
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "many_tensors.py")
    out = subprocess.run([sys.executable, script, "--tensors", "300", "--shape", "8,8",
                          "--repeats", "1", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("300 tensors, 0.1 MiB")
    for method in ("pyckpt save", "dcp load", "pyckpt export zstd",
                   "torch export, collector paused"):
        assert f"\n{method} " in out.stdout
    assert os.listdir(tmp_path) == []  # its work directory is gone
