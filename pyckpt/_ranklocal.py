"""Rank-local checkpoints: ``dcp.save(..., use_collectives=False)`` on several ranks.

Without collectives no rank learns the other ranks' items, save ids or completion, so no rank
can commit one ``pyckpt.json`` naming every rank's data. DCP's answer (``FileSystemWriter``
writes ``__<rank>.metadata``) is rank-local metadata: each rank commits a metadata file that
names only its own items and data files, and ``dcp.load`` falls back to it (DCP calls
``read_metadata(rank=...)`` when the global metadata cannot be read, then loads without
collectives). pyckpt does the same with ``pyckpt.rank<r>.json``: the same document as
``pyckpt.json`` (docs/FORMAT.md), with two differences checked on load:

* every data file it names was written by rank ``r`` (``<r>-<k>.<save_id>.pyckpt``);
* the pieces of a tensor need not tile it (a rank holds only its shards); they must not overlap.

Each rank commits on its own (data, fsync, then its metadata atomically: the backends' commit
rule on :class:`Part`), then removes the directory's ``pyckpt.json`` (a collective checkpoint
this save replaces) and its own data files of earlier saves; it never touches another rank's
files, except those of ranks beyond the save's world size: an earlier save by more ranks left
them, and a load at that world size would read those ranks' old parts beside the new ones.
There is no point at which every rank has committed, so while a rank-local save runs a load may
find some ranks' new parts and other ranks' previous ones (each part is whole, with its own save
id), exactly as with DCP.
"""

from __future__ import annotations

import errno
import math
import os
import re
from collections.abc import Container, Iterable
from typing import Any

from pyckpt import _C, _format
from pyckpt._format import METADATA_FILE
from pyckpt._paths import TEMP_MARKER, regular_files
from pyckpt.errors import CheckpointFormatError

__all__ = ["metadata_file", "is_metadata_file", "set_up", "Part", "read_index", "fallback",
           "check_coverage"]

_NAME_RE = re.compile(r"pyckpt\.rank(0|[1-9][0-9]{0,9})\.json", re.ASCII)
# Bound on the pairwise overlap check of one tensor's pieces in one rank's metadata.
_MAX_PIECES_PER_TENSOR = 4096


def metadata_file(rank: int) -> str:
    """The name of rank ``rank``'s metadata file in a rank-local checkpoint."""
    return f"pyckpt.rank{rank}.json"


def is_metadata_file(name: str) -> bool:
    """True when ``name`` is exactly the name of a rank-local metadata file."""
    return _NAME_RE.fullmatch(name) is not None


def set_up(path: str | None, location: str, rank: Any, overwrite: bool) -> int:
    """Checks that rank ``rank`` may start a rank-local save into directory ``path``; returns
    the rank.

    Args:
        path: the checkpoint's local directory (``Backend.location`` where ``in_place``); None for a location
            that is not a directory (an object store, a memory store).
        location: the checkpoint's location as the user gave it, for messages.

    Raises:
        ValueError: ``location`` is not a directory (rank-local saves are for directories), or
            DCP passed no rank.
        FileExistsError: ``overwrite`` is False and ``path`` holds a complete checkpoint (its
            ``pyckpt.json`` or this rank's rank-local metadata); ``filename`` names that file.
    """
    if path is None:
        raise ValueError(
            f"{location}: dcp.save(use_collectives=False) with several ranks writes rank-local "
            "metadata into a directory; object-store URLs need use_collectives=True"
        )
    if type(rank) is not int or rank < 0:
        raise ValueError(f"use_collectives=False: DCP passed no valid rank (got {rank!r})")
    if not overwrite:
        for name in (METADATA_FILE, metadata_file(rank)):
            meta = os.path.join(path, name)
            if os.path.exists(meta):
                raise FileExistsError(
                    errno.EEXIST,
                    "Checkpoint already exists and overwrite=False; pass overwrite=True or "
                    "choose another directory",
                    meta,
                )
    return rank


