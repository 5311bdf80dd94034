"""One-line save and load through DCP with pyckpt's writer, reader and planner.

    pyckpt.save(model.state_dict(), "/ckpt/step-100")           # every rank calls it
    pyckpt.load(state_dict, "/ckpt/step-100")                    # fills state_dict in place

Both are collective when a default process group exists (or ``process_group`` is given) and
work in a single process otherwise, like ``dcp.save`` / ``dcp.load`` (without DCP's warning
about running in a single process).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from pyckpt.planner import SavePlanner
from pyckpt.storage import Reader, Writer

__all__ = ["save", "load"]


@contextlib.contextmanager
def _typed_errors() -> Iterator[None]:
    """Re-raises the original exception of the lowest failing rank instead of DCP's
    ``CheckpointException`` wrapper (a ``BaseException`` that hides the type): callers can catch
    ``FileNotFoundError``, :class:`pyckpt.ChecksumError`, ``OSError`` (disk full) and so on.
    The wrapper, with every rank's failure, stays attached as ``__cause__``."""
    try:
        yield
    except CheckpointException as wrapped:
        failures = getattr(wrapped, "failures", None) or {}
        if not failures:
            raise
        first = failures[min(failures)]
        original = first[0] if isinstance(first, tuple) else first
        if not isinstance(original, Exception):
            raise
        raise original from wrapped


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silences DCP's warning that it runs in one process: for these helpers that is a mode,
    not an accident (e.g. loading a multi-rank checkpoint offline)."""
    if dist.is_available() and dist.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    **writer_options: Any,
) -> Metadata:
    """Saves ``state_dict`` to the checkpoint directory ``path`` with DCP.

    Uses :class:`pyckpt.Writer` and :class:`pyckpt.SavePlanner`, so replicated state (DDP,
    FSDP ``NO_SHARD``, ``Replicate()`` DTensors, HSDP replicas) is written in balanced byte
    ranges by all the ranks that hold it.

    Args:
        state_dict: The (possibly nested) state dict, as for ``dcp.save``.
        path: Checkpoint directory; created if missing.
        process_group: Process group of the save (default: the default group, if any).
        **writer_options: Passed to :class:`pyckpt.Writer` (``compression="zstd"``,
            ``threads``, ``direct_io``, ``fsync``, ...).

    Returns:
        The DCP ``Metadata`` of the saved checkpoint.

    Raises:
        ValueError: Invalid writer options.
        OSError, pyckpt.PyckptError, ...: the exception of the lowest failing rank, re-raised
            from DCP's ``CheckpointException`` (attached as ``__cause__``), e.g. ``OSError``
            (ENOSPC, EFBIG) from a data file or :class:`pyckpt.UnsupportedDtypeError`.
    """
    with Writer(path, **writer_options) as writer, _single_process_quiet(), _typed_errors():
        return dcp.save(
            state_dict,
            storage_writer=writer,
            planner=SavePlanner(),
            process_group=process_group,
        )


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
) -> None:
    """Loads the checkpoint at ``path`` into ``state_dict`` in place with DCP.

    Any world size can load any checkpoint: each rank reads only the byte ranges of the stored
    pieces that overlap what its state dict holds, including items a save split across ranks.

    Args:
        state_dict: The state dict to fill; its tensors (or DTensors) give the shapes and the
            placement to load into.
        path: Checkpoint directory written by :func:`save` or ``dcp.save`` with
            :class:`pyckpt.Writer`.
        process_group: Process group of the load (default: the default group, if any).

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint or a data file is missing.
        pyckpt.CheckpointFormatError: invalid metadata, unknown format version, truncated
            data; :class:`pyckpt.ChecksumError` for corrupted chunks (naming file and tensor).
        RuntimeError: a key of ``state_dict`` is missing from the checkpoint (DCP's error).
        Errors are the lowest failing rank's own exception, re-raised from DCP's
        ``CheckpointException`` (attached as ``__cause__``).
    """
    with _typed_errors(), Reader(path) as reader, _single_process_quiet():
        dcp.load(state_dict, storage_reader=reader, process_group=process_group)
