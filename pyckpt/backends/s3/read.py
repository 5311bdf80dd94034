"""The read path of the S3 backend: the metadata validated against one LIST, ranged GETs of
exactly the chunks a request overlaps, and the staging of a checkpoint for consolidation.

For each batch of read requests, exactly the stored ranges of the chunks that overlap the
requested bytes are fetched with ranged GETs (many in flight, GIL released), then verified and
decoded natively in place (:func:`pyckpt._C.read_requests` with ``sources`` lends the downloaded
buffers through ``ChunkSource::view_at``).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable
from typing import Any

from pyckpt import _C, _background, _format
from pyckpt._format import METADATA_FILE
from pyckpt.backends.base import ReadRequest, overlapping_chunks, stage_shares, stored_len
from pyckpt.backends.s3.client import Location, _obstore
from pyckpt.errors import CheckpointFormatError, ObjectStoreError

__all__ = ["Fetcher", "read_index", "stage_checkpoint"]

# Ranged GETs: a range holds whole chunks, up to about this many bytes; this many in flight.
_RANGE_BYTES = 8 << 20
_GET_CONCURRENCY = 16
# Stored bytes downloaded and held at once by one read batch.
_FETCH_BATCH_BYTES = 256 << 20


class _DataFiles(_format.DataFiles):
    """The data objects of a checkpoint, checked against one LIST of the prefix."""

    def __init__(self, loc: Location, meta: str) -> None:
        super().__init__(loc.url, meta)
        self.loc = loc
        self._listing: dict[str, int] | None = None

    def check_file(self, name: str, size: int) -> str:
        url = self.loc.url_of(name)
        if self._listing is None:
            self._listing = self.loc.list_names()
        have = self._listing.get(name)
        if have is None:
            raise FileNotFoundError(
                errno.ENOENT, f"data object of checkpoint {self.loc.url!r} is missing", url
            )
        if have < size:
            raise CheckpointFormatError(
                f"{url}: data object is truncated: {have} bytes, expected {size}"
            )
        return url


    def read_shards(self, refs: list[Any]) -> list[tuple[bytes, str]]:
        """The metadata shards ``refs`` of a version-4 checkpoint: one ranged GET each, in
        parallel."""
        for ref in refs:
            self.check_file(ref.file, ref.offset + ref.length)

        def get(ref: Any) -> tuple[bytes, str]:
            data = self.loc.get_range(ref.file, ref.offset, ref.offset + ref.length)
            return bytes(data), self.loc.url_of(ref.file)

        return _background.map_parallel(get, refs, _GET_CONCURRENCY)


def read_index(loc: Location, lazy: bool = False) -> _format.CheckpointIndex:
    """Reads and validates ``pyckpt.json`` of ``loc`` exactly as :func:`_format.read_index`
    does for a directory: object names must be plain data object names (checked before any
    data object is looked at), and every data object must exist with at least its size.

    Raises:
        FileNotFoundError: no ``pyckpt.json`` (or a missing bucket, or a missing data object).
        PermissionError: the store refused the credentials.
        CheckpointFormatError: as :func:`_format.read_index`.
    """
    meta = loc.url_of(METADATA_FILE)
    raw = loc.get(METADATA_FILE, _format.MAX_METADATA_BYTES)
    return _format.validate(raw, meta, _DataFiles(loc, meta), lazy=lazy)


def _needed(request: Any) -> list[tuple[int, int, str, int, int]]:
    """(raw_a, raw_b, url, stored_off, stored_end) of the chunks overlapping a request."""
    _, segments, lo, hi, _ = request
    out = [(a, b, segments[si][0], rec[0], rec[0] + stored_len(rec))
           for a, b, si, rec in overlapping_chunks(segments, lo, hi)]
    out.sort()
    return out


def _split(request: Any, budget: int) -> list[tuple[Any, int, list[tuple[str, int, int]]]]:
    """Cuts a request at chunk boundaries into pieces whose chunks hold about ``budget`` stored
    bytes; returns (piece, stored bytes, chunk ranges)."""
    name, segments, lo, hi, dst = request
    pieces = []
    cur_lo, cur_bytes, cur_ranges = lo, 0, []
    for _a, b, url, s0, s1 in _needed(request):
        cur_ranges.append((url, s0, s1))
        cur_bytes += s1 - s0
        if cur_bytes >= budget and b < hi:
            pieces.append((ReadRequest(name, segments, cur_lo, b, dst + (cur_lo - lo)), cur_bytes,
                           cur_ranges))
            cur_lo, cur_bytes, cur_ranges = b, 0, []
    if cur_lo < hi:
        pieces.append((ReadRequest(name, segments, cur_lo, hi, dst + (cur_lo - lo)), cur_bytes,
                       cur_ranges))
    return pieces


def _coalesce(ranges: Iterable[tuple[str, int, int]]) -> dict[str, list[tuple[int, int]]]:
    """Per object, the chunk ranges merged into GET ranges: adjacent chunks join until a range
    holds about _RANGE_BYTES; a chunk is never split (it is decoded from one buffer)."""
    by_url: dict[str, list[tuple[int, int]]] = {}
    for url, s0, s1 in ranges:
        if s1 > s0:
            by_url.setdefault(url, []).append((s0, s1))
    out: dict[str, list[tuple[int, int]]] = {}
    for url, rs in by_url.items():
        rs = sorted(set(rs))
        merged: list[list[int]] = []
        for s0, s1 in rs:
            if merged and (s0 < merged[-1][1] or (
                s0 == merged[-1][1] and merged[-1][1] - merged[-1][0] < _RANGE_BYTES
            )):
                merged[-1][1] = max(merged[-1][1], s1)
            else:
                merged.append([s0, s1])
        out[url] = [(a, b) for a, b in merged]
    return out


class Fetcher:
    """Serves read requests of checkpoint ``loc``: ranged GETs of the needed chunks, then the
    native verify+decode over the downloaded buffers.

    Attributes:
        bytes_fetched: bytes downloaded from data objects so far.
        requests_made: ranged GETs made so far.
    """

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self.bytes_fetched = 0
        self.requests_made = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _download(self, ranges: dict[str, list[tuple[int, int]]]) -> dict[str, _C.MemorySource]:
        jobs = [(url, a, b) for url, rs in ranges.items() for a, b in rs]
        names = {url: self.loc.name_of(url) for url in ranges}
        # A short object is caught by the length check below; the source's size only bounds
        # the records against what was downloaded.
        sources = {url: _C.MemorySource(max(b for _, b in rs), []) for url, rs in ranges.items()}
        if not jobs:
            return sources

        def fetch(job: tuple[str, int, int]) -> tuple[str, int, Any]:
            url, a, b = job
            data = self.loc.get_range(names[url], a, b)
            if len(data) != b - a:
                raise CheckpointFormatError(
                    f"{url}: data object is truncated: GET bytes {a}-{b - 1} returned "
                    f"{len(data)} bytes"
                )
            with self._lock:
                self.bytes_fetched += len(data)
                self.requests_made += 1
            return url, a, data

        for url, a, data in _background.map_parallel(fetch, jobs, _GET_CONCURRENCY):
            sources[url].ranges.append(_C.MemoryRange(a, data))
        return sources

    def read_requests(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        """As :func:`pyckpt._C.read_requests`; fetches in batches of about _FETCH_BATCH_BYTES."""
        nread = ndecoded = 0
        batch: list[Any] = []
        ranges: list[tuple[str, int, int]] = []
        held = 0

        def flush() -> None:
            nonlocal batch, ranges, held, nread, ndecoded
            if batch:
                sources = self._download(_coalesce(ranges))
                stats = _C.read_requests(batch, pool, sources)
                nread += stats.bytes_read
                ndecoded += stats.chunks
            batch, ranges, held = [], [], 0

        for request in requests:
            for piece, nbytes, rs in _split(request, _FETCH_BATCH_BYTES):
                if batch and held + nbytes > _FETCH_BATCH_BYTES:
                    flush()
                batch.append(piece)
                ranges.extend(rs)
                held += nbytes
        flush()
        return _C.ReadStats(nread, ndecoded)

    def read_stored(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        """As :func:`pyckpt._C.read_stored`: the chunks' stored bytes, fetched and verified."""
        rs = [(seg[0], c[0], c[0] + stored_len(c)) for r in requests for seg in r[1] for c in seg[3]]
        return _C.read_stored(requests, pool, self._download(_coalesce(rs)))

    def verify_segments(self, name: str, segments: list[Any], pool: Any) -> _C.ReadStats:
        """As :func:`pyckpt._C.verify_segments`, one segment at a time (bounded memory)."""
        nread = nchecked = 0
        for seg in segments:
            rs = [(seg[0], c[0], c[0] + stored_len(c)) for c in seg[3]]
            sources = self._download(_coalesce(rs))
            stats = _C.verify_segments(name, [seg], pool, sources)
            nread += stats.bytes_read
            nchecked += stats.chunks
        return _C.ReadStats(nread, nchecked)


