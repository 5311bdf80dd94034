"""``pyckpt bench --plot``: the measured figures drawn as side-by-side bars in a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _png import png_size

from pyckpt import bench
from pyckpt.cli import main

pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install 'pyckpt[demo]')")


def test_bench_plot_writes_a_png_of_the_report(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "bench.png"
    rc = main(["bench", "--size-gib", "0.004", "--repeats", "1", "--methods",
               "pyckpt,pyckpt+zstd,dcp-t1", "--workdir", str(tmp_path),
               "--json", str(tmp_path / "r.json"), "--plot", str(png)])
    assert rc == 0
    assert f"plot: {png}" in capsys.readouterr().out
    width, height = png_size(png)
    assert width >= 1000 and height >= 300
    # The JSON and the plot come from the same measurements.
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["method"] for r in report["results"]] == ["pyckpt", "pyckpt+zstd", "dcp-t1"]


def _report(disk: dict[str, int]) -> dict:
    results = [bench.Result(m, save_s=0.5, load_cold_s=0.25, load_warm_s=0.125, disk_bytes=b,
                            raw_bytes=1 << 20, bit_exact=True, save_runs=[0.5, 0.6])
               for m, b in disk.items()]
    return {"raw_bytes": 1 << 20, "direct_write_Bps": 1e9, "results": results}


def test_plot_report_draws_the_given_figures(tmp_path: Path) -> None:
    """Different figures give a different picture; the same figures the same picture."""
    a = _report({"pyckpt+zstd": 700_000, "dcp-t2": 1 << 20})
    b = _report({"pyckpt+zstd": 300_000, "dcp-t2": 1 << 20})
    for name, rep in (("a1", a), ("a2", a), ("b", b)):
        bench.plot_report(rep, tmp_path / f"{name}.png", workload="synthetic")
        assert png_size(tmp_path / f"{name}.png") == (1600, 450)
    read = {n: (tmp_path / f"{n}.png").read_bytes() for n in ("a1", "a2", "b")}
    assert read["a1"] == read["a2"]
    assert read["a1"] != read["b"]


def test_bench_plot_without_matplotlib_fails_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc = main(["bench", "--size-gib", "0.004", "--repeats", "1", "--methods", "pyckpt",
               "--workdir", str(tmp_path), "--plot", str(tmp_path / "x.png")])
    captured = capsys.readouterr()
    assert rc == 1
    assert "--plot needs matplotlib" in captured.err
    assert "workload:" not in captured.out  # failed before building or measuring anything
    assert not (tmp_path / "x.png").exists()
