"""Errors a user meets first: typed, naming the location and the fix, no client debug dump.

* object stores: no credentials anywhere (``NoCredentialsError``), an endpoint that does not
  answer, an http endpoint the client refuses; the client's full report stays in the cause chain;
* a load of a missing path prints nothing before its ``FileNotFoundError`` (DCP logs a
  traceback there otherwise), a save into a regular file says so;
* string options accept any case and list every accepted value when refused;
* :func:`pyckpt.find_error` finds pyckpt's error inside DCP's ``CheckpointException`` from
  ``dcp.save`` / ``dcp.async_save``, on one process and on two gloo ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ports import free_port
from dist_utils import run_distributed
from torch.distributed.checkpoint.api import CheckpointException

import pyckpt
from pyckpt import _format
from pyckpt.errors import NoCredentialsError, ObjectStoreError, find_error

obstore = pytest.importorskip("obstore")

# What obstore's messages carry after their summary line, and must not reach str(e).
_DUMP_MARKERS = ("Debug source", "RetryError", "RetryErrorImpl", "hyper_util", "reqwest")


def _assert_no_dump(text: str) -> None:
    assert not [m for m in _DUMP_MARKERS if m in text], text
    assert "\n" not in text


@pytest.fixture
def no_aws_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No credentials from the environment or the shared files."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "home" / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "home" / "no-config"))


def _closed_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused


# ------------------------------------------------------------------------ object stores


def test_no_credentials_says_so_and_how_to_provide_them(no_aws_env: None) -> None:
    # The instance metadata service, the client's last resort, at a local port that refuses
    # connections: what a machine outside EC2 gets (there it is refused or times out).
    opts = {"metadata_endpoint": _closed_endpoint(), "region": "us-east-1", "max_retries": 0}
    url = "s3://bucket/ckpt"
    for call in (lambda: pyckpt.save({"w": torch.ones(4)}, url, storage_options=opts),
                 lambda: pyckpt.load({"w": torch.zeros(4)}, url, storage_options=opts)):
        with pytest.raises(NoCredentialsError) as info:
            call()
        e = info.value
        assert isinstance(e, PermissionError) and isinstance(e, pyckpt.PyckptError)
        assert e.filename is not None and e.filename.startswith(url)
        text = str(e)
        assert "no AWS credentials found" in text and url in text
        for fix in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "~/.aws/credentials",
                    "AWS_PROFILE", "storage_options={'access_key_id'", "skip_signature"):
            assert fix in text, fix
        _assert_no_dump(text)
        # The client's own report, dump included, is the cause.
        assert type(e.__cause__).__module__.startswith("obstore")
        assert "Debug source" in str(e.__cause__) and "/latest/api/token" in str(e.__cause__)


@pytest.mark.slow
def test_unreachable_endpoint_names_it(no_aws_env: None) -> None:
    endpoint = _closed_endpoint()
    opts = {"endpoint": endpoint, "allow_http": True, "region": "us-east-1",
            "access_key_id": "AKEXAMPLE", "secret_access_key": "secret-" + "x" * 20,
            "max_retries": 1}
    url = "s3://bucket/ckpt"
    with pytest.raises(ObjectStoreError) as info:
        pyckpt.save({"w": torch.ones(4)}, url, storage_options=opts)
    e = info.value
    text = str(e)
    assert e.filename == url
    assert f"cannot reach the object store endpoint {endpoint}: Connection refused" in text
    assert "after 1 retry" in text
    assert "AWS_ENDPOINT_URL" in text and "storage_options={'endpoint'" in text
    assert opts["secret_access_key"] not in text
    _assert_no_dump(text)
    assert "ConnectionRefused" in str(e.__cause__)


def test_http_endpoint_refused_by_the_client_says_how_to_allow_it(no_aws_env: None) -> None:
    endpoint = _closed_endpoint()
    opts = {"endpoint": endpoint, "region": "us-east-1", "access_key_id": "AKEXAMPLE",
            "secret_access_key": "secret-" + "x" * 20, "max_retries": 0}
    with pytest.raises(ValueError, match="AWS_ALLOW_HTTP=true") as info:
        pyckpt.load({"w": torch.zeros(4)}, "s3://bucket/ckpt", storage_options=opts)
    assert endpoint in str(info.value) and "'allow_http': True" in str(info.value)
    _assert_no_dump(str(info.value))
    # The CLI prints it as one line.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="AKEXAMPLE",
               AWS_SECRET_ACCESS_KEY="secret-xxxxxxxx", AWS_REGION="us-east-1")
    out = subprocess.run([sys.executable, "-m", "pyckpt", "inspect", "s3://bucket/ckpt"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("pyckpt inspect: error: ") and out.stderr.count("\n") == 1
    assert "AWS_ALLOW_HTTP=true" in out.stderr and endpoint in out.stderr
    _assert_no_dump(out.stderr.strip())


# ------------------------------------------------------------------------ local paths


@pytest.mark.slow
def test_load_of_a_missing_path_prints_nothing_before_raising(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "checkpoint"
    script = textwrap.dedent(f"""
        import torch, pyckpt
        try:
            pyckpt.load({{"w": torch.zeros(4)}}, {str(missing)!r})
        except FileNotFoundError as e:
            print("raised", type(e).__name__, e.filename)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("raised FileNotFoundError") and str(missing) in out.stdout
    assert out.stderr == ""  # no "Global metadata is not found", no traceback, no warning


