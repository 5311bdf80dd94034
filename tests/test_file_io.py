"""FileWriter, write_items (encode + write pipeline) and read_requests (parallel reader).

Written files are checked independently of read_requests: every chunk's stored bytes are sliced
out of the file at the recorded offset and decoded with decode_chunk, and zstd planes with the
``zstandard`` package (via test_codec's oracle).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pyckpt import _C
from pyckpt import errors as pyckpt_errors
from pyckpt.errors import CheckpointFormatError, ChecksumError

PAGE = 4096
RAW = _C.CodecParams("none", 1, 1, "none")
BF16 = _C.CodecParams("zstd", 1, 2, "group_rotl1")
ITEM_SIZES = [0, 1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE - 1, 3 * PAGE + 1, 200_000]


def _ptr(arr: np.ndarray) -> int:
    return arr.ctypes.data if arr.nbytes else 0


def write_file(
    path: Path,
    items: list[tuple[str, bytes, tuple]],
    pool,
    chunk_bytes: int = 16384,
    direct: str = "auto",
    fsync: bool = False,
    staging_block_bytes: int = 64 << 10,
) -> list[tuple[int, int, list]]:
    arrays = [np.frombuffer(data, np.uint8) for _, data, _ in items]  # kept alive for the call
    blocks = _C.BufferPool(chunk_bytes, 2 * pool.size + 2)
    with _C.FileWriter(str(path), direct, fsync, staging_block_bytes, 3) as w:
        res = w.write_items(
            [(name, _ptr(a), a.nbytes, p) for (name, _, p), a in zip(items, arrays)],
            chunk_bytes,
            pool,
            blocks,
        )
        w.commit()
    assert blocks.stats()["in_use"] == 0
    return res


def read_range(path: Path, written, params: _C.CodecParams, lo: int, hi: int, pool, name: str = "t"):
    dst = np.empty(hi - lo, np.uint8)
    seg = (str(path), 0, params, written[2])
    stats = _C.read_requests([(name, [seg], lo, hi, _ptr(dst))], pool)
    return dst.tobytes(), stats


def decode_from_file(path: Path, written, params: tuple) -> bytes:
    """Decodes an item chunk by chunk from raw file slices, without read_requests."""
    blob = path.read_bytes()
    out = []
    for rec in written[2]:
        stored_len = sum(rec[4][1::2])
        buf = bytearray(rec[1])
        _C.decode_chunk(blob[rec[0] : rec[0] + stored_len], rec, params, buf)
        out.append(bytes(buf))
    return b"".join(out)


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [RAW, BF16], ids=["raw", "zstd"])
@pytest.mark.parametrize("chunk_bytes", [PAGE, 5000, 65536], ids=["page", "misaligned", "64k"])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_write_items_read_requests_roundtrip(
    tmp_path, make_data, thread_pool_factory, threads, chunk_bytes, params
) -> None:
    pool = thread_pool_factory(threads)
    items = [(f"layer{i}.weight", make_data("bf16", n), params) for i, n in enumerate(ITEM_SIZES)]
    path = tmp_path / "0-0.pyckpt"
    res = write_file(path, items, pool, chunk_bytes=chunk_bytes)

    # Layout: items back to back in order, chunks back to back within each item.
    pos = 0
    for (_, data, _), (offset, stored, chunks) in zip(items, res):
        assert offset == pos
        assert len(chunks) == -(-len(data) // chunk_bytes)
        assert sum(c[1] for c in chunks) == len(data)
        assert all(c[1] == chunk_bytes for c in chunks[:-1])
        for c in chunks:
            assert c[0] == pos
            pos += sum(c[4][1::2])
        assert stored == pos - offset
    assert path.stat().st_size == pos

    for (name, data, p), written in zip(items, res):
        assert decode_from_file(path, written, p) == data
        got, (nread, ndecoded) = read_range(path, written, p, 0, len(data), pool, name)
        assert got == data
        assert ndecoded == len(written[2])
        assert nread == written[1]


def test_partial_reads_touch_only_overlapping_chunks(tmp_path, make_data, thread_pool_factory, rng):
    pool = thread_pool_factory(2)
    data = make_data("bf16", 300_000)
    path = tmp_path / "f"
    chunk = 16384
    (written,) = write_file(path, [("w", data, BF16)], pool, chunk_bytes=chunk)
    ranges = [(0, 1), (chunk - 1, chunk + 1), (chunk, 2 * chunk), (299_999, 300_000)]
    for _ in range(20):
        lo, hi = sorted(int(x) for x in rng.integers(0, len(data) + 1, size=2))
        ranges.append((lo, hi))
    for lo, hi in ranges:
        got, (nread, ndecoded) = read_range(path, written, BF16, lo, hi, pool)
        assert got == data[lo:hi]
        first, last = lo // chunk, (hi - 1) // chunk
        expect = written[2][first : last + 1] if hi > lo else []
        assert ndecoded == len(expect)
        assert nread == sum(sum(c[4][1::2]) for c in expect)


def test_item_split_over_two_files(tmp_path, make_data, thread_pool_factory) -> None:
    """An item whose bytes live in several files (segments with raw_begin offsets)."""
    pool = thread_pool_factory(2)
    data = make_data("bf16", 100_002)
    cut = 40_000
    wa = write_file(tmp_path / "a", [("x", data[:cut], BF16)], pool, chunk_bytes=8192)[0]
    wb = write_file(tmp_path / "b", [("x", data[cut:], BF16)], pool, chunk_bytes=8192)[0]
    segments = [(str(tmp_path / "a"), 0, BF16, wa[2]), (tmp_path / "b", cut, BF16, wb[2])]
    for lo, hi in [(0, len(data)), (cut - 5, cut + 5), (cut, cut + 1), (10, 20)]:
        dst = np.empty(hi - lo, np.uint8)
        _C.read_requests([("x", segments, lo, hi, dst.ctypes.data)], pool)
        assert dst.tobytes() == data[lo:hi]


def test_zero_byte_items_have_no_chunks(tmp_path, thread_pool_factory) -> None:
    pool = thread_pool_factory(1)
    items = [("a", b"", BF16), ("b", b"x" * 10, RAW), ("c", b"", RAW)]
    res = write_file(tmp_path / "f", items, pool)
    assert res[0] == (0, 0, [])
    assert res[2] == (10, 0, [])
    got, stats = read_range(tmp_path / "f", res[0], BF16, 0, 0, pool)
    assert got == b"" and stats == (0, 0)


def test_append_returns_offsets(tmp_path) -> None:
    path = tmp_path / "f"
    with _C.FileWriter(path, "auto", True, PAGE, 2) as w:
        assert w.path == str(path)
        assert w.append(b"a" * 5000) == 0
        assert w.append(memoryview(b"b" * 3)) == 5000
        assert w.append(np.full(PAGE * 3, 7, np.uint8)) == 5003
        assert w.size == 5003 + 3 * PAGE
        w.commit()
        assert w.committed
        with pytest.raises(RuntimeError, match="after commit"):
            w.append(b"x")
    assert path.read_bytes() == b"a" * 5000 + b"bbb" + bytes([7]) * (3 * PAGE)


def test_shared_staging_pool_is_reused(tmp_path) -> None:
    staging = _C.BufferPool(PAGE * 4, 3)
    for i in range(3):
        with _C.FileWriter(tmp_path / f"f{i}", "auto", False, staging=staging) as w:
            w.append(bytes([i]) * (PAGE * 10 + 1))
            w.commit()
        assert (tmp_path / f"f{i}").read_bytes() == bytes([i]) * (PAGE * 10 + 1)
    stats = staging.stats()
    assert stats["allocated"] <= 3 and stats["in_use"] == 0 and stats["acquires"] == 9  # 3 blocks of 16 KiB per 40 KiB file


# --------------------------------------------------------------------------------------------
# Direct I/O modes
# --------------------------------------------------------------------------------------------


def _odirect_supported(directory: Path) -> bool:
    probe = directory / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return hasattr(os, "O_DIRECT")


@pytest.mark.parametrize("direct", ["auto", "on", "off"])
def test_direct_modes(tmp_path, make_data, direct) -> None:
    supported = _odirect_supported(tmp_path)
    if direct == "on" and not supported:
        pytest.skip("this file system refuses O_DIRECT")
    data = make_data("random", 5 * PAGE * 4 + 123)  # several staging blocks + unaligned tail
    path = tmp_path / "f"
    with _C.FileWriter(path, direct, True, PAGE * 4, 2) as w:
        assert w.direct == (direct != "off" and supported)
        w.append(data)
        w.commit()
        assert w.direct == (direct != "off" and supported)
    assert path.read_bytes() == data


def test_direct_auto_falls_back_when_open_refused(tmp_path, make_data) -> None:
    data = make_data("random", 3 * PAGE + 7)
    path = tmp_path / "f"
    with _C.FileWriter(path, "auto", True, PAGE, 2, _test_fault="direct_open") as w:
        assert not w.direct
        w.append(data)
        w.commit()
    assert path.read_bytes() == data


def test_direct_on_raises_when_open_refused(tmp_path) -> None:
    path = tmp_path / "f"
    with pytest.raises(OSError) as info:
        _C.FileWriter(path, "on", True, _test_fault="direct_open")
    assert info.value.errno == errno.EINVAL
    assert info.value.filename.startswith(str(path) + ".tmp-")
    assert list(tmp_path.iterdir()) == []


def test_direct_auto_falls_back_when_first_write_refused(tmp_path, make_data) -> None:
    if not _odirect_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT (the open-time fallback covers it)")
    data = make_data("random", 10 * PAGE + 99)
    path = tmp_path / "f"
    with _C.FileWriter(path, "auto", True, 2 * PAGE, 2, _test_fault="direct_write") as w:
        assert w.direct
        w.append(data)
        w.commit()
        assert not w.direct  # switched to buffered I/O after the refused write
    assert path.read_bytes() == data


def test_direct_on_reports_refused_write(tmp_path, make_data) -> None:
    if not _odirect_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    path = tmp_path / "f"
    with pytest.raises(OSError) as info:
        with _C.FileWriter(path, "on", True, PAGE, 2, _test_fault="direct_write") as w:
            w.append(make_data("random", 10 * PAGE))
            w.commit()
    assert info.value.errno == errno.EINVAL
    assert "pwrite" in str(info.value)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Atomicity
# --------------------------------------------------------------------------------------------


def test_temp_file_is_not_visible_under_final_name(tmp_path) -> None:
    path = tmp_path / "0-0.pyckpt"
    w = _C.FileWriter(path, "auto", True, PAGE, 2)
    w.append(b"x" * (5 * PAGE + 1))
    temp = Path(w.temp_path)
    assert temp.parent == tmp_path
    assert temp.name.startswith("0-0.pyckpt.tmp-")
    assert temp.exists()
    assert not path.exists()
    w.commit()
    assert path.read_bytes() == b"x" * (5 * PAGE + 1)
    assert not temp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0-0.pyckpt"]


def test_abort_leaves_nothing(tmp_path) -> None:
    w = _C.FileWriter(tmp_path / "a", "auto", True, PAGE, 2)
    w.append(b"x" * (3 * PAGE))
    w.abort()
    w.abort()  # idempotent
    with pytest.raises(RuntimeError, match="after abort"):
        w.commit()
    with _C.FileWriter(tmp_path / "b", "off", True) as w2:
        w2.append(b"y" * 100)
    with pytest.raises(KeyError):
        with _C.FileWriter(tmp_path / "c", "auto", True) as w3:
            w3.append(b"z" * 100)
            raise KeyError("boom")
    assert list(tmp_path.iterdir()) == []


def test_commit_replaces_existing_file_atomically(tmp_path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"old" * 1000)
    with open(path, "rb") as old_reader:
        with _C.FileWriter(path, "auto", True, PAGE, 2) as w:
            w.append(b"new" * 5000)
            assert path.read_bytes() == b"old" * 1000  # untouched until the rename
            w.commit()
        assert path.read_bytes() == b"new" * 5000
        # rename, not truncate-and-rewrite: an open reader (or mmap) still sees the old bytes.
        assert old_reader.read() == b"old" * 1000


def test_abort_keeps_existing_file(tmp_path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"keep")
    with _C.FileWriter(path, "auto", True) as w:
        w.append(b"discard" * 1000)
    assert path.read_bytes() == b"keep"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_read_missing_file(tmp_path, thread_pool_factory) -> None:
    pool = thread_pool_factory(2)
    missing = tmp_path / "nope.pyckpt"
    rec = (0, 10, 0, 0, (0, 10))
    dst = np.empty(10, np.uint8)
    with pytest.raises(FileNotFoundError) as info:
        _C.read_requests([("model.w", [(str(missing), 0, RAW, [rec])], 0, 10, dst.ctypes.data)], pool)
    assert info.value.filename == str(missing)
    assert "model.w" in str(info.value)


def test_read_truncated_file(tmp_path, make_data, thread_pool_factory) -> None:
    pool = thread_pool_factory(2)
    path = tmp_path / "f"
    data = make_data("bf16", 50_000)
    (written,) = write_file(path, [("enc.w", data, BF16)], pool, chunk_bytes=8192)
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(CheckpointFormatError) as info:
        read_range(path, written, BF16, 0, len(data), pool, name="enc.w")
    assert not isinstance(info.value, ChecksumError)
    msg = str(info.value)
    assert "truncated" in msg and str(path) in msg and "enc.w" in msg
    # Chunks before the cut still read fine.
    got, _ = read_range(path, written, BF16, 0, 8192, pool)
    assert got == data[:8192]


@pytest.mark.parametrize("params", [RAW, BF16], ids=["raw", "zstd"])
def test_read_corrupted_file(tmp_path, make_data, thread_pool_factory, params) -> None:
    pool = thread_pool_factory(2)
    path = tmp_path / "f"
    data = make_data("bf16", 50_000)
    (written,) = write_file(path, [("dec.w", data, params)], pool, chunk_bytes=8192)
    blob = bytearray(path.read_bytes())
    victim = written[2][3]
    blob[victim[0] + 5] ^= 0x40
    path.write_bytes(bytes(blob))
    with pytest.raises(ChecksumError) as info:
        read_range(path, written, params, 0, len(data), pool, name="dec.w")
    msg = str(info.value)
    assert "checksum mismatch" in msg and str(path) in msg and "dec.w" in msg
    assert f"offset {victim[0]}" in msg


def test_coverage_gap_and_overlap(tmp_path, make_data, thread_pool_factory) -> None:
    pool = thread_pool_factory(1)
    path = tmp_path / "f"
    data = make_data("random", 3 * PAGE)
    (written,) = write_file(path, [("g", data, RAW)], pool, chunk_bytes=PAGE)
    chunks = written[2]
    dst = np.empty(3 * PAGE, np.uint8)
    gap = [(str(path), 0, RAW, chunks[:1]), (str(path), 2 * PAGE, RAW, chunks[2:])]
    with pytest.raises(CheckpointFormatError, match="no chunk covers raw bytes"):
        _C.read_requests([("g", gap, 0, 3 * PAGE, dst.ctypes.data)], pool)
    with pytest.raises(CheckpointFormatError, match="no chunk covers"):
        _C.read_requests([("g", [(str(path), 0, RAW, chunks)], 0, 4 * PAGE, dst.ctypes.data)], pool)
    overlap = [(str(path), 0, RAW, chunks[:2]), (str(path), PAGE, RAW, chunks[1:])]
    with pytest.raises(CheckpointFormatError, match="overlap"):
        _C.read_requests([("g", overlap, 0, 3 * PAGE, dst.ctypes.data)], pool)
    # The part that is covered reads fine.
    _C.read_requests([("g", gap, 0, PAGE, dst.ctypes.data)], pool)
    assert dst[:PAGE].tobytes() == data[:PAGE]


def test_malformed_record_names_the_tensor(tmp_path, thread_pool_factory) -> None:
    pool = thread_pool_factory(1)
    dst = np.empty(10, np.uint8)
    seg = [str(tmp_path / "f"), 0, RAW, [[0, 10, 0, 9, [0, 10]]]]  # JSON-shaped, bad transform
    with pytest.raises(CheckpointFormatError, match="emb.weight"):
        _C.read_requests([["emb.weight", [seg], 0, 10, dst.ctypes.data]], pool)
    with pytest.raises(TypeError, match="ReadRequest"):
        _C.read_requests([("emb.weight", [seg], 0, 10)], pool)


def test_create_under_regular_file_is_enotdir(tmp_path) -> None:
    """Works as root too (root bypasses permission bits, not ENOTDIR)."""
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(NotADirectoryError) as info:
        _C.FileWriter(blocker / "x.pyckpt", "auto", True)
    assert info.value.filename.startswith(str(blocker / "x.pyckpt"))
    with pytest.raises(FileNotFoundError):
        _C.FileWriter(tmp_path / "no" / "such" / "dir", "off", True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses directory permissions")
def test_create_in_readonly_dir_is_permission_error(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        with pytest.raises(PermissionError) as info:
            _C.FileWriter(ro / "x", "auto", True)
        assert info.value.filename.startswith(str(ro / "x"))
    finally:
        ro.chmod(0o700)


_EFBIG_SCRIPT = textwrap.dedent(
    """
    import resource, signal, sys
    import numpy as np
    from pyckpt import _C

    # The caller's job (see FileWriter docs): with SIGXFSZ ignored, EFBIG arrives as errno.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    path, direct = sys.argv[1], sys.argv[2]
    data = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    pool = _C.ThreadPool(2)
    blocks = _C.BufferPool(1 << 16, 6)
    try:
        with _C.FileWriter(path, direct, True, 256 << 10, 3) as w:
            items = [("big.weight", data.ctypes.data, data.nbytes, _C.CodecParams("none", 1, 1, "none"))]
            w.write_items(items, 1 << 16, pool, blocks)
            w.commit()
    except OSError as e:
        print("ERRNO", e.errno)
        print("FILENAME", e.filename)
        print("MESSAGE", e)
        sys.exit(0)
    print("NO ERROR")
    """
)


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_write_failing_midway_reports_efbig(tmp_path, direct) -> None:
    target = tmp_path / "out" / "0-0.pyckpt"
    target.parent.mkdir()
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", _EFBIG_SCRIPT, str(target), direct],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["ERRNO"] == str(errno.EFBIG), proc.stdout
    assert lines["FILENAME"].startswith(str(target) + ".tmp-")
    assert "big.weight" in lines["MESSAGE"]
    assert list(target.parent.iterdir()) == []  # no final file, no temp file


def test_write_items_rejects_small_blocks(tmp_path, thread_pool_factory) -> None:
    pool = thread_pool_factory(1)
    data = np.zeros(100_000, np.uint8)
    with _C.FileWriter(tmp_path / "f", "auto", False) as w:
        with pytest.raises(ValueError, match="smaller than"):
            w.write_items([("w", data.ctypes.data, data.nbytes, BF16)], 65536, pool, _C.BufferPool(PAGE, 2))
        # Params cross the binding as a validated CodecParams object, never as a tuple.
        with pytest.raises(TypeError, match=r"write item params must be a pyckpt\._C\.CodecParams"):
            w.write_items([("w", data.ctypes.data, data.nbytes, ("zstd", 1, 2, "group"))], PAGE, pool, _C.BufferPool(PAGE, 2))


def test_pools_basics() -> None:
    pool = _C.ThreadPool(3)
    assert pool.size == 3
    pool.shutdown()
    with pytest.raises(ValueError):
        _C.ThreadPool(0)
    blocks = _C.BufferPool(5000, 2)
    assert blocks.block_bytes == 8192
    stats = blocks.stats()
    assert set(stats) == {"block_bytes", "max_blocks", "allocated", "in_use", "peak_in_use", "acquires", "pinned"}
    assert stats["max_blocks"] == 2 and stats["allocated"] == 0 and stats["pinned"] is False


def test_shut_down_pool_is_reported(tmp_path) -> None:
    pool = _C.ThreadPool(1)
    pool.shutdown()
    data = np.zeros(10_000, np.uint8)
    with _C.FileWriter(tmp_path / "f", "auto", False) as w:
        with pytest.raises(RuntimeError, match="shutdown"):
            w.write_items([("w", data.ctypes.data, data.nbytes, RAW)], PAGE, pool, _C.BufferPool(PAGE, 2))
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Hostile input: every length is checked before anything is allocated or read for it, data files
# must be regular files, and errors never disclose the bytes read.
# --------------------------------------------------------------------------------------------

_PEAK_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    from pyckpt import _C

    def peak_mib():
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024

    # The peak RSS is inherited from the parent across fork/exec: reset it (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = peak_mib()
    try:
        exec(sys.argv[2])
        outcome = "OK"
    except Exception as e:  # reported to the test, which checks the type
        outcome = type(e).__name__ + ": " + str(e)
    print("GROWTH_MIB", peak_mib() - before)
    print("OUTCOME", outcome)
    """
)


