"""The pyckpt command line: inspect, verify, convert, bench (consolidate: test_consolidate)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import pyckpt
from pyckpt import _format, tools
from pyckpt.cli import main


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    sd = {"layer.weight": (torch.randn(128, 64) * 0.02).to(torch.bfloat16),
          "layer.bias": torch.randn(64), "step": 4}
    path = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=pyckpt.Writer(path, compression="zstd", chunk_bytes=4096))
    return path


def test_inspect(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "2 tensors, 1 other values" in out
    assert "layer.weight" in out and "bfloat16" in out and "zstd/group_rotl1" in out
    assert "by rank:    1 rank(s), max/mean 1.000: 0: " in out


def test_inspect_prints_names_with_control_characters_escaped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a name from a checkpoint someone sent must not drive the terminal (retitle it, clear it)
    name = "w\x1b]0;PWNED\x07\x1b[2J"
    pyckpt.save({name: torch.ones(4), "plain": torch.ones(2)}, tmp_path / "c", fsync=False)
    assert main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert repr(name) in out and "    plain " in out


def test_inspect_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path)]) == 1
    assert "pyckpt.json is missing" in capsys.readouterr().err


def test_verify_ok_and_corrupt(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(ckpt)]) == 0
    assert capsys.readouterr().out.startswith("OK")
    index = _format.read_index(ckpt)
    path, _, _, chunks = index.tensors["layer.weight"].pieces[0].segments[0]
    with open(path, "r+b") as f:
        f.seek(chunks[1][0] + 1)
        b = f.read(1)
        f.seek(chunks[1][0] + 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert main(["verify", str(ckpt)]) == 2
    out = capsys.readouterr().out
    assert "CORRUPT layer.weight" in out and "FAILED" in out


def test_convert_both_ways(ckpt: Path, tmp_path: Path) -> None:
    assert main(["convert", str(ckpt), str(tmp_path / "dcp")]) == 0
    assert (tmp_path / "dcp" / ".metadata").is_file()
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "back"),
                 "--compression", "none"]) == 0
    a = {"layer.weight": torch.zeros(128, 64, dtype=torch.bfloat16), "layer.bias": torch.zeros(64),
         "step": 0}
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    dcp.load(a, storage_reader=pyckpt.Reader(ckpt))
    dcp.load(b, storage_reader=pyckpt.Reader(tmp_path / "back"))
    assert torch.equal(a["layer.weight"], b["layer.weight"])
    assert torch.equal(a["layer.bias"], b["layer.bias"]) and b["step"] == 4


def test_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--size-gib", "0.004", "--repeats", "1", "--methods",
               "pyckpt,pyckpt+zstd,dcp-t1", "--workdir", str(tmp_path),
               "--json", str(tmp_path / "r.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "pyckpt+zstd" in out and "dcp-t1" in out and "NO" not in out.split("exact", 1)[1]
    assert (tmp_path / "r.json").is_file()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyckpt", *argv], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


@pytest.fixture
def complex_ckpt(tmp_path: Path) -> Path:
    """A pyckpt checkpoint whose complex128 tensor has no safetensors spelling."""
    path = tmp_path / "cplx"
    sd = {"z": torch.arange(6).to(torch.complex128)}
    dcp.save(sd, storage_writer=pyckpt.Writer(path, compression=None))
    return path


def test_consolidate_error_is_one_line_no_bar(complex_ckpt: Path, tmp_path: Path) -> None:
    # Single-worker consolidate used to print a raw traceback for UnsupportedDtypeError, and
    # the progress bar before it.
    # --all: the complex128 tensor is selected explicitly (the default would skip it with a
    # warning), so the export is refused.
    r = _cli("consolidate", str(complex_ckpt), str(tmp_path / "out"), "--all")
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("pyckpt consolidate: error: "), r.stderr
    assert "'z'" in r.stderr and "complex128" in r.stderr
    # One line: no traceback, no progress bar drawn before the error.
    assert r.stderr.count("\n") == 1 and "\r" not in r.stderr, r.stderr
    r = _cli("consolidate", str(complex_ckpt), str(tmp_path / "out"), "--all", "--debug")
    assert r.returncode != 0
    assert "Traceback" in r.stderr and "UnsupportedDtypeError" in r.stderr


@pytest.mark.parametrize("cmd", ["inspect", "verify", "convert", "consolidate"])
def test_missing_directory_is_named(cmd: str, tmp_path: Path) -> None:
    missing = str(tmp_path / "no" / "such")
    argv = [cmd, missing] + ([str(tmp_path / "out")] if cmd in ("convert", "consolidate") else [])
    r = _cli(*argv)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"pyckpt {cmd}: error: "), r.stderr
    assert "does not exist" in r.stderr and missing in r.stderr
    assert "pyckpt.json is missing" not in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_pyckpt_errors_of_every_class_are_one_line(
    ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyckpt import errors, tools

    for cls in (errors.PyckptError, errors.CompressionError, errors.UnsupportedDtypeError,
                errors.CheckpointFormatError, errors.ChecksumError, errors.CudaError):
        def boom(*_a: object, _cls: type = cls, **_k: object) -> None:
            raise _cls(f"bad item 'x' ({_cls.__name__})")

        monkeypatch.setattr(tools, "summarize", boom)
        assert main(["inspect", str(ckpt)]) == 1
        err = capsys.readouterr().err
        assert err == f"pyckpt inspect: error: bad item 'x' ({cls.__name__})\n"
        with pytest.raises(cls):
            main(["inspect", str(ckpt), "--debug"])


def test_negative_counts_are_refused_in_one_line(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `verify --threads -1` reached the native pool: a TypeError traceback; `inspect --top -1`
    # listed every tensor but the smallest under "largest 3 tensors".
    for argv, name in ((["verify", str(ckpt), "--threads", "-1"], "threads"),
                       (["verify", str(ckpt), "--threads", "0"], "threads"),
                       (["inspect", str(ckpt), "--top", "-1"], "top")):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        least = 1 if name == "threads" else 0
        assert err == f"pyckpt {argv[0]}: error: {name} must be >= {least}, got {argv[-1]}\n", err
    assert main(["inspect", str(ckpt), "--top", "0"]) == 0
    assert "largest" not in capsys.readouterr().out


def test_consolidate_workers_below_one_is_an_error_line(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--workers 0` ended with a bare "pyckpt consolidate: --workers must be >= 1" (no
    # "error:", unlike every other refusal of the command line).
    assert main(["consolidate", str(ckpt), str(tmp_path / "out"), "--workers", "0"]) == 1
    err = capsys.readouterr().err
    assert err == "pyckpt consolidate: error: --workers must be >= 1, got 0\n", err
    assert not (tmp_path / "out").exists()


def test_verify_out_of_memory_is_an_error_not_damage(
    ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under a memory limit (`ulimit -v 400000`, 64 MiB chunks) the native reader's
    # std::bad_alloc was reported as "CORRUPT w: MemoryError", status 2: an intact checkpoint
    # declared damaged. Every size is bounded by the validated metadata and the checksum is
    # checked before decoding, so running out of memory says nothing about the data.
    def no_memory(name: str, *_a: object) -> None:
        raise MemoryError("std::bad_alloc")

    monkeypatch.setattr(tools, "_verify_piece", no_memory)
    assert main(["verify", str(ckpt)]) == 1
    captured = capsys.readouterr()
    assert "CORRUPT" not in captured.out and "FAILED" not in captured.out
    err = captured.err.splitlines()[-1]
    assert err.startswith("pyckpt verify: error: ") and "not enough memory" in err, err


def test_verify_reports_compression_error_per_item(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A damaged zstd frame whose recorded checksum was updated to match: only decoding can find
    # it, and it raises CompressionError, which verify let escape as a traceback.
    from pyckpt import _C

    index = _format.read_index(ckpt)
    path, _, _, chunks = index.tensors["layer.weight"].pieces[0].segments[0]
    off, _raw_len, old_sum, _transform, planes = chunks[1]
    stored = sum(planes[1::2])
    with open(path, "r+b") as f:
        f.seek(off)
        data = bytearray(f.read(stored))
        pos = 0
        for plane_len in planes[1::2]:  # damage every plane's zstd frame magic
            data[pos] ^= 0x5A
            pos += plane_len
        f.seek(off)
        f.write(data)
    new_sum = _C.xxh64(bytes(data))

    def record_new_checksum(doc: dict) -> None:
        chunk = doc["items"]["layer.weight"]["pieces"][0]["segments"][0]["chunks"][1]
        assert chunk[2] == old_sum
        chunk[2] = new_sum

    # rebind: the record holds the plain XXH64 of its bytes while edited (format version 3)
    _format.rewrite_metadata(ckpt, record_new_checksum, rebind=True)  # and the seal too
    assert main(["verify", str(ckpt)]) == 2
    out = capsys.readouterr().out
    assert "CORRUPT layer.weight: CompressionError" in out, out
    assert "FAILED: 3 items" in out


def test_consolidate_dcp_filesystem_checkpoint_points_to_convert(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(src)))
    r = _cli("consolidate", str(src), str(tmp_path / "out"))
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("pyckpt consolidate: error: "), r.stderr
    assert "pyckpt convert" in r.stderr and str(src) in r.stderr
    with pytest.raises(pyckpt.CheckpointFormatError, match="pyckpt convert"):
        pyckpt.consolidate(src, tmp_path / "out2")


class _Marker:
    """Unpickles as ``Path(marker).touch()``: stands for any code a crafted pickle runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (Path.touch, (Path(self.path),))