def stage_checkpoint(loc: Location, directory: str,
                     share: tuple[int, int] | None = None) -> list[str]:
    """Downloads the pyckpt checkpoint at ``loc`` (validated metadata, then its data objects,
    streamed) into ``directory``, which then holds the same checkpoint as files.

    Args:
        loc: the checkpoint.
        directory: created if needed.
        share: ``(rank, world)``: download only that rank's share of the data objects
            (:func:`stage_shares`); ``directory`` then holds a node-local checkpoint.

    Returns:
        The names of the data objects downloaded.
    """
    _obstore()  # ImportError naming the client when it is missing

    index = read_index(loc)  # names validated; objects checked against a listing
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, METADATA_FILE), "wb") as f:
        f.write(_format.single_document(index) if index.version == 4 else
                loc.get(METADATA_FILE, _format.MAX_METADATA_BYTES))

    def fetch(name: str) -> None:
        download(loc, name, os.path.join(directory, name), fsync=False)

    names = list(index.files)
    if share is not None:
        names = stage_shares(index.files, share[1])[share[0]]
    _background.map_parallel(fetch, names, 8)
    return names


def download(loc: Location, name: str, path: str, fsync: bool = True) -> int:
    """Streams object ``name`` into local file ``path``; returns its size.

    Raises:
        FileNotFoundError (no such object), ObjectStoreError...: typed, naming the object's URL.
    """
    obstore = _obstore()

    url = loc.url_of(name)
    size = 0
    try:
        stream = obstore.get(loc.store(), loc.key(name)).stream(min_chunk_size=8 << 20)
        with open(path, "wb") as f:
            for part in stream:
                f.write(part)
                size += len(part)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except OSError as e:
        if e.filename == url or isinstance(e, ObjectStoreError):
            raise
        raise loc.error(e, "GET", url) from e
    except Exception as e:
        raise loc.error(e, "GET", url) from e
    return size
