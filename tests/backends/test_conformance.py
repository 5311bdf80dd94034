"""The backend conformance suite: every backend (posix, memory, s3 on a real SeaweedFS, peer)
keeps the same promises.

- Commit rule: data first, metadata last; a failed commit removes only its own data and
  leaves the previous checkpoint loadable bit-exact.
- Once the metadata is committed, a failed clean-up is a warning logged once, never an error.
- Ranged reads decode exactly the requested bytes from the chunks that overlap them.
- Of two saves overlapping in time, never both succeed.
- Stale data (other saves' files, crashed temp files) is removed by the next commit.
- Hostile names are refused; errors are typed and name the location.
"""

from __future__ import annotations

import errno
import json
import logging
from typing import Any

import numpy as np
import pytest
import torch
from _backend_places import Place

from pyckpt import _C
from pyckpt._format import METADATA_FILE
from pyckpt.backends.base import SaveState, overlapping_chunks, stored_len
from pyckpt.errors import CheckpointFormatError, ConcurrentSaveError, ObjectStoreError


def _sd(seed: int, n: int = 50_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(7, 3, generator=g),
            "step": seed}


def _empty(n: int = 50_000) -> dict[str, Any]:
    return {"w": torch.zeros(n), "b": torch.zeros(7, 3), "step": -1}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"]
    for k in ("w", "b"):
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k


def _document_files(place: Place) -> set[str]:
    return set(place.backend().read_index().files)


def _data_names(place: Place) -> set[str]:
    return set(place.backend().list_names())


def _failure(place: Place) -> OSError:
    """The error a backend's client raises for a store that went away."""
    if place.kind == "s3":
        return ObjectStoreError(errno.EIO, "injected: connection refused", place.location)
    return OSError(errno.EIO, "injected: I/O error", place.location)


# -------------------------------------------------------------------------- round trip


def test_round_trip_is_bit_exact(place: Place) -> None:
    sd = _sd(1)
    place.save(sd, compression="zstd")
    out = _empty()
    place.load(out)
    _same(out, sd)


# -------------------------------------------------------------------------- commit rule