def _holds(path: str, content: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read() == content
    except OSError:
        return False


class Part:
    """Rank ``rank``'s part of a rank-local save into directory ``path``, as the backends' one
    commit rule (:func:`pyckpt.backends.base.commit_save`) sees a place.

    Its metadata is ``pyckpt.rank<rank>.json``, written unconditionally and atomically (temp +
    fsync + rename): it replaces no other rank's part, so there is no condition to check. What
    its commit makes stale (:meth:`is_stale`, removed by the rule's clean-up) is the
    directory's ``pyckpt.json`` (the collective checkpoint this save replaces: it would
    otherwise be loaded first) and the rank's own data and temp files of other saves; another
    rank's files are never touched. A metadata write that fails leaves the rank's previous part
    loadable.
    """

    def __init__(self, path: str, rank: int, fsync: bool, world: int | None = None) -> None:
        self.location = path
        self.rank = rank
        self.fsync = fsync
        self.world = world  # the save's world size: parts of ranks >= world are stale too

    def with_deadline(self, seconds: float) -> Part:
        return self  # a local directory: no request waits on a remote store

    def put_metadata(self, encoded: bytes, state: Any) -> None:
        with _C.FileWriter(self.url_of(METADATA_FILE), "off", self.fsync) as fw:
            fw.append(encoded)
            fw.commit()

    def metadata_is(self, encoded: bytes) -> bool:
        return _holds(self.url_of(METADATA_FILE), encoded)

    def url_of(self, name: str) -> str:
        """The path of ``name``; the part's metadata (``pyckpt.json`` to the commit rule) is
        ``pyckpt.rank<rank>.json``."""
        return os.path.join(self.location,
                            metadata_file(self.rank) if name == METADATA_FILE else name)

    def list_names(self) -> dict[str, int]:
        """The directory's regular files, with sizes."""
        return regular_files(self.location)

    def delete(self, names: Iterable[str]) -> None:
        """Removes ``names`` (missing ones are skipped), metadata first: it may name the data
        files of an earlier save."""
        for name in sorted(names, key=lambda n: n != METADATA_FILE and not is_metadata_file(n)):
            try:
                os.unlink(os.path.join(self.location, name))
            except FileNotFoundError:
                pass

    def retire_collective(self) -> None:
        """Removes the directory's ``pyckpt.json`` if it is still there after the commit (the
        clean-up only logs a failed removal), and the metadata of ranks >= ``world``: left
        behind, the collective checkpoint would be loaded instead of this save, and a load at
        an earlier save's larger world size would give ranks >= ``world`` that save's parts,
        silently. An error other than a file's absence propagates and fails the save."""
        names = [METADATA_FILE]
        if self.world is not None:
            names += [n for n in self.list_names() if self._beyond_world(n)]
        for name in names:
            try:
                os.unlink(os.path.join(self.location, name))
            except FileNotFoundError:
                pass

    def _beyond_world(self, name: str) -> bool:
        """Whether ``name`` is the metadata of a rank >= ``world``."""
        m = _NAME_RE.fullmatch(name)
        return m is not None and self.world is not None and int(m.group(1)) >= self.world

    def is_stale(self, name: str, keep: Container[str]) -> bool:
        """Whether this part's commit removes ``name``: ``pyckpt.json``, a data file of this
        rank not in ``keep``, a temp file of this rank's metadata or data files, or any of
        these of a rank >= ``world`` (an earlier save by more ranks), its metadata included."""
        if name == METADATA_FILE or self._beyond_world(name):
            return True
        if _format.is_data_file(name):
            return self._mine(_format.data_file_rank(name)) and name not in keep
        base, marker, _ = name.partition(TEMP_MARKER)
        if not marker:
            return False
        if base == metadata_file(self.rank) or self._beyond_world(base):
            return True
        return _format.is_data_file(base) and self._mine(_format.data_file_rank(base))

    def _mine(self, rank: int) -> bool:
        """Whether this part removes files of rank ``rank``: its own, and ranks >= world."""
        return rank == self.rank or (self.world is not None and rank >= self.world)


def read_index(path: str, rank: int) -> _format.CheckpointIndex:
    """Reads and validates rank ``rank``'s metadata of the rank-local checkpoint ``path``.

    Raises:
        FileNotFoundError: the file (``filename``) or a data file it names is missing.
        CheckpointFormatError: as :func:`pyckpt._format.read_index`, or the file names another
            rank's data file, or two pieces of a tensor overlap.
    """
    meta = os.path.join(path, metadata_file(rank))
    try:
        raw = _format._open_metadata(path, meta)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"checkpoint {path!r} has no {METADATA_FILE} and no rank-local metadata for rank "
            f"{rank}: it was saved with use_collectives=False by fewer ranks, or is incomplete",
            meta,
        ) from None
    # The metadata reader checks both differences: only this rank's data files, and pieces that
    # need not tile a tensor but must not overlap (at most _MAX_PIECES_PER_TENSOR of them).
    return _format.validate(raw, meta, _format.DataFiles(path, meta),
                            disjoint_pieces=_MAX_PIECES_PER_TENSOR, rank=rank)


def fallback(path: str | None, rank: Any, error: BaseException) -> _format.CheckpointIndex | None:
    """The index DCP's fallback ``read_metadata(rank=rank)`` loads, after reading the global
    metadata failed with ``error``: rank ``rank``'s rank-local metadata when ``pyckpt.json`` is
    absent and directory ``path`` holds rank-local metadata; None otherwise (the original error
    stands), and for a location that is not a directory (``path`` None).

    Raises:
        FileNotFoundError, CheckpointFormatError: see :func:`read_index`.
    """
    if (
        path is None
        or type(rank) is not int
        or not isinstance(error, FileNotFoundError)
        or error.filename != os.path.join(path, METADATA_FILE)
    ):
        return None
    try:
        if not any(is_metadata_file(n) for n in os.listdir(path)):
            return None
    except OSError:
        return None
    return read_index(path, rank)


def check_coverage(plan: Any, planner: Any, path: str, rank: int) -> None:
    """Refuses a load that this rank's part cannot fill: a destination tensor (or this rank's
    shard of a DTensor) of which the rank's reads cover fewer elements than it holds. DCP's
    planner reads only what overlaps the stored pieces and would leave the rest as it was, e.g.
    when a rank-local checkpoint is loaded at another world size or sharding.

    Raises:
        CheckpointFormatError: naming the tensor, the rank-local metadata file and the counts.
    """
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType

    state = getattr(planner, "state_dict", None)
    metadata = getattr(planner, "metadata", None)
    if not isinstance(state, dict) or metadata is None:
        return  # a custom planner: nothing to compare with
    covered: dict[str, int] = {}
    for req in plan.items:
        if req.type == LoadItemType.TENSOR:
            fqn = req.dest_index.fqn
            covered[fqn] = covered.get(fqn, 0) + math.prod(req.lengths)
    for fqn, dest in state.items():
        if not isinstance(metadata.state_dict_metadata.get(fqn), TensorStorageMetadata):
            continue
        local = dest.to_local() if hasattr(dest, "to_local") else dest
        if isinstance(local, torch.Tensor) and covered.get(fqn, 0) < local.numel():
            raise CheckpointFormatError(
                f"{os.path.join(path, metadata_file(rank))}: rank {rank}'s part of this "
                f"rank-local checkpoint holds {covered.get(fqn, 0)} of the {local.numel()} "
                f"elements rank {rank} loads into {fqn!r}; a checkpoint saved with "
                "use_collectives=False loads only at the world size and sharding it was saved with"
            )
