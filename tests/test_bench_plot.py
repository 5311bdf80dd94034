"""``pyckpt bench --plot``: the measured figures drawn as side-by-side bars in a PNG."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _child_env import child_env
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
        assert png_size(tmp_path / f"{name}.png") == (1600, 520)
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


def test_plot_gives_every_method_its_own_colour_and_explains_t1_t2(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = _report(dict.fromkeys(bench.METHODS, 1 << 20))
    figs: list = []
    real_close = plt.close
    plt.close = lambda fig=None: figs.append(fig)  # keep the figure to look at it
    try:
        bench.plot_report(rep, tmp_path / "all.png")
    finally:
        plt.close = real_close
    fig = figs[0]
    try:
        legend = fig.legends[0]
        names = [t.get_text() for t in legend.get_texts()]
        assert names == list(bench.METHODS)
        colours = [tuple(h.get_facecolor()) for h in legend.legend_handles]
        assert len(set(colours)) == len(bench.METHODS)  # no two methods share a colour
        assert "dcp-tN: DCP FileSystemWriter(thread_count=N)" in legend.get_title().get_text()
    finally:
        real_close(fig)


def test_table_columns_stay_apart_with_long_values() -> None:
    results = [
        bench.Result("pyckpt", save_s=0.011, load_cold_s=14.872, load_warm_s=16.827,
                     disk_bytes=3 << 30, raw_bytes=3 << 30, bit_exact=True,
                     save_runs=[0.011], cold_runs=[14.872], warm_runs=[16.827]),
        bench.Result("dcp+zstd-t2", save_s=123.456, load_cold_s=1234.567, load_warm_s=2.5,
                     disk_bytes=2 << 30, raw_bytes=3 << 30, bit_exact=False,
                     save_runs=[100.0, 123.456, 150.25], cold_runs=[1234.567],
                     warm_runs=[2.5]),
    ]
    table = bench.format_table({"raw_bytes": 3 << 30, "direct_write_Bps": 2e9,
                                "results": results})
    lines = table.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("method"))
    rows = lines[header:header + 3]
    # Cells hold single spaces ("save s", "0.5 [0.4-0.6]"); columns are two or more apart.
    cells = [list(re.finditer(r"\S+(?: \S+)*", r)) for r in rows]
    assert [len(c) for c in cells] == [8, 8, 8], rows
    for col in range(1, 7):  # right-aligned numeric columns end at the same place on every row
        assert len({c[col].end() for c in cells}) == 1, (col, rows)
    assert "0.011 [0.011-0.011]" in rows[1] and "  14.872 [14.872-14.872]" in rows[1]
    assert "dcp-tN: DCP FileSystemWriter with thread_count=N" in table


def test_bench_checks_resources_up_front(tmp_path: Path) -> None:
    msg = bench.check_resources(1 << 20, str(tmp_path))
    assert "GiB of memory" in msg and "on disk" in msg
    with pytest.raises(OSError, match="free on disk") as e:
        bench.check_resources(1 << 60, str(tmp_path))
    assert e.value.filename == str(tmp_path)


@pytest.mark.slow
def test_bench_removes_its_work_directory_on_sigterm(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyckpt", "bench", "--size-gib", "0.25", "--repeats", "50",
         "--methods", "dcp+zstd-t1", "--workdir", str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 600  # detects a bench that never starts, not slowness
        while not list(tmp_path.glob("pyckpt-bench-*/*")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "bench never created its work directory"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert "needs about" in out  # said up front
    assert not list(tmp_path.glob("pyckpt-bench-*")), err


# A child that holds a lock a non-daemon worker thread waits for: what an exception raised by a
# signal handler can leave behind (it lands after ``Condition.__enter__`` took its lock and
# before the ``with`` that releases it), as in a bench that once hung for good after SIGTERM.
_HELD_LOCK_CHILD = """
import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pyckpt import bench

lock = threading.Lock()
pool = ThreadPoolExecutor(1)
with bench._work_directory(sys.argv[1]) as work:
    open(work + "/part", "wb").close()
    lock.acquire()
    pool.submit(lock.acquire)
    print(work, flush=True)
    while True:
        time.sleep(0.01)
"""


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_removes_the_work_directory_and_ends_the_bench_whatever_lock_is_held(
        tmp_path: Path, signame: str) -> None:
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _HELD_LOCK_CHILD, str(tmp_path)],
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        work = Path(proc.stdout.readline().strip())
        assert work.parent == tmp_path and (work / "part").exists()
        signum = getattr(signal, signame)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)  # a raise into the main thread hangs: no exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signum, err
    assert f"interrupted ({signame}); removed {work}" in err
    assert list(tmp_path.iterdir()) == []