def _peak_growth(code: str, timeout: float = 120) -> tuple[float, str]:
    """Runs `code` (with `_C` imported) in a fresh interpreter; returns its peak RSS growth."""
    root = str(Path(_C.__file__).parent.parent)
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, root, code],
        capture_output=True, text=True, timeout=timeout, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    return float(lines["GROWTH_MIB"]), lines["OUTCOME"]


def test_huge_stored_length_is_refused_before_allocating(tmp_path, thread_pool_factory) -> None:
    pool = thread_pool_factory(2)
    path = tmp_path / "f"
    path.write_bytes(bytes(4096))
    dst = np.empty(4096, np.uint8)
    one_tib = 1 << 40
    # A zstd plane claiming a 1 TiB stored length in a 4 KiB file.
    for raw_len, match in [(4096, "stores"), (2 * one_tib, "chunk size limit")]:
        seg = (str(path), 0, _C.CodecParams("zstd", 1, 1, "none"), [(0, raw_len, 0, 0, (1, one_tib))])
        with pytest.raises(CheckpointFormatError, match=match) as info:
            _C.read_requests([("huge.w", [seg], 0, 4096, dst.ctypes.data)], pool)
        assert str(path) in str(info.value) and "huge.w" in str(info.value)
    # Within every limit but past the end of the file: Truncated, from fstat, before reading.
    seg = (str(path), 0, _C.CodecParams("none", 1, 1, "none"), [(4000, 200, 0, 0, (0, 200))])
    with pytest.raises(CheckpointFormatError, match="file holds 4096 bytes"):
        _C.read_requests([("t", [seg], 0, 200, dst.ctypes.data)], pool)


