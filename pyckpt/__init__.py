"""pyckpt: native-accelerated checkpoint I/O for PyTorch Distributed Checkpoint (DCP).

Public API (torch-dependent names are imported lazily, so ``import pyckpt`` stays cheap):

* :class:`Writer` / :class:`Reader` -- DCP ``StorageWriter`` / ``StorageReader``.
* :class:`SavePlanner` -- DCP save planner that spreads replicated state over ranks by bytes.
* :class:`LoadPlanner` -- DCP load planner whose per-rank planning does not grow with the
  number of saving ranks (indexed stored chunks), weights-only for non-tensor values.
* :func:`save` / :func:`async_save` / :func:`load` -- one-line conveniences using the above
  (plans cached across saves; ``async_save`` returns once the state is staged).
* :func:`consolidate` -- rank-partitioned export to Hugging Face safetensors.
* :func:`coordination_group` -- the gloo group (same ranks) checkpoint coordination runs on.
* :func:`find_error` -- pyckpt's error inside DCP's ``CheckpointException`` wrapper.
* :class:`CheckpointManager` -- node-local fast tier with peer replicas, durable tier, retention.
* :func:`reserve_pinned` / :func:`release_pinned` / :func:`set_pinned_limit` /
  :func:`pinned_stats` -- the process's pinned staging memory (shared by every Writer/Reader).
"""

from __future__ import annotations

import importlib
from typing import Any

from pyckpt import errors
from pyckpt._C import __version__

# The function lives in pyckpt._consolidate (scan / plan / run); importing it does not import torch.
from pyckpt._consolidate import consolidate
from pyckpt.errors import (
    CheckpointFormatError,
    ChecksumError,
    CompressionError,
    ConcurrentSaveError,
    CudaError,
    ExportNameCollisionError,
    JobMismatchError,
    NoCredentialsError,
    ObjectStoreError,
    PartialLoadError,
    PartialLoadWarning,
    PeerLostError,
    PinnedMemoryWarning,
    PyckptError,
    ReplicaMismatchError,
    StepMismatchError,
    TierBudgetError,
    TierWarning,
    UnsupportedDtypeError,
    find_error,
)

__all__ = [
    "__version__",
    "Writer",
    "Reader",
    "SavePlanner",
    "LoadPlanner",
    "save",
    "async_save",
    "load",
    "consolidate",
    "coordination_group",
    "CheckpointManager",
    "reserve_pinned",
    "release_pinned",
    "set_pinned_limit",
    "pinned_stats",
    "errors",
    "PyckptError",
    "CheckpointFormatError",
    "ChecksumError",
    "CompressionError",
    "CudaError",
    "ConcurrentSaveError",
    "ExportNameCollisionError",
    "NoCredentialsError",
    "ObjectStoreError",
    "PartialLoadError",
    "PartialLoadWarning",
    "PeerLostError",
    "PinnedMemoryWarning",
    "ReplicaMismatchError",
    "StepMismatchError",
    "TierBudgetError",
    "JobMismatchError",
    "TierWarning",
    "UnsupportedDtypeError",
    "find_error",
]

_LAZY = {
    "Writer": "pyckpt.storage",
    "Reader": "pyckpt.storage",
    "SavePlanner": "pyckpt.planner",
    "LoadPlanner": "pyckpt._loadplan",
    "save": "pyckpt.api",
    "async_save": "pyckpt.api",
    "load": "pyckpt.api",
    "CheckpointManager": "pyckpt.manager",
    "coordination_group": "pyckpt._collective.group",
    "reserve_pinned": "pyckpt._pinned",
    "release_pinned": "pyckpt._pinned",
    "set_pinned_limit": "pyckpt._pinned",
    "pinned_stats": "pyckpt._pinned",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pyckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