def test_metadata_is_written_after_every_data_file(place: Place,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cls = type(place.backend())
    real = cls.put_metadata
    seen: list[set[str]] = []

    def put_metadata(self: Any, encoded: bytes, state: SaveState) -> None:
        named = set(json.loads(encoded)["files"])
        assert named and named <= set(self.list_names()), "metadata before its data"
        seen.append(named)
        real(self, encoded, state)

    monkeypatch.setattr(cls, "put_metadata", put_metadata)
    place.save(_sd(2))
    assert seen == [_document_files(place)]


def test_a_failed_commit_leaves_the_previous_checkpoint(place: Place,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    first = _sd(3)
    place.save(first)
    before = _data_names(place)
    cls = type(place.backend())
    real = cls.put_metadata

    def put_metadata(self: Any, encoded: bytes, state: SaveState) -> None:
        raise _failure(place)

    monkeypatch.setattr(cls, "put_metadata", put_metadata)
    with pytest.raises(OSError, match="injected"):
        place.save(_sd(4))
    monkeypatch.setattr(cls, "put_metadata", real)
    assert _data_names(place) == before  # the failed save removed its own data, nothing else
    out = _empty()
    place.load(out)
    _same(out, first)


def test_clean_up_failure_after_the_commit_is_a_warning(
    place: Place, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 24 item 2: once the metadata is committed, the save has succeeded."""
    place.save(_sd(5))
    old = _data_names(place)
    cls = type(place.backend())
    real = cls.delete

    def delete(self: Any, names: Any) -> None:
        raise _failure(place)

    monkeypatch.setattr(cls, "delete", delete)
    with caplog.at_level(logging.WARNING, logger="pyckpt.backends"):
        place.save(_sd(6))  # committed: no exception
        place.save(_sd(7))
    warnings = [r for r in caplog.records if "removing files of earlier saves failed" in
                r.getMessage()]
    assert len(warnings) == 1, caplog.text  # logged once
    assert place.location in warnings[0].getMessage()
    out = _empty()
    place.load(out)
    _same(out, _sd(7))
    assert old < _data_names(place)  # left for the next save
    monkeypatch.setattr(cls, "delete", real)
    place.save(_sd(8))
    assert _data_names(place) == _document_files(place)


# -------------------------------------------------------------------------- stale data


def test_the_next_commit_removes_stale_data(place: Place) -> None:
    place.save(_sd(9))
    first = _data_names(place)
    orphan = "1-0.0123456789ab.pyckpt"  # a crashed save's data file
    with place.backend().data_sink(orphan, {}) as sink:
        sink.append(b"x" * 100)
        sink.commit()
    assert orphan in _data_names(place)
    place.save(_sd(10))
    names = _data_names(place)
    assert orphan not in names and not (first & names)
    assert names == _document_files(place)


# -------------------------------------------------------------------------- ranged reads


def test_ranged_reads_decode_only_the_overlapping_chunks(place: Place) -> None:
    sd = _sd(11)
    place.save(sd, chunk_bytes=4096, compression="zstd")
    backend = place.backend()
    index = backend.read_index()
    piece = index.tensors["w"].pieces[0]
    raw = sd["w"].numpy().view(np.uint8)
    with _C.ThreadPool(2) as pool:
        for lo, hi in [(5000, 13000), (0, 4096), (4095, 4097), (0, raw.size),
                       (raw.size - 3, raw.size)]:
            out = np.zeros(hi - lo, dtype=np.uint8)
            wanted = overlapping_chunks(piece.segments, lo, hi)
            with backend.reads(pool) as read:
                nread, ndecoded = read([("w", piece.segments, lo, hi, out.ctypes.data)])
            assert out.tobytes() == raw[lo:hi].tobytes(), (lo, hi)
            assert ndecoded == len(wanted), (lo, hi)
            assert nread == sum(stored_len(rec) for _, _, _, rec in wanted), (lo, hi)


# -------------------------------------------------------------------------- concurrency


def test_two_overlapping_saves_never_both_commit(place: Place) -> None:
    """At the seam: B sets up while A is between set-up and commit. Either B is refused at
    set-up (a lock) or the later commit fails (a condition); never both commit."""
    a, b = place.backend(), place.backend()
    state_a = a.begin_save(True, True)
    try:
        try:
            state_b = b.begin_save(True, True)
        except BlockingIOError as e:
            assert place.location in str(e) or place.location in str(e.filename)
            return
        a.put_metadata(b"A", state_a)
        with pytest.raises(ConcurrentSaveError) as info:
            b.put_metadata(b"B", state_b)
        assert info.value.filename == b.url_of(METADATA_FILE)
        assert a.metadata_is(b"A")
        state_b.end()
    finally:
        state_a.end()
    again = place.backend().begin_save(True, True)  # the place is free again
    again.end()


# -------------------------------------------------------------------------- hostile names


@pytest.mark.parametrize("name", ["../0-0.0123456789ab.pyckpt", "a/0-0.0123456789ab.pyckpt",
                                  "..", "", "0-0.0123456789ab.pyckpt/..", "evil.txt"])
def test_hostile_names_are_refused(place: Place, name: str) -> None:
    backend = place.backend()
    with pytest.raises(CheckpointFormatError, match="illegal"):
        with backend.data_sink(name, {}) as sink:
            sink.commit()
    with pytest.raises(CheckpointFormatError, match="illegal"):
        backend.delete([name])


# -------------------------------------------------------------------------- typed errors


def test_no_checkpoint_is_a_file_not_found_naming_the_location(place: Place) -> None:
    if place.kind in ("posix", "peer"):
        import os

        os.makedirs(place.location, exist_ok=True)
    with pytest.raises(FileNotFoundError) as info:
        place.load(_empty())
    assert place.location in str(info.value.filename) + str(info.value)


def test_a_missing_data_file_is_named(place: Place) -> None:
    place.save(_sd(12))
    backend = place.backend()
    name = sorted(_document_files(place))[0]
    backend.delete([name])
    with pytest.raises(FileNotFoundError) as info:
        place.load(_empty())
    assert info.value.filename == backend.url_of(name)


def test_a_foreign_url_scheme_is_refused_naming_it() -> None:
    from pyckpt.backends import open_backend

    for url in ("gs://bucket/ckpt", "S3://bucket/ckpt", "file:///tmp/x"):
        with pytest.raises(ValueError, match="unsupported URL scheme") as info:
            open_backend(url)
        assert url in str(info.value)
