"""Exception types raised by pyckpt.

OS-level failures surface as the builtin :class:`OSError` subclasses (``FileNotFoundError``,
``PermissionError``, ...) with ``filename`` set; everything pyckpt-specific derives from
:class:`PyckptError`.
"""

from __future__ import annotations

import sys
from typing import TypeVar, overload

__all__ = [
    "find_error",
    "PyckptError",
    "CheckpointFormatError",
    "ChecksumError",
    "CompressionError",
    "CudaError",
    "UnsupportedDtypeError",
    "ReplicaMismatchError",
    "StepMismatchError",
    "ObjectStoreError",
    "NoCredentialsError",
    "ConcurrentSaveError",
    "ExportNameCollisionError",
    "TierBudgetError",
    "JobMismatchError",
    "TierWarning",
    "PinnedMemoryWarning",
    "PeerLostError",
    "PartialLoadError",
    "PartialLoadWarning",
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


class StepMismatchError(PyckptError, ValueError):
    """The ranks of a :class:`pyckpt.CheckpointManager` passed different steps to one collective
    :meth:`~pyckpt.CheckpointManager.save` (an off-by-one in one rank's loop). Raised on every
    rank before anything of the save is written or committed in any tier; the steps already
    complete stay as they were. A ``ValueError``: the calls' arguments disagree.

    Attributes:
        steps: group rank -> the step that rank passed.
    """

    def __init__(self, message: str, steps: dict[int, int] | None = None) -> None:
        super().__init__(message)
        self.steps = dict(steps or {})

    def __reduce__(self) -> tuple[type[StepMismatchError], tuple[str, dict[int, int]]]:
        return type(self), (str(self), self.steps)


class ObjectStoreError(PyckptError, OSError):
    """An object-store request failed for a reason other than a missing object or bucket
    (``FileNotFoundError``) or refused credentials (``PermissionError``): e.g. the store is
    unreachable after the retries. ``filename`` is the object's or checkpoint's URL."""


class NoCredentialsError(PyckptError, PermissionError):
    """No credentials for an object store were found: none in the ``AWS_*`` environment
    variables, the AWS shared files (``~/.aws/credentials``, ``~/.aws/config``) or
    ``storage_options``, and the EC2 instance metadata service provided none. The message says
    how to provide them. A ``PermissionError``; ``filename`` is the URL."""


class ConcurrentSaveError(ObjectStoreError):
    """Another save committed a checkpoint into the same place (object-store prefix or
    directory) while this one ran (its metadata changed after this save began). This save is
    abandoned: its own objects are deleted and nothing else is touched, so the other save's
    checkpoint stays loadable. ``filename`` is the metadata object's URL or file."""


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


_E = TypeVar("_E", bound=BaseException)


def _dcp_failures(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's ``CheckpointException``, lowest rank first; empty
    for any other exception. (DCP is not imported here: if its module is not loaded, ``exc``
    cannot be one of its exceptions.)"""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    wrapper = getattr(api, "CheckpointException", None) if api is not None else None
    if wrapper is None or not isinstance(exc, wrapper):
        return []
    failures = getattr(exc, "failures", None) or {}
    out = []
    for rank in sorted(failures):
        failure = failures[rank]
        original = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(original, BaseException):
            out.append(original)
    return out


@overload
def find_error(exc: BaseException) -> Exception | None: ...
@overload
def find_error(exc: BaseException, error_type: type[_E] | tuple[type[_E], ...]) -> _E | None: ...


def find_error(
    exc: BaseException, error_type: type[BaseException] | tuple[type[BaseException], ...] = Exception
) -> BaseException | None:
    """The first exception of ``error_type`` in ``exc``, or None.

    ``dcp.save``, ``dcp.load`` and ``dcp.async_save`` (its future's ``result()``) deliver the
    errors pyckpt raises on any rank inside DCP's ``CheckpointException``, a
    ``BaseException`` that ``except Exception`` does not catch and whose type says nothing
    about the failure. This looks, in order, at ``exc`` itself, then into DCP's wrapper (every
    failed rank, lowest rank first) and along the ``__cause__`` / ``__context__`` chains of
    each, so one call finds a pyckpt error whether it came through DCP, through
    :func:`pyckpt.save` (which already re-raises the lowest rank's error) or through a
    framework that re-raised it::

        try:
            dcp.save(sd, storage_writer=pyckpt.Writer(path, overwrite=False))
        except BaseException as e:
            if pyckpt.find_error(e, FileExistsError) is None:
                raise  # anything else, KeyboardInterrupt included, goes on
            print("step already saved")

    Args:
        exc: the caught exception.
        error_type: a class or tuple of classes, as for ``isinstance`` (default ``Exception``:
            the first ordinary exception, i.e. the original error inside DCP's wrapper).

    Returns:
        The exception found (the object raised on the failing rank, with its attributes, e.g.
        ``filename``), or None.
    """
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        inner = _dcp_failures(e)
        if isinstance(e, error_type) and not inner:
            return e
        todo[:0] = inner  # a wrapper's contents come before what wrapped it
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None
class TierBudgetError(PyckptError):
    """A :class:`pyckpt.CheckpointManager` save would take a node's fast tier over its
    ``local_budget_bytes``; raised on every rank before anything of the save is written.

    Attributes:
        node: the node id. projected: the bytes the node's fast tier would hold. budget: the limit.
    """

    def __init__(self, message: str, node: str = "", projected: int = 0, budget: int = 0) -> None:
        super().__init__(message)
        self.node = node
        self.projected = projected
        self.budget = budget

    def __reduce__(self) -> tuple[type[TierBudgetError], tuple[str, str, int, int]]:
        return type(self), (str(self), self.node, self.projected, self.budget)


class JobMismatchError(PyckptError, ValueError):
    """A :class:`pyckpt.CheckpointManager`'s durable tier holds the checkpoints of another job
    (its marker ``<durable>/pyckpt-job/pyckpt.json`` names that job); nothing was written or
    restored.

    Attributes:
        location: the durable tier. owner: the job that holds it. job: this manager's job (None:
            none given).
    """

    def __init__(self, message: str, location: str = "", owner: str = "",
                 job: str | None = None) -> None:
        super().__init__(message)
        self.location = location
        self.owner = owner
        self.job = job

    def __reduce__(self) -> tuple[type[JobMismatchError], tuple[str, str, str, str | None]]:
        return type(self), (str(self), self.location, self.owner, self.job)


class TierWarning(UserWarning):
    """A :class:`pyckpt.CheckpointManager` restore came from the durable tier although a fast
    tier is configured (the message names the step and what the fast tier lacked), or a step
    due for the durable tier was not persisted because a newer one superseded it while the
    durable tier was busy (the message names both steps)."""
class PinnedMemoryWarning(UserWarning):
    """A state to stage does not fit in the process's pinned staging memory: the part that does
    not fit is copied into pageable memory and the save blocks for that copy (see
    ``pyckpt.reserve_pinned`` and ``PYCKPT_PINNED_LIMIT``)."""
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


class PartialLoadError(PyckptError, RuntimeError):
    """A load would leave stored entries unloaded under a key the state dict being loaded holds
    (e.g. ``optim.state`` of a fresh optimizer's ``state_dict()``, which has no entries yet):
    raised by :func:`pyckpt.load` and :meth:`pyckpt.CheckpointManager.restore` unless
    ``allow_partial=True``, before any byte is loaded. The message names the keys and the fix.

    Attributes:
        path: the checkpoint.
        unloaded: key the state dict holds -> the stored entries under it that it does not ask
            for (sorted).
    """

    def __init__(self, message: str, path: str = "",
                 unloaded: dict[str, list[str]] | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.unloaded = dict(unloaded or {})

    def __reduce__(self) -> tuple[type[PartialLoadError], tuple[str, str, dict[str, list[str]]]]:
        return type(self), (str(self), self.path, self.unloaded)


class PartialLoadWarning(UserWarning):
    """``dcp.load`` with :class:`pyckpt.Reader` leaves stored entries unloaded under a key the
    state dict holds (see :class:`PartialLoadError`, which :func:`pyckpt.load` raises instead)."""
