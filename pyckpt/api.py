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
from torch.distributed.checkpoint.metadata import Metadata

from pyckpt.planner import SavePlanner
from pyckpt.storage import Reader, Writer

__all__ = ["save", "load"]


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
        torch.distributed.checkpoint.api.CheckpointException: A rank failed while planning or
            writing (DCP wraps each rank's exception, e.g. an ``OSError`` from a data file).
    """
    with Writer(path, **writer_options) as writer, _single_process_quiet():
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
        torch.distributed.checkpoint.api.CheckpointException: A rank failed (DCP wraps each
            rank's exception: ``FileNotFoundError`` when ``path`` holds no complete checkpoint,
            :class:`pyckpt.CheckpointFormatError` for invalid metadata or data, ``RuntimeError``
            for a key missing from the checkpoint).
    """
    with Reader(path) as reader, _single_process_quiet():
        dcp.load(state_dict, storage_reader=reader, process_group=process_group)
