"""The S3 backend (Amazon S3 and S3-compatible stores, through ``obstore``).

A checkpoint at ``s3://bucket/prefix`` is the same set of objects a directory holds as files.
Jobs by module: :mod:`.client` (URL, client configuration, object operations, typed errors),
:mod:`.upload` (data objects uploaded while encoded; files uploaded whole), :mod:`.read`
(metadata validation against one LIST, ranged GETs of the chunks a request overlaps, staging for
consolidation). This module is the :class:`~pyckpt.backends.base.Backend`: save set-up and the
conditional metadata PUT that the shared commit rule (:func:`~pyckpt.backends.base.commit_save`)
drives. Usage and the consistency model: docs/OBJECT_STORES.md.

Threads: obstore's own concurrency (multipart parts and ranged GETs in flight) is this backend's
detail; the GETs of one read batch run in a short-lived pool owned by the call.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Mapping
from typing import Any

from pyckpt import _C, _format
from pyckpt._format import METADATA_FILE
from pyckpt._paths import temp_name
from pyckpt.backends.base import (
    ANY,
    ReadRequest,
    SaveState,
    WholePlace,
    check_name,
    delete_checkpoint,
    direct_reads,
)
from pyckpt.backends.s3.client import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_PART_BYTES,
    Location,
    location,
)
from pyckpt.backends.s3.read import Fetcher, download, read_index, stage_checkpoint
from pyckpt.backends.s3.upload import DataUpload, _plain_key, check_part_bytes, upload_file

__all__ = ["S3Backend"]


class S3Backend(WholePlace):
    """A checkpoint under an object-store prefix (:class:`~pyckpt.backends.base.Backend`).

    No lock: a save records the ETag of the metadata it replaces, and its commit is a PUT
    conditional on it (``If-Match``; ``If-None-Match: *`` when there was none), so of two
    overlapping saves only the first to commit succeeds; the other raises
    :class:`~pyckpt.errors.ConcurrentSaveError` and removes only its own objects.
    """

    in_place = False  # objects: staged into a local directory for the native consolidator
    exchanges_chunks = False
    shares_page_cache = False  # every rank's GET is paid and fetched
    collective_loads = False
    bytes_from_peers = 0
    default_chunk_bytes = DEFAULT_CHUNK_BYTES

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *,
                 part_bytes: int | None = None) -> None:
        self.loc: Location = location(url, storage_options)
        self.location = self.loc.url
        self.part_bytes = check_part_bytes(part_bytes) if part_bytes else DEFAULT_PART_BYTES
        self._fetcher: Fetcher | None = None

    def __repr__(self) -> str:
        return f"S3Backend({self.location!r})"

    # -- save ------------------------------------------------------------------------------

    def begin_save(self, is_coordinator: bool, overwrite: bool) -> SaveState:
        """Checks the bucket is reachable (typed errors naming the URL) and, on the
        coordinator, records the ETag of the metadata the save will replace and the data
        objects there (:attr:`SaveState.present`: its clean-up removes no other, since an
        object uploaded later may be a save's that set up after this one committed).

        Raises:
            FileExistsError: ``overwrite=False`` and ``pyckpt.json`` exists.
        """
        self.loc.check_bucket()
        state = SaveState(is_coordinator)
        if not is_coordinator:
            return state
        meta = self.loc.head_meta(METADATA_FILE)
        # Listed after the HEAD: an object of a save that commits in between is either listed
        # here or fails this save's commit (its condition is that save's predecessor).
        state.present = frozenset(self.list_names())
        if meta is None:
            return state
        if not overwrite:
            raise FileExistsError(
                errno.EEXIST,
                "Checkpoint already exists and overwrite=False; pass overwrite=True or choose "
                "another prefix",
                self.loc.url_of(METADATA_FILE),
            )
        etag = meta.get("e_tag")
        state.base = str(etag) if etag else ANY
        return state

    def data_sink(self, name: str, options: Mapping[str, Any]) -> DataUpload:
        return DataUpload(self.loc, name, self.part_bytes, DEFAULT_MAX_CONCURRENCY)

    def put_metadata(self, encoded: bytes, state: SaveState) -> None:
        """One PUT of ``pyckpt.json``, conditional on the ETag :meth:`begin_save` saw."""
        self.loc.put(METADATA_FILE, encoded, if_match=state.base)

    def metadata_is(self, encoded: bytes) -> bool | None:
        """Whether the stored metadata object is ``encoded`` (it holds the save id, so only
        this save wrote those bytes); None when the store cannot tell."""
        try:
            size = self.loc.head(METADATA_FILE)
            if size != len(encoded):
                return False
            return bytes(self.loc.get(METADATA_FILE, size)) == encoded
        except FileNotFoundError:
            return False
        except Exception:
            return None

    # -- names -----------------------------------------------------------------------------

    def url_of(self, name: str) -> str:
        return self.loc.url_of(name)

    def list_names(self) -> dict[str, int]:
        """Data objects directly under the prefix (other objects are never touched)."""
        return {n: s for n, s in self.loc.list_names().items() if _format.is_data_file(n)}

    def delete(self, names: Iterable[str]) -> None:
        self.loc.delete(names)

    def with_deadline(self, seconds: float) -> S3Backend:
        """The same prefix through a client that gives up after about ``seconds`` per request
        (its retries included), for work that must not hold the caller once a save is
        committed (:func:`~pyckpt.backends.base.clean_up`): a store that went down is not
        waited for with the save's retry budget."""
        options = dict(self.loc.storage_options)
        options.update(max_retries=2, retry_timeout=seconds, timeout=f"{seconds:g}s",
                       connect_timeout=f"{min(seconds, 5.0):g}s")
        return S3Backend(self.location, options, part_bytes=self.part_bytes)

    # -- load ------------------------------------------------------------------------------

    def fetcher(self) -> Fetcher:
        if self._fetcher is None:
            self._fetcher = Fetcher(self.loc)
        return self._fetcher

    @property
    def bytes_fetched(self) -> int:
        return self._fetcher.bytes_fetched if self._fetcher is not None else 0

    def read_index(self, lazy: bool = False) -> _format.CheckpointIndex:
        return read_index(self.loc, lazy)

    def read_requests(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        return self.fetcher().read_requests(requests, pool)

    def reads(self, pool: Any) -> Any:
        return direct_reads(self, pool)

    def read_stored(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        return self.fetcher().read_stored(requests, pool)

    def verify_segments(self, name: str, segments: list[Any], pool: Any) -> _C.ReadStats:
        return self.fetcher().verify_segments(name, segments, pool)

    def stage(self, directory: str, share: tuple[int, int] | None = None) -> list[str]:
        return stage_checkpoint(self.loc, directory, share)

    def check(self) -> None:
        """Fails early (typed, naming the URL) when the bucket is missing or refused."""
        self.loc.check_bucket()

    def put_file(self, path: str, *, last: bool = False) -> str:
        """Uploads local file ``path`` as ``<prefix>/<basename>`` (``last``: one PUT, for the
        index written after every other object is complete); returns its URL."""
        return upload_file(self.loc, path, self.part_bytes, single_put=last)

    def remove_files(self, urls: Iterable[str], *, strict: bool = False) -> None:
        """Best effort: deletes objects :meth:`put_file` made (a failure is ignored; with
        ``strict``, retried, then raised typed)."""
        from pyckpt.backends.s3.client import _obstore

        keys = [_plain_key(self.loc, u.rsplit("/", 1)[-1]) for u in urls]
        if keys:
            try:
                if strict:
                    self.loc._retried(lambda: _obstore().delete(self.loc.store(), keys),
                                      f"DELETE in {self.loc.url}")
                else:
                    _obstore().delete(self.loc.store(), keys)
            except Exception as e:
                if strict:
                    raise self.loc.error(e, "DELETE", self.loc.url) from e

    # -- a location holding checkpoints --------------------------------------------------

    def get_file(self, name: str, path: str) -> int:
        """Streams object ``name`` into local file ``path`` (temp file, fsync, rename)."""
        tmp = temp_name(path)
        try:
            size = download(self.loc, check_name(self.location, name), tmp)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return size

    def list_children(self) -> dict[str, bool]:
        """Sub-prefixes holding objects, from one (paged) LIST of everything under the prefix."""
        return self.loc.list_children(METADATA_FILE)

    def delete_checkpoint(self) -> None:
        delete_checkpoint(self)