def test_dcp_still_logs_its_fallback_outside_pyckpt_load(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The filter is scoped to pyckpt.load: DCP's own calls keep their logging.
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(4)}, storage_reader=pyckpt.Reader(tmp_path / "none"),
                 no_dist=True)
    assert "Global metadata is not found" in caplog.text
    caplog.clear()
    with pytest.raises(FileNotFoundError):
        pyckpt.load({"w": torch.zeros(4)}, tmp_path / "none")
    assert "Global metadata is not found" not in caplog.text


def test_save_into_a_regular_file_says_so(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    target.write_bytes(b"keep me")
    with pytest.raises(NotADirectoryError) as info:
        pyckpt.save({"w": torch.ones(4)}, target)
    assert info.value.filename == str(target)
    assert "names a file, not a directory" in str(info.value)
    assert "choose another path or remove the file" in str(info.value)
    assert target.read_bytes() == b"keep me"
    with pytest.raises(NotADirectoryError) as info:
        pyckpt.save({"w": torch.ones(4)}, target / "step-1")
    assert info.value.filename == str(target / "step-1")
    assert f"{target} is a file, not a directory" in str(info.value)
    assert target.read_bytes() == b"keep me"


# ------------------------------------------------------------------------ spellings


@pytest.mark.parametrize("spelling, compressed", [
    ("ZSTD", True), ("Zstd", True), (" zstd ", True), ("NONE", False), ("None", False),
    (None, False),
])
def test_compression_any_case(tmp_path: Path, spelling: str | None, compressed: bool) -> None:
    w = pyckpt.Writer(tmp_path, compression=spelling)
    assert w.compression == ("zstd" if compressed else None)
    sd = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
    dcp.save(sd, storage_writer=w, no_dist=True)
    out = {"w": torch.zeros(64, 64)}
    pyckpt.load(out, tmp_path)
    assert torch.equal(out["w"], sd["w"])
    from pyckpt import tools

    summary = tools.summarize(str(tmp_path))
    assert any(k.startswith("zstd") for k in summary.codecs) == compressed, summary.codecs


def test_refused_spellings_list_every_accepted_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        pyckpt.Writer(tmp_path, compression="lz4")
    assert str(info.value) == ("compression='lz4' is not supported; expected None, 'none' or "
                               "'zstd' (any case)")
    with pytest.raises(ValueError) as info:
        pyckpt.Writer(tmp_path, direct_io="yes")
    assert str(info.value) == ("direct_io='yes' is not supported; expected None, 'auto', 'on' or "
                               "'off' (any case)")
    assert pyckpt.Writer(tmp_path, direct_io="OFF").direct_io == "off"
    with pytest.raises(ValueError) as info:
        pyckpt.SavePlanner(check_replicas="sometimes")  # type: ignore[arg-type]
    assert str(info.value) == ("check_replicas must be True, False, 'sample' or 'full' (any "
                               "case), got 'sometimes'")
    assert pyckpt.SavePlanner(check_replicas="FULL").check_replicas == "full"  # type: ignore[arg-type]
    assert pyckpt.Reader(tmp_path, shared_filesystem="Auto").shared_filesystem == "auto"  # type: ignore[arg-type]
    with pytest.raises(ValueError) as info:
        pyckpt.Reader(tmp_path, shared_filesystem="maybe")  # type: ignore[arg-type]
    assert str(info.value) == ("shared_filesystem must be True, False or 'auto' (any case), "
                               "got 'maybe'")


def test_consolidate_and_convert_options_any_case(tmp_path: Path) -> None:
    sd = {"w": torch.randn(8, 8)}
    pyckpt.save(sd, tmp_path / "ck")
    res = pyckpt.consolidate(tmp_path / "ck", tmp_path / "hf", input_mode="MMAP")
    assert res.total_bytes == 8 * 8 * 4
    with pytest.raises(ValueError, match=r"input_mode='fast'.*'pread' or 'mmap'"):
        pyckpt.consolidate(tmp_path / "ck", tmp_path / "hf2", input_mode="fast")
    from pyckpt import tools

    assert tools.convert(tmp_path / "ck", tmp_path / "dcp", to="DCP") == "dcp"
    assert (tmp_path / "dcp" / ".metadata").is_file()


# ------------------------------------------------------------------------ find_error


def test_find_error_in_dcp_save_one_process(tmp_path: Path) -> None:
    sd = {"w": torch.ones(4)}
    pyckpt.save(sd, tmp_path)
    meta = str(tmp_path / _format.METADATA_FILE)
    with pytest.raises(CheckpointException) as info:
        dcp.save(sd, storage_writer=pyckpt.Writer(tmp_path, overwrite=False), no_dist=True)
    wrapped = info.value
    assert not isinstance(wrapped, Exception)  # why users need the helper
    err = find_error(wrapped, FileExistsError)
    assert isinstance(err, FileExistsError) and err.filename == meta
    assert "overwrite=False" in str(err)
    assert find_error(wrapped) is err  # default: the original error inside the wrapper
    assert pyckpt.find_error(wrapped, pyckpt.ChecksumError) is None
    assert find_error(wrapped, (KeyError, FileExistsError)) is err
    # pyckpt.save re-raises the error itself; the helper finds it there too.
    with pytest.raises(FileExistsError) as direct:
        pyckpt.save(sd, tmp_path, overwrite=False)
    assert find_error(direct.value, FileExistsError) is direct.value
    # An error with no pyckpt error inside.
    assert find_error(KeyboardInterrupt()) is None


def test_find_error_in_dcp_async_save(tmp_path: Path) -> None:
    sd = {"w": torch.ones(4)}
    pyckpt.save(sd, tmp_path)
    fut = dcp.async_save(sd, storage_writer=pyckpt.Writer(tmp_path, overwrite=False),
                         no_dist=True)
    with pytest.raises(BaseException) as info:
        fut.result()
    err = find_error(info.value, FileExistsError)
    assert err is not None and err.filename == str(tmp_path / _format.METADATA_FILE)


def _two_rank_overwrite_refused(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch.distributed as dist

    sd = {"w": torch.arange(8.0)}  # replicated (same on both ranks), as DDP state
    pyckpt.save(sd, path)
    dist.barrier()
    try:
        dcp.save(sd, storage_writer=pyckpt.Writer(path, overwrite=False))
    except Exception:
        return {"caught_by_except_exception": True}
    except BaseException as e:
        err = find_error(e, FileExistsError)
        return {"caught_by_except_exception": False, "type": type(e).__name__,
                "found": None if err is None else (type(err).__name__, err.filename)}
    return {"raised": False}


@pytest.mark.distributed
def test_find_error_in_dcp_save_two_ranks(tmp_path: Path) -> None:
    results = run_distributed(_two_rank_overwrite_refused, 2, str(tmp_path))
    meta = str(tmp_path / _format.METADATA_FILE)
    for r in results:  # every rank gets DCP's wrapper with the coordinator's refusal inside
        assert r == {"caught_by_except_exception": False, "type": "CheckpointException",
                     "found": ("FileExistsError", meta)}
