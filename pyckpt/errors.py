"""Exception types raised by pyckpt.

OS-level failures surface as the builtin :class:`OSError` subclasses (``FileNotFoundError``,
``PermissionError``, ...) with ``filename`` set; everything pyckpt-specific derives from
:class:`PyckptError`.
"""

from __future__ import annotations

__all__ = [
    "PyckptError",
    "CheckpointFormatError",
    "ChecksumError",
    "CompressionError",
    "CudaError",
    "UnsupportedDtypeError",
    "ReplicaMismatchError",
    "ObjectStoreError",
    "ConcurrentSaveError",
    "ExportNameCollisionError",
    "PeerLostError",
]


class PyckptError(Exception):
    """Base class of pyckpt's own errors."""


class CheckpointFormatError(PyckptError, ValueError):
    """On-disk data violates the format: truncated, inconsistent, unknown version, bad header."""


class ChecksumError(CheckpointFormatError):
    """Stored bytes do not match their recorded checksum (corruption)."""


class CompressionError(PyckptError):
    """zstd failed to compress or decompress a chunk."""


class CudaError(PyckptError, RuntimeError):
    """The CUDA runtime returned an error during staging."""


class UnsupportedDtypeError(PyckptError, TypeError):
    """A tensor's dtype cannot be stored in the requested format."""


class ReplicaMismatchError(PyckptError, ValueError):
    """Copies of replicated state differ across ranks (e.g. desynchronised DDP); nothing written.

    Attributes:
        mismatches: Maps each differing item (its name, with `` at offset [...]`` for a shard
            that does not start at the origin) to the ranks holding it, grouped by content:
            ``{"w": [[0, 2], [1, 3]]}``.
    """

    def __init__(self, message: str, mismatches: dict[str, list[list[int]]] | None = None) -> None:
        super().__init__(message)
        self.mismatches = dict(mismatches or {})

    def __reduce__(
        self,
    ) -> tuple[type[ReplicaMismatchError], tuple[str, dict[str, list[list[int]]]]]:
        # Pickled by DCP to reach every rank: keep the attribute, not only the message.
        return type(self), (str(self), self.mismatches)


class ObjectStoreError(PyckptError, OSError):
    """An object-store request failed for a reason other than a missing object or bucket
    (``FileNotFoundError``) or refused credentials (``PermissionError``): e.g. the store is
    unreachable after the retries. ``filename`` is the object's or checkpoint's URL."""


class ConcurrentSaveError(ObjectStoreError):
    """Another save committed a checkpoint under the same object-store prefix while this one
    ran (its metadata changed after this save began). This save is abandoned: its own objects
    are deleted and nothing else is touched, so the other save's checkpoint stays loadable.
    ``filename`` is the metadata object's URL."""


class ExportNameCollisionError(PyckptError, ValueError):
    """Two exported tensors would get one name after ``strip_prefix`` / ``rename``.

    Attributes:
        name: the output name both would get.
        sources: the two source tensor names.
    """

    def __init__(self, name: str, sources: tuple[str, str]) -> None:
        super().__init__(
            f"tensors {sources[0]!r} and {sources[1]!r} would both be exported as {name!r}; "
            "change strip_prefix / rename, or narrow select"
        )
        self.name = name
        self.sources = tuple(sources)

    def __reduce__(self) -> tuple[type[ExportNameCollisionError], tuple[str, tuple[str, ...]]]:
        # Pickled to reach every rank of a consolidation: keep the attributes.
        return type(self), (self.name, self.sources)


class PeerLostError(PyckptError, RuntimeError):
    """Another rank of the process group died or stopped answering during one of pyckpt's own
    exchanges between ranks (node-local saves, loads and consolidations), so this rank gave up
    instead of waiting for the process group's timeout.

    Raised on every surviving rank within the bound of ``PYCKPT_PEER_TIMEOUT`` (see
    docs/RELIABILITY.md). The process group is unusable afterwards: pyckpt does not call it
    again, and the job should restart its ranks. Nothing already saved is touched.

    Attributes:
        rank: the group rank that was lost, when it could be told (else None).
        operation: the exchange that failed (e.g. ``"a node-local transfer"``).
    """

    def __init__(self, message: str, rank: int | None = None, operation: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.operation = operation

    def __reduce__(self) -> tuple[type[PeerLostError], tuple[str, int | None, str]]:
        return type(self), (str(self), self.rank, self.operation)
