"""The checkpoint manager's records and node ids: :class:`SaveInfo`, :class:`RestoreInfo`
(public, re-exported by :mod:`pyckpt.manager`), :func:`node_identity` and the fast tier's
directory of a node."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pyckpt import _knobs

__all__ = ["SaveInfo", "RestoreInfo", "node_identity", "local_path"]


def local_path(local: str | os.PathLike[str], node: str) -> str:
    """The fast tier's directory of ``node``: ``local`` with ``{node}`` replaced by its id."""
    path = os.fspath(local)
    if "{node}" in path and (not node or os.sep in node or node in (".", "..")):
        raise ValueError(f"local={path!r}: node id {node!r} cannot be part of a path")
    return path.replace("{node}", node)


def node_identity(node: str | int | None = None) -> str:
    """This process's node id: ``node`` when given; else :func:`pyckpt._knobs.node_id`
    (torchrun's ``GROUP_RANK`` when torchrun's variables are set, else the host name), the
    nodes cooperative loads go by too."""
    return str(node) if node is not None else _knobs.node_id()


@dataclass
class SaveInfo:
    """What one fast-tier (or durable-only) save did, on this rank.

    Attributes:
        step: the step saved.
        blocking_s: time :meth:`CheckpointManager.save` held the caller (staging included).
        write_s: the node-local (or durable) save in the background.
        replication_s: sending and receiving the replicas, checking and committing them.
        bytes_sent / bytes_received: replica bytes this rank sent / received over the group.
        footprint_bytes: the fast tier's bytes on this node after the save and retention.
    """

    step: int
    blocking_s: float = 0.0
    write_s: float = 0.0
    replication_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    footprint_bytes: int = 0


@dataclass
class RestoreInfo:
    """Where a restore's bytes came from, on this rank.

    Attributes:
        step: the step restored (None: nothing to restore).
        tier: ``"fast"`` (this node's files and peers' replicas) or ``"durable"``.
        bytes_local: stored bytes read from this node's fast tier.
        bytes_peer: stored bytes received from other ranks over the group.
        bytes_durable: bytes read from the durable tier (data files).
        fast_tier_lacked: why the fast tier could not serve a newer step (None when it served).
        skipped: damaged copies (and steps) the restore skipped for the next good source, one
            sentence each, naming the node and the file (each also a ``TierWarning``).
    """

    step: int | None
    tier: str | None = None
    bytes_local: int = 0
    bytes_peer: int = 0
    bytes_durable: int = 0
    fast_tier_lacked: str | None = None
    skipped: list[str] = field(default_factory=list)
