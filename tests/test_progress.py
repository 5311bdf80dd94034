"""Progress of long operations: one view per job, complete lines (no carriage returns) when the
output is not a terminal, and 100% only once the work has ended."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from _child_env import child_env
from dist_utils import run_distributed

import pyckpt
from pyckpt import _progress

_LINE = re.compile(r"^(\w+): [\d,.]+ MiB / [\d,.]+ MiB \((\d+)%\)")


def _percent(line: str) -> int:
    m = _LINE.match(line)
    assert m, f"not a progress line: {line!r}"
    return int(m.group(2))


def test_view_writes_whole_lines_off_a_terminal_and_reaches_100_only_at_finish() -> None:
    out = io.StringIO()  # not a terminal
    view = _progress.Progress("save", stream=out, interval=0)
    view.update(0, 1000)
    view.update(500, 1000)
    view.update(1000, 1000)  # every byte copied, but the job has not ended
    assert out.getvalue().endswith("\n") and "\r" not in out.getvalue()
    before = out.getvalue().splitlines()
    assert [_percent(ln) for ln in before] == [0, 50, 99]
    assert "finishing" in before[-1]
    view.finish()
    view.update(1000, 1000)  # late updates after the end draw nothing
    view.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) == len(before) + 1
    assert _percent(lines[-1]) == 100 and lines[-1].startswith("save: ")


def test_view_rate_limits_log_lines() -> None:
    out = io.StringIO()
    view = _progress.Progress("load", stream=out, interval=3600)
    for done in range(0, 1001, 10):
        view.update(done, 1000)
    assert out.getvalue() == ""  # nothing until the interval passes...
    view.finish()
    assert [_percent(ln) for ln in out.getvalue().splitlines()] == [100]  # ...and one at the end


def test_failed_job_never_claims_100() -> None:
    out = io.StringIO()
    with pytest.raises(KeyError):
        view = _progress.Progress("export", stream=out, interval=0)
        with _progress.job(view, "export") as report:
            assert report is not None
            report(10, 10)
            raise KeyError("boom")
    view.close()
    assert all(_percent(ln) < 100 for ln in out.getvalue().splitlines())


def test_disabled_view_writes_nothing() -> None:
    out = io.StringIO()
    view = _progress.Progress("save", stream=out, interval=0, enabled=False)
    view.update(1, 2)
    view.finish()
    assert out.getvalue() == ""


def test_save_and_load_report_native_bytes_up_to_the_total(tmp_path: Path) -> None:
    sd = {"a": torch.randn(300, 1000), "b": torch.arange(50_000, dtype=torch.int64),
          "step": 7}
    total = 300 * 1000 * 4 + 50_000 * 8
    seen: list[tuple[int, int]] = []
    pyckpt.save(sd, tmp_path / "c", progress=lambda d, t: seen.append((d, t)),
                compression="zstd", chunk_bytes=64 << 10)
    assert seen[-1] == (total, total)
    assert all(t == total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # never goes backwards

    back = {"a": torch.zeros(300, 1000), "b": torch.zeros(50_000, dtype=torch.int64), "step": 0}
    got: list[tuple[int, int]] = []
    pyckpt.load(back, tmp_path / "c", progress=lambda d, t: got.append((d, t)))
    assert got[-1] == (total, total)
    assert torch.equal(back["a"], sd["a"]) and torch.equal(back["b"], sd["b"])


def test_async_save_reports_its_background_writes_up_to_the_total(tmp_path: Path) -> None:
    sd = {"a": torch.randn(300, 1000), "b": torch.arange(50_000, dtype=torch.int64)}
    total = 300 * 1000 * 4 + 50_000 * 8
    seen: list[tuple[int, int, str]] = []
    fut = pyckpt.async_save(
        sd, tmp_path / "c", compression="zstd", chunk_bytes=64 << 10,
        progress=lambda d, t: seen.append((d, t, threading.current_thread().name)))
    fut.result(timeout=60)
    assert seen[-1][:2] == (total, total)
    assert all(t == total for _, t, _ in seen)
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    assert threading.main_thread().name not in {name for _, _, name in seen}  # background

    with pytest.raises(TypeError, match="progress"):
        pyckpt.async_save(sd, tmp_path / "d", progress="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "d").exists()


def test_async_save_progress_true_prints_one_final_line_to_a_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pyckpt.async_save({"w": torch.randn(100_000)}, tmp_path / "c",
                      progress=True).result(timeout=60)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("save:")]
    assert len(lines) == 1 and _percent(lines[0]) == 100, err


def test_save_progress_true_prints_one_final_line_to_a_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pyckpt.save({"w": torch.randn(100_000)}, tmp_path / "c", progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("save:")]
    assert len(lines) == 1 and _percent(lines[0]) == 100, err


def _sharded_dcp_checkpoint(src: Path) -> None:
    sd = {f"layer{i}.weight": torch.randn(256, 512) for i in range(8)}
    pyckpt.save(sd, src)


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_consolidate_workers_shows_one_line_based_view_ending_at_100(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _sharded_dcp_checkpoint(src)
    env = child_env(PYCKPT_PROGRESS_INTERVAL="0", PYCKPT_WORKER_BYTES="0")
    proc = subprocess.run(
        [sys.executable, "-m", "pyckpt", "consolidate", str(src), str(dst), "--workers", "2",
         "--no-fsync"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "\r" not in err  # not a terminal: whole lines only
    lines = [ln for ln in err.splitlines() if _LINE.match(ln)]
    assert lines, err
    assert {_LINE.match(ln).group(1) for ln in lines} == {"consolidate"}  # one view, no per-rank
    pcts = [_percent(ln) for ln in lines]
    assert pcts == sorted(pcts)
    assert pcts.count(100) == 1 and pcts[-1] == 100  # 100% once, at the very end
    # The 100% line comes after the work: only the summary follows it.
    rest = err.splitlines()[err.splitlines().index(lines[-1]) + 1:]
    assert rest and rest[-1].startswith("wrote ") and not any(_LINE.match(ln) for ln in rest)
    assert (dst / "model.safetensors.index.json").is_file()


def test_verify_reports_every_raw_byte(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pyckpt import tools

    sd = {"a": torch.randn(200, 1000), "b": torch.randn(7, 3)}
    pyckpt.save(sd, tmp_path / "c", compression="zstd", chunk_bytes=64 << 10)
    seen: list[tuple[int, int]] = []
    report = tools.verify(tmp_path / "c", progress=lambda d, t: seen.append((d, t)))
    assert report.ok
    assert seen[-1] == (200 * 1000 * 4 + 7 * 3 * 4,) * 2
    tools.verify(tmp_path / "c", progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert [_percent(ln) for ln in lines if ln.startswith("verify:")] == [100]


def _two_rank_worker(rank: int, world: int, tmp: str) -> str:
    import contextlib

    torch.manual_seed(0)
    sd = {f"w{i}": torch.randn(128, 256) for i in range(4)}  # replicated on both ranks
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        pyckpt.save(sd, os.path.join(tmp, "c"), progress=True)
        pyckpt.consolidate(os.path.join(tmp, "c"), os.path.join(tmp, "out"), fsync=False,
                           progress=True)
    return err.getvalue()


@pytest.mark.distributed
def test_progress_true_is_one_view_per_job_drawn_by_rank_0(tmp_path: Path) -> None:
    outs = run_distributed(_two_rank_worker, 2, str(tmp_path))
    assert outs[1] == ""  # the other rank draws nothing
    lines = [ln for ln in outs[0].splitlines() if _LINE.match(ln)]
    assert [(_LINE.match(ln).group(1), _percent(ln)) for ln in lines] == [
        ("save", 100), ("export", 100)], outs[0]


def test_export_refuses_a_progress_that_is_neither_bool_nor_callable(tmp_path: Path) -> None:
    pyckpt.save({"a": torch.randn(3, 4)}, tmp_path / "c")
    with pytest.raises(TypeError, match="progress must be a bool or a callable"):
        pyckpt.consolidate(tmp_path / "c", tmp_path / "out", progress="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()  # refused before any work
    seen: list[tuple[int, int]] = []
    pyckpt.consolidate(tmp_path / "c", tmp_path / "out", progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (48, 48)
