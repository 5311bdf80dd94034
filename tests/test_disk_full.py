"""A save that runs out of space (ENOSPC on a small filesystem, EFBIG under RLIMIT_FSIZE) raises a
typed OSError naming the file, leaves no new metadata, no temp files and no data files of its
own, and the previous checkpoint in the directory loads bit-exact."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import pyckpt
from pyckpt import _format

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _sd(seed: int, nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(nbytes // 4, generator=g)}


def _listing(path: Path) -> dict[str, bytes | int]:
    """Names in ``path`` with the metadata's content and the other files' sizes."""
    return {
        p.name: (p.read_bytes() if p.name == _format.METADATA_FILE else p.stat().st_size)
        for p in path.iterdir()
    }


def _assert_untouched(path: Path, before: dict[str, bytes | int], sd: dict[str, torch.Tensor]
                      ) -> None:
    after = _listing(path)
    assert after == before, (sorted(after), sorted(before))  # no new metadata, temp, or orphan
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=pyckpt.Reader(path), no_dist=True)
    for k, v in sd.items():
        assert torch.equal(out[k].view(torch.int32), v.view(torch.int32)), k


def _failure(fn) -> BaseException:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        failures = getattr(e, "failures", None) or {}
        if failures:
            inner = next(iter(failures.values()))
            return inner[0] if isinstance(inner, tuple) else inner
        return e
    raise AssertionError("the save did not fail")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for the test (skips where mounting is not permitted)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_enospc_in_data_file(small_fs: Path, direct_io: str) -> None:
    ckpt = small_fs / "ckpt"
    previous = _sd(1, 1 << 20)
    dcp.save(previous, storage_writer=pyckpt.Writer(ckpt), no_dist=True)
    before = _listing(ckpt)
    err = _failure(lambda: dcp.save(_sd(2, 40 << 20), no_dist=True,
                                    storage_writer=pyckpt.Writer(ckpt, direct_io=direct_io)))
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC, repr(err)
    assert str(err.filename).startswith(str(ckpt)), err.filename
    _assert_untouched(ckpt, before, previous)


def test_enospc_in_metadata_removes_the_saves_data_file(small_fs: Path) -> None:
    ckpt = small_fs / "ckpt"
    previous = _sd(1, 1 << 20)
    dcp.save(previous, storage_writer=pyckpt.Writer(ckpt), no_dist=True)
    before = _listing(ckpt)
    new = _sd(2, 2 << 20)
    # Measure the new data file on another filesystem, then leave exactly that much room.
    probe = small_fs.parent / "probe"
    dcp.save(new, storage_writer=pyckpt.Writer(probe), no_dist=True)
    (data,) = [p for p in probe.iterdir() if _format.is_data_file(p.name)]
    need = -(-data.stat().st_size // 4096) * 4096
    st = os.statvfs(small_fs)
    filler = small_fs / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - need))
    assert os.statvfs(small_fs).f_bavail * st.f_frsize == need
    err = _failure(lambda: dcp.save(new, storage_writer=pyckpt.Writer(ckpt), no_dist=True))
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC, repr(err)
    assert str(err.filename).startswith(str(ckpt / _format.METADATA_FILE)), err.filename
    filler.unlink()
    _assert_untouched(ckpt, before, previous)


_FSIZE_SCRIPT = textwrap.dedent(
    """
    import resource, signal, sys, warnings, torch
    import torch.distributed.checkpoint as dcp
    import pyckpt
    warnings.simplefilter("ignore")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    if sys.argv[3] == "big":
        sd = {"w": torch.randn(1 << 20)}  # a 4 MiB data file
    else:
        sd = {f"layer{i}.weight": torch.full((4,), float(i)) for i in range(2000)}
    try:
        dcp.save(sd, storage_writer=pyckpt.Writer(sys.argv[1]), no_dist=True)
    except BaseException as e:
        inner = next(iter(e.failures.values()))[0] if getattr(e, "failures", None) else e
        print("ERROR", type(inner).__name__, inner.errno, inner.filename)
        sys.exit(3)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["big", "many"], ids=["data_file", "metadata"])
def test_efbig_under_rlimit_fsize(tmp_path: Path, what: str) -> None:
    """``big``: the data file exceeds the limit; ``many``: 2000 small tensors, so the data file
    (32 KiB) fits but the metadata (hundreds of KiB) does not."""
    ckpt = tmp_path / "ckpt"
    previous = _sd(1, 1 << 16)
    dcp.save(previous, storage_writer=pyckpt.Writer(ckpt), no_dist=True)
    before = _listing(ckpt)
    proc = subprocess.run([sys.executable, "-c", _FSIZE_SCRIPT, str(ckpt), str(128 << 10), what],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    name, code, filename = proc.stdout.split("ERROR", 1)[1].split()
    assert name == "OSError" and int(code) == errno.EFBIG, proc.stdout
    expect = ckpt / _format.METADATA_FILE if what == "many" else ckpt
    assert filename.startswith(str(expect)), filename
    _assert_untouched(ckpt, before, previous)
