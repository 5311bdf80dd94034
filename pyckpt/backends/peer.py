"""Node-local checkpoints: which rank holds each data file, and chunk transfers between ranks.

A node-local checkpoint (``Writer(path, shared_filesystem=False)``) has the same ``path`` on
every rank, but each rank's directory holds only the data files of the ranks that share it (its
node) plus a copy of ``pyckpt.json``. Data file names carry the writer's rank
(``<rank>-<k>.<save_id>.pyckpt``, docs/FORMAT.md); which rank *holds* a file now is found at
load time (:func:`discover`): every rank lists the files it has, the lists are all-gathered, and
each file is served by the lowest rank holding it. That works whatever the node layout, for a
load at the same or at another world size.

Chunks of files other ranks hold travel as stored (compressed or raw) over the process group
in rounds (:class:`pyckpt._exchange.Exchange`, shared with cooperative loads,
:mod:`pyckpt._coop`, and node-local consolidation). This module holds the backend itself: the
local directory (handed in by :func:`pyckpt.backends.open_backend`), the metadata copies
published to every rank after a commit, and the read sessions.

Exchanges run on :func:`pyckpt.coordination_group` of the group (gloo, even for NCCL).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pyckpt import _C, _format
from pyckpt._collective import coordination_info
from pyckpt._exchange import (  # re-exported: where they were public
    Exchange,
    Need,
    PeerFiles,
    discover,
    peer_source,
    read_requests,
    writer_rank,
)
from pyckpt.backends.base import Backend, ReadRequest, SaveState, clean_up

__all__ = ["Exchange", "Need", "PeerBackend", "PeerFiles", "discover", "peer_source",
           "read_requests", "writer_rank"]

# ----------------------------------------------------------------------------- saving

# save id -> this rank's directory (its backend) of node-local saves waiting for the
# coordinator's metadata on this process (a non-coordinator rank between write_data and the end
# of dcp.save).
_expected: dict[str, Backend] = {}
_expected_lock = threading.Lock()


def expect_metadata(save_id: str, local: Backend) -> None:
    """Registers a node-local save whose metadata this (non-coordinator) rank will write into
    ``local`` (its directory)."""
    with _expected_lock:
        _expected[save_id] = local


class PublishedMetadata:
    """The committed metadata of a node-local save, carried to every rank by DCP itself.

    DCP runs ``StorageWriter.finish`` on the coordinator only and then broadcasts the returned
    ``Metadata`` (pickled) to every rank before ``dcp.save`` returns there. The coordinator's
    Writer puts this object into ``Metadata.storage_data``; unpickling it on a rank that has
    the save pending (:func:`expect_metadata`) writes the same ``pyckpt.json`` into that rank's
    directory, then removes that directory's data files of earlier saves. At that point every
    rank's data files are durable (the coordinator's ``finish`` runs only after every rank's
    ``write_data`` succeeded), and the coordinator's copy is already committed. A rank whose
    copy cannot be written raises from ``dcp.save``; its directory then holds no copy of this
    save, and a node-local load refuses the mixture (:func:`discover`).

    Unpickling it anywhere else (no such save pending in the process) does nothing.
    """

    def __init__(self, save_id: str, document: bytes, files: list[str]) -> None:
        self.save_id = save_id
        self.document = document
        self.files = files

    def __reduce__(self) -> tuple[Any, ...]:
        return _publish, (self.save_id, self.document, self.files)

    def __repr__(self) -> str:
        return f"PublishedMetadata(save_id={self.save_id!r}, files={len(self.files)})"


def _publish(save_id: str, document: bytes, files: list[str]) -> PublishedMetadata:
    with _expected_lock:
        target = _expected.pop(save_id, None)
    if target is not None:
        write_metadata_copy(target, document, set(files))
    return PublishedMetadata(save_id, document, files)


def write_metadata_copy(local: Backend, document: bytes, files: set[str]) -> None:
    """Writes ``pyckpt.json`` (atomically, fsynced) into ``local`` unless it already holds
    exactly ``document``, then removes data files of earlier saves there (not in ``files``); a
    failure of that clean-up is a warning (the save is committed), as on every backend."""
    if not local.metadata_is(document):
        # A copy that cannot be written leaves this node's data files alone: they belong to a
        # save committed on the coordinator.
        local.put_metadata(document, SaveState(is_coordinator=False))
    # Ranks sharing this directory write the same copy at the same time, without a lock: their
    # temp files of pyckpt.json are not stale.
    clean_up(local, files, metadata_temps=False)


class PeerBackend:
    """A node-local checkpoint (:class:`~pyckpt.backends.base.Backend`): this rank's directory
    (a :class:`~pyckpt.backends.posix.PosixBackend`) holds its node's data files and a copy of
    the metadata; chunks of files other ranks hold come from them over ``process_group``.

    Saving writes into the local directory as the POSIX backend does; the coordinator's commit
    is published to every rank (:class:`PublishedMetadata`), each of which commits its copy
    with the same rule. :meth:`read_index` is collective (:func:`discover`); reads run in
    exchange rounds (:meth:`reads`).

    Args:
        local: this rank's directory.
        process_group: the group (None: the default group); its exchanges run on
            :func:`pyckpt.coordination_group` of it (gloo, even for an NCCL group).
        auto: ``shared_filesystem="auto"``: when every rank sees every file (or in a single
            process) reads are plain local reads, with no rounds.
    """

    in_place = True  # this rank's directory
    exchanges_chunks = True
    shares_page_cache = True
    bytes_fetched = 0

    def __init__(self, local: Any, process_group: Any = None, *,
                 auto: bool = False) -> None:
        self.local = local
        self.location = local.location
        self.default_chunk_bytes = local.default_chunk_bytes
        self.process_group = process_group
        self.auto = auto
        self.files: PeerFiles | None = None
        self.bytes_from_peers = 0  # stored bytes received from other ranks, all loads

    def __repr__(self) -> str:
        return f"PeerBackend({self.location!r})"

    # -- save: the local directory, and the metadata published to every rank --------------

    def begin_save(self, is_coordinator: bool, overwrite: bool) -> SaveState:
        return self.local.begin_save(is_coordinator, overwrite)

    def data_sink(self, name: str, options: Any) -> Any:
        return self.local.data_sink(name, options)

    def put_metadata(self, encoded: bytes, state: SaveState) -> None:
        self.local.put_metadata(encoded, state)

    def metadata_is(self, encoded: bytes) -> bool | None:
        return self.local.metadata_is(encoded)

    def expect_metadata(self, save_id: str) -> None:
        """A non-coordinator rank: writes its copy when the coordinator's commit arrives."""
        expect_metadata(save_id, self.local)

    def publish(self, save_id: str, document: bytes, files: Iterable[str]) -> PublishedMetadata:
        """What the coordinator puts into DCP's ``Metadata.storage_data`` after its commit."""
        return PublishedMetadata(save_id, document, sorted(files))

    # -- names -----------------------------------------------------------------------------

    def url_of(self, name: str) -> str:
        return self.local.url_of(name)

    def list_names(self) -> dict[str, int]:
        return self.local.list_names()

    def delete(self, names: Iterable[str]) -> None:
        self.local.delete(names)

    # -- load ------------------------------------------------------------------------------

    def read_index(self, lazy: bool = False) -> _format.CheckpointIndex:
        """Collective on a group: every rank validates its copy, the holders of every file are
        agreed on (:func:`discover`). One process with ``auto``: a plain local read."""
        group = coordination_info(self.process_group)  # gloo, even for an NCCL group
        self.files = None
        if self.auto and not group.distributed:
            return self.local.read_index(lazy=lazy)
        # every data file is looked for (a version-4 checkpoint read whole)
        index, peers = discover(self.local.path, group)
        self.files = None if (self.auto and peers.everywhere) else peers
        return index

    @contextlib.contextmanager
    def reads(self, pool: Any) -> Iterator[Callable[[list[ReadRequest]], _C.ReadStats]]:
        """Yields the read function of one load's ``read_data``: each call is one exchange
        round (collective); an error raised inside is told to every rank."""
        files = self.files
        if files is None:
            yield lambda requests: self.local.read_requests(requests, pool)
            return
        exchange = Exchange(files, pool)
        try:
            yield lambda requests: read_requests(exchange, requests, pool)
        except Exception as e:
            exchange.finish(e)  # tells the other ranks, then raises e
            raise
        finally:
            self.bytes_from_peers += exchange.bytes_received
        exchange.finish()

    def read_requests(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        """This rank's own files only (no collective): exchange rounds run in :meth:`reads`."""
        return self.local.read_requests(requests, pool)

    @property
    def collective_loads(self) -> bool:
        return not self.auto

    def holders(self) -> Callable[[str], list[int]] | None:
        """After :meth:`read_index` found files held by some ranks only: who holds each."""
        files = self.files
        if files is None:
            return None
        return lambda name: files.holders.get(name, [files.owners[name]])

    def with_deadline(self, seconds: float) -> PeerBackend:
        return self

    def verify_segments(self, name: str, segments: list[Any], pool: Any) -> _C.ReadStats:
        return self.local.verify_segments(name, segments, pool)

    def read_stored(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        return self.local.read_stored(requests, pool)

    def stage(self, directory: str, share: tuple[int, int] | None = None) -> list[str]:
        return self.local.stage(directory, share)

    def check(self) -> None:
        self.local.check()

    def put_file(self, path: str, *, last: bool = False) -> str:
        return self.local.put_file(path, last=last)

    def remove_files(self, urls: Iterable[str], *, strict: bool = False) -> None:
        self.local.remove_files(urls, strict=strict)

    def get_file(self, name: str, path: str) -> int:
        return self.local.get_file(name, path)

    def list_children(self) -> dict[str, bool]:
        return self.local.list_children()

    def delete_checkpoint(self) -> None:
        self.local.delete_checkpoint()
