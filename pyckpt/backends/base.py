"""The storage seam: what a checkpoint needs from a place, and the one commit rule.

A :class:`Backend` is the Python mirror of ``csrc/core/storage.hpp``: it moves bytes and knows
nothing of codecs, checksums or DCP. Everything above it (``Writer``, ``Reader``, ``verify``,
``inspect``, ``consolidate``) holds a backend object made by
:func:`pyckpt.backends.open_backend`, the only place that reads a URL scheme or the node-local
choice.

What is shared by every backend lives here, once:

* :func:`commit_save`: data first, metadata last; a failed metadata write removes only this
  save's data (and only when the stored metadata is not this save's); once the metadata is
  committed, clean-up of what it made stale never fails the save (:func:`clean_up`).
* :func:`is_stale`: which names a committed save removes.
* :func:`overlapping_chunks`: which chunks of a stored piece overlap a raw byte range.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from pyckpt import _C, _format, _ranklocal
from pyckpt._collective import add_note
from pyckpt._format import METADATA_FILE
from pyckpt._partition import name_shares
from pyckpt._paths import TEMP_MARKER

__all__ = [
    "Backend",
    "CommitPlace",
    "WholePlace",
    "DataSink",
    "NativeBlockSink",
    "ReadRequest",
    "SaveState",
    "check_name",
    "clean_up",
    "commit_save",
    "delete_checkpoint",
    "direct_reads",
    "is_stale",
    "overlapping_chunks",
    "stage_shares",
]

logger = logging.getLogger("pyckpt.backends")

#: One read into a caller's buffer (``name, segments, lo, hi, dst``): raw bytes ``[lo, hi)`` of
#: a stored piece (or bytes item) decoded to address ``dst``; the binding's named tuple.
ReadRequest = _C.ReadRequest




@dataclass
class SaveState:
    """What :meth:`Backend.begin_save` hands to the commit of the same save.

    Attributes:
        is_coordinator: the rank that commits the metadata.
        base: the identity of the metadata this save replaces, as the backend's commit checks
            it (``None``: there was none; :data:`ANY`: no check possible).
        lock: a backend's lock held from set-up to commit (released by :meth:`end`), or None.
        present: names the place held at set-up (a backend without a lock records them): the
            commit's clean-up removes only these. A name that appeared later may belong to a
            save that set up after this one committed, whose commit will then succeed; None:
            no restriction (a lock excludes such saves until the clean-up is done).
    """

    is_coordinator: bool
    base: Any = None
    lock: Any = None
    present: frozenset[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def end(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


# SaveState.base: "commit unconditionally" (the store cannot tell what it holds).
ANY = object()


class DataSink(Protocol):
    """One data file being written: handed to the native encoder (``write_items``), committed
    (durable, visible under its name) by :meth:`commit`; leaving the ``with`` block without a
    commit removes what was written."""

    def write_items(self, *args: Any) -> Any: ...

    def append(self, data: Any) -> int: ...

    def commit(self) -> None: ...

    @property
    def size(self) -> int: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> Any: ...


class NativeBlockSink:
    """The :class:`DataSink` calls a sink built on the native ``BlockWriter`` (``self._native``,
    which hands each encoded block to the sink's callback) forwards to it unchanged."""

    _native: Any

    def write_items(self, *args: Any) -> Any:
        return self._native.write_items(*args)

    def append(self, data: Any) -> int:
        return int(self._native.append(data))

    @property
    def size(self) -> int:
        return int(self._native.size)


_P = TypeVar("_P")


class WholePlace:
    """The protocol's answers for a place every rank reads whole (a shared directory, an
    object prefix, an in-memory store): no client with a deadline of its own, no per-rank copy
    of the metadata to write or carry, no holders to choose among. A backend of that kind
    derives from this; a node-local one (:mod:`pyckpt.backends.peer`) answers itself."""

    def with_deadline(self: _P, seconds: float) -> _P:
        return self

    def expect_metadata(self, save_id: str) -> None:
        return None

    def publish(self, save_id: str, document: bytes, files: Iterable[str]) -> Any:
        return None

    def holders(self) -> None:
        return None


@runtime_checkable
class Backend(Protocol):
    """A place that holds one checkpoint (a directory, an object prefix, an in-memory store).

    Names are plain names inside the checkpoint (``pyckpt.json`` or a data file name that
    passed :func:`pyckpt._format.is_data_file`); a backend refuses anything else.

    Attributes:
        location: the checkpoint's location as the user gave it (named by every error).
        default_chunk_bytes: raw bytes per chunk when the writer was given none.
        in_place: native code opens the checkpoint's files where they are: ``location`` is a
            local directory and :meth:`url_of` a path in it (consolidation, rank-local saves,
            leftover listings). False: files are staged (:meth:`stage`) and stored
            (:meth:`put_file`) through the backend.
        exchanges_chunks: each rank's place holds only part of the data files (a node-local
            checkpoint); loads and exports get the rest from the other ranks (:meth:`reads`,
            :meth:`holders`), and the metadata reaches every rank's place after the commit
            (:meth:`publish`).
        collective_loads: every read batch of a load is a round all ranks of the group take part
            in (a node-local checkpoint not read with ``shared_filesystem="auto"``).
        shares_page_cache: ranks on one node reading the same stored bytes fetch them from
            storage about once (a file system's page cache); False where each rank's read is
            paid (an object store, an in-memory store).
        bytes_fetched: stored bytes downloaded from data objects by this backend's loads.
        bytes_from_peers: stored bytes received from other ranks by this backend's loads.
    """

    @property
    def location(self) -> str: ...

    @property
    def default_chunk_bytes(self) -> int: ...

    @property
    def in_place(self) -> bool: ...

    @property
    def exchanges_chunks(self) -> bool: ...

    @property
    def collective_loads(self) -> bool: ...

    @property
    def shares_page_cache(self) -> bool: ...

    @property
    def bytes_fetched(self) -> int: ...

    @property
    def bytes_from_peers(self) -> int: ...

    def with_deadline(self, seconds: float) -> Backend:
        """This place through a client whose requests give up after about ``seconds``, retries
        included (a backend reaching a remote store); ``self`` for every other backend."""
        ...

    # -- save ------------------------------------------------------------------------------
    def begin_save(self, is_coordinator: bool, overwrite: bool) -> SaveState:
        """Prepares a save: creates the place, takes the lock or records the condition the
        commit will check. Raises ``FileExistsError`` (``overwrite=False`` and a checkpoint is
        there), ``BlockingIOError`` (another save holds the place)."""
        ...

    def data_sink(self, name: str, options: Mapping[str, Any]) -> DataSink:
        """A sink for data file ``name`` (see :class:`DataSink`)."""
        ...

    def put_metadata(self, encoded: bytes, state: SaveState) -> None:
        """Writes ``pyckpt.json`` atomically, only if the stored one is still ``state.base``
        (else :class:`~pyckpt.errors.ConcurrentSaveError` naming it)."""
        ...

    def metadata_is(self, encoded: bytes) -> bool | None:
        """Whether the stored ``pyckpt.json`` is exactly ``encoded``; None when unknown."""
        ...

    def expect_metadata(self, save_id: str) -> None:
        """A rank other than the coordinator has written its data of save ``save_id``: where
        each rank's place keeps its own copy of the metadata (``exchanges_chunks``), it writes
        that copy when the coordinator's commit arrives (:meth:`publish`); else nothing."""
        ...

    def publish(self, save_id: str, document: bytes, files: Iterable[str]) -> Any:
        """After the coordinator's commit: what DCP's ``Metadata.storage_data`` carries to every
        rank so that each writes its copy of the metadata (node-local); None: nothing to carry
        (every rank reads the one committed copy)."""
        ...

    # -- names -----------------------------------------------------------------------------
    def url_of(self, name: str) -> str:
        """What messages call ``name`` (a path or an object URL)."""
        ...

    def list_names(self) -> dict[str, int]:
        """Names of the checkpoint's data files (and temp files) present, with their sizes."""
        ...

    def delete(self, names: Iterable[str]) -> None:
        """Deletes ``names`` (absent ones are not an error)."""
        ...

    # -- load ------------------------------------------------------------------------------
    def read_index(self, lazy: bool = False) -> _format.CheckpointIndex:
        """Reads and validates ``pyckpt.json`` (every data file checked present); ``lazy``:
        of a version-4 checkpoint, the global part only (see :func:`pyckpt._format.read_index`)."""
        ...

    def read_requests(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        """As ``_C.read_requests``: reads, verifies and decodes the chunks overlapping each
        request into the caller's buffer; returns (stored bytes read, chunks decoded). Reads
        only what this rank's place holds, never with a collective (:meth:`reads` is the load
        session that may exchange chunks with other ranks)."""
        ...

    def verify_segments(self, name: str, segments: list[Any], pool: Any) -> _C.ReadStats:
        """As ``_C.verify_segments`` (checksums of every chunk of ``segments``)."""
        ...

    def read_stored(self, requests: list[ReadRequest], pool: Any) -> _C.ReadStats:
        """As ``_C.read_stored``: the stored (still encoded) bytes of every chunk of each
        request's segments, checksums verified, back to back into its destination (what a rank
        serves to the others in a cooperative or node-local load)."""
        ...

    def reads(self, pool: Any) -> contextlib.AbstractContextManager[
            Callable[[list[ReadRequest]], _C.ReadStats]]:
        """One load's read session: yields the function ``Reader.read_data`` calls with each
        batch of requests (:func:`direct_reads` for most backends; exchange rounds with the
        other ranks for a node-local checkpoint)."""
        ...

    def holders(self) -> Callable[[str], Sequence[int]] | None:
        """After :meth:`read_index`: data file name -> the group ranks whose place holds it
        (the readers a cooperative load may choose); None where every rank reads every file."""
        ...

    # -- consolidation ---------------------------------------------------------------------
    def stage(self, directory: str, share: tuple[int, int] | None = None) -> list[str]:
        """Copies the checkpoint (or rank ``share[0]`` of ``share[1]``'s part of its data
        files) into local ``directory`` for the native consolidator; returns the names."""
        ...

    def check(self) -> None:
        """Fails early (typed, naming the location) when the place cannot be written."""
        ...

    def put_file(self, path: str, *, last: bool = False) -> str:
        """Stores local file ``path`` (an export output) under its base name, atomically;
        ``last``: the file that names the others (one request). Returns what it is called."""
        ...

    def remove_files(self, urls: Iterable[str], *, strict: bool = False) -> None:
        """Best effort: removes what :meth:`put_file` stored (failures are ignored; with
        ``strict`` a failure raises, a missing file is fine)."""
        ...

    # -- a location holding checkpoints (the checkpoint manager's tiers) -------------------
    def get_file(self, name: str, path: str) -> int:
        """Copies stored ``name`` (``pyckpt.json`` or a data file, as stored) to local file
        ``path``, atomically (temp + rename); returns its size. ``FileNotFoundError`` naming
        ``url_of(name)`` when it is absent."""
        ...

    def list_children(self) -> dict[str, bool]:
        """The places directly under this location (sub-directories, sub-prefixes, stores
        named ``<location>/<child>``) that hold anything, by plain name, each with whether it
        holds a committed checkpoint (its ``pyckpt.json``). None at all: ``{}``."""
        ...

    def delete_checkpoint(self) -> None:
        """Deletes the checkpoint here: ``pyckpt.json`` first (it no longer looks complete),
        then its data and temp files, then the place itself where it is one (a directory);
        files of other kinds are left alone. Nothing there: nothing to do."""
        ...


@contextlib.contextmanager
def direct_reads(backend: Backend, pool: Any
                 ) -> Iterator[Callable[[list[ReadRequest]], _C.ReadStats]]:
    """The read session of a backend that needs none: each batch is one
    :meth:`Backend.read_requests` call."""
    yield lambda requests: backend.read_requests(requests, pool)


def check_name(location: str, name: str, *, temp: bool = False) -> str:
    """``name`` if it is a plain name of the checkpoint: ``pyckpt.json``, a data file name, a
    rank-local metadata file (``pyckpt.rank<r>.json``), or (``temp``) a temp file of the first
    two; else :class:`~pyckpt.errors.CheckpointFormatError` naming ``location``. Nothing outside
    the checkpoint's place is ever reached."""
    from pyckpt.errors import CheckpointFormatError

    ok = (name == METADATA_FILE or _format.is_data_file(name)
          or _ranklocal.is_metadata_file(name))
    if not ok and temp and TEMP_MARKER in name and "/" not in name and "\\" not in name:
        base = name.split(TEMP_MARKER)[0]
        ok = base == METADATA_FILE or _format.is_data_file(base)
    if not ok:
        raise CheckpointFormatError(f"{location}: illegal file name {name!r}")
    return name


def is_stale(name: str, keep: Iterable[str] | set[str], metadata_temps: bool = True) -> bool:
    """Whether a committed save removes ``name``: a data file of another save, or a temp file
    of an interrupted write of a data file or (``metadata_temps``) of the metadata."""
    if _format.is_data_file(name):
        return name not in keep
    if _ranklocal.is_metadata_file(name):  # rank-local parts a collective save replaces
        return True
    if TEMP_MARKER in name:
        base = name.split(TEMP_MARKER)[0]
        return (metadata_temps and base == METADATA_FILE) or base.endswith(".pyckpt")
    return False


#: Which names a committed save removes, given the names it keeps (:func:`is_stale`'s shape).
Stale = Callable[[str, set[str]], bool]

#: Seconds each request of the clean-up after a commit may take, retries included, on a
#: backend that reaches a remote store (``with_deadline``).
CLEAN_UP_DEADLINE_S = 5.0

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class CommitPlace(Protocol):
    """What the commit rule (:func:`commit_save`, :func:`clean_up`) uses of a place: every
    :class:`Backend` has it, and so has one rank's part of a rank-local save
    (:class:`pyckpt._ranklocal.Part`)."""

    @property
    def location(self) -> str: ...

    def with_deadline(self, seconds: float) -> CommitPlace: ...

    def put_metadata(self, encoded: bytes, state: SaveState) -> None: ...

    def metadata_is(self, encoded: bytes) -> bool | None: ...

    def url_of(self, name: str) -> str: ...

    def list_names(self) -> dict[str, int]: ...

    def delete(self, names: Iterable[str]) -> None: ...


def _warn_once(backend: CommitPlace, e: BaseException) -> None:
    key = (backend.location, type(e).__name__)
    with _warned_lock:
        first = key not in _warned
        _warned.add(key)
    if first:
        logger.warning(
            "pyckpt: %s: the checkpoint is committed, but removing files of earlier saves "
            "failed (%s: %s); they are left for the next save to remove",
            backend.location, type(e).__name__, e,
        )
    else:
        logger.debug("pyckpt: %s: clean-up failed again: %s", backend.location, e)


def clean_up(backend: CommitPlace, keep: Iterable[str], *, metadata_temps: bool = True,
             stale: Stale | None = None, only: Container[str] | None = None) -> list[str]:
    """Removes what a committed save made stale (:func:`is_stale`, or ``stale``). Never
    raises, and never waits long: the save is committed; on a remote store each request gives
    up after :data:`CLEAN_UP_DEADLINE_S` (retries included), a failure is logged once per
    location and error type, and what is left is removed by the next save. Returns the names
    removed.

    ``metadata_temps=False`` leaves temp files of the metadata alone: a caller that does not
    hold the place's lock (a node-local rank writing its copy while another rank of its node
    writes the same copy) must not remove another writer's temp file mid-write.

    ``only``: the names that may be removed (:attr:`SaveState.present`); None: any.
    """
    keep = set(keep)
    # A backend whose requests may wait on a remote store (retries over minutes) is used
    # through a client that gives up soon: the save is committed, and a store that went down
    # right after must not hold the caller; what is left is removed by the next save.
    target = backend.with_deadline(CLEAN_UP_DEADLINE_S)
    try:
        names = [n for n in target.list_names()
                 if (is_stale(n, keep, metadata_temps) if stale is None else stale(n, keep))
                 and (only is None or n in only)]
        if names:
            target.delete(names)
        return names
    except Exception as e:
        _warn_once(backend, e)
        return []


def commit_save(backend: CommitPlace, files: Mapping[str, int] | Iterable[str], encoded: bytes,
                state: SaveState, *, stale: Stale | None = None) -> None:
    """The commit rule of every backend (and of a rank-local save's part,
    :class:`pyckpt._ranklocal.Part`): the data files ``files`` are durable; write the metadata
    (atomic, conditional on ``state``), then remove what it made stale (:func:`is_stale`, or
    ``stale(name, files)``).

    A metadata write that failed may still have landed (an answer lost on the way back), so a
    failure is followed by a look at the stored metadata: if it is this save's, the save has
    succeeded. If it is another's or absent, this save's data files are removed (best effort)
    and the error propagates: the previous checkpoint is untouched. If the look fails too, the
    data files are left for the next save, rather than risk removing a committed checkpoint's.

    After the commit nothing raises (:func:`clean_up`). An interrupt (``KeyboardInterrupt``,
    ``SystemExit``) during the metadata write always propagates, with a note saying whether the
    checkpoint was committed.
    """
    names = list(files)
    try:
        backend.put_metadata(encoded, state)
    except BaseException as e:
        landed = backend.metadata_is(encoded)
        url = backend.url_of(METADATA_FILE)
        if not landed:
            if landed is False:
                try:
                    backend.delete(names)
                except Exception:
                    pass
            if not isinstance(e, Exception):
                add_note(e, f"the checkpoint was not committed ({url} is not this save's)")
            raise
        if not isinstance(e, Exception):
            # Ctrl-C (or an exit) that landed during the write: the checkpoint is committed,
            # and the interrupt still ends the caller (files of earlier saves are left for the
            # next save to remove).
            add_note(e, f"the checkpoint was committed before the interrupt ({url})")
            raise
        logger.warning("pyckpt: %s: writing the metadata reported a failure but the stored "
                       "metadata is this save's: committed", url)
    clean_up(backend, names, stale=stale, only=state.present)



def delete_checkpoint(backend: Backend) -> None:
    """The deletion rule of every backend: ``pyckpt.json`` first, so a checkpoint deleted
    half-way never looks complete, then every data and temp file listed."""
    backend.delete([METADATA_FILE])
    names = list(backend.list_names())
    if names:
        backend.delete(names)


def stored_len(rec: Sequence[Any]) -> int:
    """Stored bytes of a chunk record ``(file_offset, raw_len, xxh64, transform, planes)``."""
    return int(sum(rec[4][1::2]))


def overlapping_chunks(segments: Sequence[Any], lo: int, hi: int,
                       ) -> list[tuple[int, int, int, Any]]:
    """The chunks of a stored piece that overlap raw bytes ``[lo, hi)``.

    Args:
        segments: the piece's segments ``(file, raw_begin, params, chunk records)``.

    Returns:
        ``(raw_a, raw_b, segment index, record)`` per overlapping chunk, in segment order
        (empty chunks are never returned).
    """
    out = []
    for si, seg in enumerate(segments):
        a = seg[1]
        for rec in seg[3]:
            b = a + rec[1]
            if rec[1] and a < hi and b > lo:
                out.append((a, b, si, rec))
            a = b
    return out


def stage_shares(files: Mapping[str, int], world: int) -> list[list[str]]:
    """Data object names by rank: each object to exactly one rank, balanced by bytes (largest
    first, each to the least loaded rank, ties to the lower rank; deterministic)."""
    return name_shares(files, world)