def _zeros_frame(n: int) -> bytes:
    """One zstd frame of `n` zero bytes (declaring its size), built without holding n bytes."""
    import zstandard

    c = zstandard.ZstdCompressor(write_content_size=True).compressobj(size=n)
    step = bytes(1 << 20)
    parts = [c.compress(step) for _ in range(n // len(step))]
    parts.append(c.compress(bytes(n % len(step))))
    parts.append(c.flush())
    return b"".join(parts)


def test_large_raw_len_claim_does_not_allocate_it(tmp_path) -> None:
    """A 1 GiB chunk of zeros is a ~32 KiB zstd frame; read partially (the scratch path), it used
    to be decoded whole into per-thread scratch. It is above the chunk-size limit: refused."""
    raw_len = 1 << 30
    frame = _zeros_frame(raw_len)
    path = tmp_path / "bomb"
    path.write_bytes(frame)
    code = textwrap.dedent(
        f"""
        import numpy as np
        dst = np.empty(100, np.uint8)
        rec = (0, {raw_len}, {_C.xxh64(frame)}, 0, (1, {len(frame)}))
        seg = ({str(path)!r}, 0, _C.CodecParams("zstd", 1, 1, "none"), [rec])
        _C.read_requests([("bomb.w", [seg], 0, 100, dst.ctypes.data)], _C.ThreadPool(2))
        """
    )
    growth, outcome = _peak_growth(code)
    assert outcome.startswith("CheckpointFormatError"), outcome
    assert growth < 128, f"peak RSS grew by {growth:.0f} MiB"


def test_chunk_size_limit_on_write(tmp_path, thread_pool_factory) -> None:
    pool = thread_pool_factory(1)
    data = np.zeros(PAGE, np.uint8)
    with _C.FileWriter(tmp_path / "f", "off", False) as w:
        with pytest.raises(ValueError, match="chunk_bytes"):
            w.write_items([("w", data.ctypes.data, data.nbytes, RAW)], _C.MAX_CHUNK_BYTES + 1,
                          pool, _C.BufferPool(PAGE, 2))


_FIFO_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from pyckpt import _C
    dst = np.empty(16, np.uint8)
    seg = (sys.argv[2], 0, _C.CodecParams("none", 1, 1, "none"), [(0, 16, 0, 0, (0, 16))])
    try:
        _C.read_requests([("fifo.w", [seg], 0, 16, dst.ctypes.data)], _C.ThreadPool(1))
    except Exception as e:
        print(type(e).__name__, e)
    """
)


def test_fifo_data_file_fails_fast(tmp_path) -> None:
    """Opening a FIFO for reading used to wait forever for a writer."""
    fifo = tmp_path / "0-0.abc.pyckpt"
    os.mkfifo(fifo)
    root = str(Path(_C.__file__).parent.parent)
    proc = subprocess.run(
        [sys.executable, "-c", _FIFO_SCRIPT, root, str(fifo)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("CheckpointFormatError"), proc.stdout
    assert str(fifo) in proc.stdout and "a FIFO" in proc.stdout and "fifo.w" in proc.stdout


def test_data_file_symlink_is_not_followed(tmp_path, make_data, thread_pool_factory) -> None:
    pool = thread_pool_factory(1)
    real = tmp_path / "real"
    data = make_data("random", 3 * PAGE)
    (written,) = write_file(real, [("w", data, RAW)], pool, chunk_bytes=PAGE)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OSError) as info:
        read_range(link, written, RAW, 0, len(data), pool, name="w")
    assert info.value.errno == errno.ELOOP and info.value.filename == str(link)
    with pytest.raises(CheckpointFormatError, match="a directory"):
        read_range(tmp_path, written, RAW, 0, len(data), pool, name="w")
    assert read_range(real, written, RAW, 0, len(data), pool)[0] == data


def test_checksum_error_does_not_reveal_the_bytes_read(tmp_path, thread_pool_factory) -> None:
    """A record pointing into another file must not learn that file's hash from the error."""
    pool = thread_pool_factory(1)
    secret = tmp_path / "secret"
    secret.write_bytes(b"password=hunter2\n" * 4)
    dst = np.empty(8, np.uint8)
    seg = (str(secret), 0, _C.CodecParams("none", 1, 1, "none"), [(0, 8, 12345, 0, (0, 8))])
    with pytest.raises(ChecksumError) as info:
        _C.read_requests([("t.w", [seg], 0, 8, dst.ctypes.data)], pool)
    msg = str(info.value)
    assert "checksum mismatch" in msg and str(secret) in msg and "t.w" in msg
    assert "offset 0" in msg
    computed = _C.xxh64(b"password")
    assert f"{computed:016x}" not in msg and str(computed) not in msg
    assert "computed" not in msg


def test_verify_segments_decodes_each_chunk_once_in_bounded_memory(tmp_path) -> None:
    """A legitimately large chunk (256 MiB of zeros, the limit) is checked through a small
    window: memory does not grow with its raw size."""
    n = _C.MAX_CHUNK_BYTES
    frame = _zeros_frame(n)
    path = tmp_path / "z"
    path.write_bytes(frame)
    rec = (0, n, _C.xxh64(frame), 0, (1, len(frame)))
    code = textwrap.dedent(
        f"""
        seg = ({str(path)!r}, 0, _C.CodecParams("zstd", 1, 1, "none"), [{rec!r}])
        print("STATS", _C.verify_segments("z.w", [seg], _C.ThreadPool(2)))
        """
    )
    growth, outcome = _peak_growth(code)
    assert outcome == "OK", outcome
    assert growth < 64, f"peak RSS grew by {growth:.0f} MiB"
    # And a corrupt frame is still found.
    bad = bytearray(frame)
    bad[len(bad) // 2] ^= 0xFF
    path.write_bytes(bytes(bad))
    rec_bad = (0, n, _C.xxh64(bytes(bad)), 0, (1, len(bad)))
    pool = _C.ThreadPool(1)
    with pytest.raises((CheckpointFormatError, pyckpt_errors.CompressionError)):
        _C.verify_segments("z.w", [(str(path), 0, _C.CodecParams("zstd", 1, 1, "none"), [rec_bad])], pool)


def test_cli_verify_memory_does_not_grow_with_chunk_size(tmp_path) -> None:
    """`pyckpt verify` used to decode a large chunk once per 64 MiB window (quadratic time) into
    scratch as large as the chunk; each chunk is now decoded once through a small window."""
    import torch
    import torch.distributed.checkpoint as dcp

    import pyckpt

    n = 256 << 20  # the chunk-size limit (_C.MAX_CHUNK_BYTES)
    dcp.save({"z": torch.zeros(n, dtype=torch.uint8)}, no_dist=True,
             storage_writer=pyckpt.Writer(tmp_path, compression="zstd", chunk_bytes=n))
    code = textwrap.dedent(
        f"""
        from pyckpt import tools
        report = tools.verify({str(tmp_path)!r}, threads=2)
        assert report.ok and report.chunks_checked == 1, report
        """
    )
    growth, outcome = _peak_growth(code)
    assert outcome == "OK", outcome
    assert growth < 64, f"peak RSS grew by {growth:.0f} MiB"