@pytest.fixture
def evil_ckpts(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(pyckpt checkpoint, DCP FileSystemWriter checkpoint, marker path) with a code pickle."""
    marker = tmp_path / "pwned"
    sd = {"w": torch.arange(4.0), "extra": {"step": 3, "rng": _Marker(marker)}}
    dcp.save(sd, storage_writer=pyckpt.Writer(tmp_path / "p", compression=None))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "d")))
    assert not marker.exists()
    return tmp_path / "p", tmp_path / "d", marker


def test_load_refuses_code_pickles(evil_ckpts: tuple[Path, Path, Path]) -> None:
    src, _, marker = evil_ckpts
    sd = {"w": torch.zeros(4), "extra": {"step": 0, "rng": None}}
    with pytest.raises(pyckpt.CheckpointFormatError, match=r"'extra\.rng'.*trusted=True"):
        pyckpt.load(sd, src)
    assert not marker.exists()
    # Allowlisted values still load, nested as saved (leaving 'extra.rng' behind, as asked).
    sd = {"w": torch.zeros(4), "extra": {"step": 0}}
    with pytest.raises(pyckpt.PartialLoadError, match=r"'extra\.rng'.*Add those keys"):
        pyckpt.load(sd, src)
    pyckpt.load(sd, src, allow_partial=True)
    assert sd["extra"]["step"] == 3 and torch.equal(sd["w"], torch.arange(4.0))
    assert not marker.exists()
    sd = {"w": torch.zeros(4), "extra": {"step": 0, "rng": None}}
    pyckpt.load(sd, src, trusted=True)  # the explicit opt-in runs it, as dcp.load would
    assert marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1])
def test_convert_refuses_code_pickles(
    evil_ckpts: tuple[Path, Path, Path], tmp_path: Path, which: int
) -> None:
    src, marker = evil_ckpts[which], evil_ckpts[2]
    r = _cli("convert", str(src), str(tmp_path / "out"))
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("pyckpt convert: error: item 'extra.rng'"), r.stderr
    assert "--trusted" in r.stderr and not marker.exists()
    r = _cli("convert", str(src), str(tmp_path / "out2"), "--trusted")
    assert r.returncode == 0, r.stderr
    assert marker.exists()


@pytest.mark.parametrize("fmt", ["pyckpt", "dcp"])
def test_convert_keeps_nesting(tmp_path: Path, fmt: str) -> None:
    sd = {"model": {"a": torch.arange(3.0), "b": [torch.ones(2, dtype=torch.int32), 7]},
          "step": 4}
    src = tmp_path / "src"
    writer = pyckpt.Writer(src) if fmt == "pyckpt" else dcp.FileSystemWriter(str(src))
    dcp.save(sd, storage_writer=writer, no_dist=True)
    tools.convert(src, tmp_path / "out")
    out_reader = (dcp.FileSystemReader(str(tmp_path / "out")) if fmt == "pyckpt"
                  else pyckpt.Reader(tmp_path / "out"))
    md = out_reader.read_metadata()
    assert md.planner_data["model.b.0"] == ("model", "b", 0)  # nesting recorded again
    back = {"model": {"a": torch.zeros(3), "b": [torch.zeros(2, dtype=torch.int32), 0]},
            "step": 0}
    dcp.load(back, storage_reader=out_reader, no_dist=True)
    assert torch.equal(back["model"]["a"], sd["model"]["a"])
    assert torch.equal(back["model"]["b"][0], sd["model"]["b"][0])
    assert back["model"]["b"][1] == 7 and back["step"] == 4


@pytest.mark.parametrize("cmd", [["inspect", "gs://bucket/ckpt"], ["verify", "gs://bucket/ckpt"],
                                 ["convert", "{ckpt}", "gs://bucket/ckpt"],
                                 ["consolidate", "{ckpt}", "gs://bucket/out"]])
def test_urls_of_other_schemes_exit_1_naming_them(
    cmd: list[str], ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert main([a.format(ckpt=ckpt) for a in cmd]) == 1
    err = capsys.readouterr().err
    assert f"pyckpt {cmd[0]}: error: " in err and "unsupported URL scheme 'gs'" in err
    assert "gs://bucket/" in err
    assert sorted(os.listdir(tmp_path)) == before


# ------------------------------------------------------------------------------ help


def test_no_arguments_prints_the_commands() -> None:
    # `pyckpt` alone asks what the tool does: the help on stdout, status 0 (as pip, docker and
    # cargo answer), not argparse's usage-error status 2.
    out = _cli()
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith("usage: pyckpt")
    for cmd in ("consolidate", "inspect", "verify", "convert", "bench"):
        assert f"\n    {cmd}" in out.stdout, cmd
    # The top help says which commands take URLs, consolidate included.
    assert "inspect, verify, convert and consolidate also take s3://" in " ".join(
        out.stdout.split())
    # A wrong command is still a usage error.
    assert _cli("nosuchcommand").returncode == 2


def test_inspect_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    # `pyckpt inspect CKPT | head -1`: the reader leaves after one line. The command used to
    # end with "pyckpt inspect: error: [Errno 32] Broken pipe" and status 1.
    path = tmp_path / "many"
    dcp.save({f"t{i:04d}": torch.full((4,), float(i)) for i in range(3000)},
             storage_writer=pyckpt.Writer(path), no_dist=True)
    proc = subprocess.Popen([sys.executable, "-m", "pyckpt", "inspect", str(path), "--top",
                             "3000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141, err  # 128 + SIGPIPE, as a C tool killed by it
    assert first.startswith(str(path).encode()) and err == ""


def test_convert_refuses_a_destination_that_is_not_empty(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "dst"
    assert main(["convert", str(ckpt), str(dst)]) == 0  # an absent destination is created
    first = sorted(os.listdir(dst))
    stamp = (dst / ".metadata").stat().st_mtime_ns
    capsys.readouterr()
    # A second convert into it used to replace it silently.
    assert main(["convert", str(ckpt), str(dst)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pyckpt convert: error: ") and str(dst) in err and "--overwrite" in err
    assert sorted(os.listdir(dst)) == first and (dst / ".metadata").stat().st_mtime_ns == stamp
    # Any entry counts (not only a checkpoint), and the library refuses the same way.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError) as info:
        tools.convert(ckpt, other)
    assert info.value.filename == str(other)
    assert os.listdir(other) == ["notes.txt"]
    # An empty directory is fine; --overwrite replaces.
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(ckpt), str(tmp_path / "empty")]) == 0
    assert main(["convert", str(ckpt), str(dst), "--overwrite"]) == 0
    assert (dst / ".metadata").stat().st_mtime_ns != stamp


@pytest.mark.parametrize("to", ["dcp", "pyckpt"])
def test_convert_overwrite_replaces_a_checkpoint_of_the_other_format(
    tmp_path: Path, to: str
) -> None:
    # `convert --overwrite` into a directory holding the other format's checkpoint left that
    # one's metadata beside the new one: `--to dcp` over a pyckpt checkpoint, and pyckpt's
    # tools (load, inspect, convert, consolidate) still read the old state, without a word.
    old = {"w": torch.zeros(8), "n": torch.zeros(3, dtype=torch.int64)}
    new = {"w": torch.full((8,), 2.0), "n": torch.arange(3)}
    src, dst = tmp_path / "src", tmp_path / "dst"
    if to == "dcp":
        pyckpt.save(old, dst, fsync=False)
        pyckpt.save(new, src, fsync=False)
    else:
        dcp.save(old, storage_writer=dcp.FileSystemWriter(dst), no_dist=True)
        dcp.save(new, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    assert main(["convert", str(src), str(dst), "--to", to, "--overwrite"]) == 0
    assert not (dst / ("pyckpt.json" if to == "dcp" else ".metadata")).exists()
    assert main(["convert", str(dst), str(tmp_path / "back"), "--to",
                 "pyckpt" if to == "dcp" else "dcp"]) == 0
    got = {"w": torch.empty(8), "n": torch.empty(3, dtype=torch.int64)}
    if to == "dcp":
        pyckpt.load(got, tmp_path / "back")
    else:
        dcp.load(got, storage_reader=dcp.FileSystemReader(tmp_path / "back"), no_dist=True)
    assert torch.equal(got["w"], new["w"]) and torch.equal(got["n"], new["n"])
    # and none of the old checkpoint's data files is left behind
    assert not [n for n in os.listdir(dst) if n.endswith(".pyckpt" if to == "dcp" else ".distcp")]
    # a destination that is a file is still refused naming it, not a path under it
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError) as info:
        tools.convert(src, tmp_path / "file", to=to, overwrite=True)
    assert str(tmp_path / "file") in str(info.value)
    assert str(tmp_path / "file" / ".metadata") not in str(info.value)


@pytest.mark.parametrize("lands", ["after", "before"])
def test_interrupt_during_the_metadata_write_exits_130(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, lands: str,
) -> None:
    # Ctrl-C that lands while pyckpt.json is written (just after its rename, or before it):
    # the commit rule used to swallow the interrupt once the metadata had landed ("writing the
    # metadata reported a failure but ... committed") and convert exited 0.
    from pyckpt.backends import posix

    write = posix.PosixBackend._write_metadata

    def interrupted(self: posix.PosixBackend, meta: str, encoded: bytes) -> None:
        if lands == "after":
            write(self, meta, encoded)
        raise KeyboardInterrupt

    monkeypatch.setattr(posix.PosixBackend, "_write_metadata", interrupted)
    dcp_src = tmp_path / "dcp"
    dcp.save({"w": torch.arange(8.0)}, storage_writer=dcp.FileSystemWriter(str(dcp_src)),
             no_dist=True)
    dst = tmp_path / "out"
    assert main(["convert", str(dcp_src), str(dst)]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pyckpt convert: interrupted; "), err
    if lands == "after":
        assert f"the converted checkpoint at {dst} was committed" in err
        back = {"w": torch.zeros(8)}
        pyckpt.load(back, dst)
        assert torch.equal(back["w"], torch.arange(8.0))
    else:
        assert f"no converted checkpoint was committed at {dst}" in err
        assert not (dst / _format.METADATA_FILE).exists()
    # The library raises it too, with a note saying what the commit did.
    with pytest.raises(KeyboardInterrupt) as info:
        pyckpt.save({"w": torch.ones(2)}, tmp_path / "lib")
    assert any("committed" in n for n in getattr(info.value, "__notes__", []))


def _help(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # one line: argparse wraps to the terminal


def test_command_help_describes_and_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help("consolidate", capsys=capsys)
    assert "The input is a pyckpt checkpoint" in text
    assert "--workers WORKERS local worker processes (gloo group) (default: 1)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    for cmd, words in (("inspect", "from its metadata alone"),
                       ("verify", "Read every stored chunk"),
                       ("bench", "in the same run")):
        text = _help(cmd, capsys=capsys)
        assert words in text, cmd
    text = _help("bench", capsys=capsys)
    assert "--repeats REPEATS runs of each method" in text and "(default: 3)" in text
    text = _help("convert", capsys=capsys)
    assert "compression of a pyckpt target (default: zstd)" in text


@pytest.mark.slow
def test_convert_prints_no_dcp_warning(ckpt: Path, tmp_path: Path) -> None:
    # In a fresh process with Python's default warning filters (not pytest's, nor _cli's).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    for argv in (["convert", str(ckpt), str(tmp_path / "dcp")],
                 ["convert", str(tmp_path / "dcp"), str(tmp_path / "back"), "--compression",
                  "ZSTD"]):
        out = subprocess.run([sys.executable, "-m", "pyckpt", *argv], capture_output=True,
                             text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stderr == ""  # DCP's "torch.distributed is disabled" warning: not once
        assert out.stdout.startswith(f"converted {argv[1]} -> {argv[2]} (")
    assert "zstd" in _cli("inspect", str(tmp_path / "back")).stdout


# ------------------------------------------------------------------------------ consolidate


def test_consolidate_workers_on_a_small_input_run_in_process(tmp_path: Path) -> None:
    # The README's `--workers 4` on a small checkpoint used to start 4 fresh interpreters (each
    # importing torch: 5.35 s against 0.17 s on 2 cores) and to sum it up as "0.00 GiB/s" in a
    # time the progress line did not show. Fewer workers are started where more cannot help,
    # saying so, and the rate is in a unit that shows it.
    src = tmp_path / "src"
    pyckpt.save({"model": {f"l{i}": torch.randn(64, 64) for i in range(4)}}, src)
    out = _cli("consolidate", str(src), str(tmp_path / "out"), "--workers", "4")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0].startswith("--workers 4: using 1 (the input is "), out.stderr
    assert "PYCKPT_WORKER_BYTES" in lines[0]
    summary = lines[-1]
    assert summary.startswith("wrote 1 file(s), 0.1 MiB in "), summary
    assert "GiB/s" not in summary and ("MiB/s" in summary or "KiB/s" in summary), summary
    assert "worker processes" not in summary  # one process: no start-up to account for


def test_consolidate_summary_accounts_for_worker_start_up() -> None:
    from pyckpt._progress import rate
    from pyckpt.cli import _summary

    # 2 MiB exported by 4 workers in 1.70 s of a 7.75 s run: the other 6.05 s were their
    # start-up, named, and the rate is the export's (the progress line's).
    assert _summary(1, 2 << 20, 7.75, 1.70, 4, "out") == (
        "wrote 1 file(s), 2.0 MiB in 7.75 s (6.05 s starting 4 worker processes, 1.70 s "
        "exporting at 1.18 MiB/s) to out")
    assert _summary(3, 5 << 30, 2.5, 2.5, 1, "o") == "wrote 3 file(s), 5,120.0 MiB in 2.50 s " \
        "(2.00 GiB/s) to o"
    assert rate(0, 1.0) == "0.00 KiB/s" and rate(1536, 1.0) == "1.50 KiB/s"
