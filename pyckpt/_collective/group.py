"""This process's place in a process group, and the groups pyckpt makes for its own work.

``torch`` is imported lazily: a single process without ``torch.distributed`` works too.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pyckpt import _knobs

__all__ = ["Group", "group_info", "bound_s", "peer_group"]


@dataclass(frozen=True)
class Group:
    """This process's place in a process group (``pg`` is None when not distributed)."""

    pg: Any
    rank: int
    world: int
    distributed: bool


def group_info(process_group: Any) -> Group:
    """Rank and size of ``process_group`` (default: the default group when initialised).

    Raises:
        ValueError: ``process_group`` was given but ``torch.distributed`` is unavailable or not
            initialised, or this process is not a member of it.
    """
    if process_group is None and "torch.distributed" not in sys.modules:
        # No group can be initialised before torch.distributed is imported: a single process,
        # told without importing torch (seconds: a CLI command or a script that never uses it).
        return Group(None, 0, 1, False)
    try:
        import torch.distributed as dist
    except ImportError:  # torch is optional: a single process then
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is unavailable") from None
        return Group(None, 0, 1, False)
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is not initialised")
        return Group(None, 0, 1, False)
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("this process is not a member of process_group")
    return Group(process_group, rank, dist.get_world_size(process_group), True)


def _pg(group: Group) -> Any:
    import torch.distributed as dist

    return group.pg if group.pg is not None else dist.group.WORLD


def bound_s(group: Group) -> float:
    """Seconds one collective of pyckpt waits before it checks the other ranks' heartbeats:
    ``PYCKPT_PEER_TIMEOUT`` (default 300), capped at the process group's own timeout where it
    can be read."""
    bound = float(_knobs.peer_timeout())
    try:
        import torch

        own = _pg(group)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        if own > 0:
            bound = min(bound, own)
    except Exception:  # another backend or torch version: the knob alone
        pass
    return bound


# Groups made by peer_group: group -> the seconds pyckpt's own collectives on it wait for ranks
# that still beat (the job's own timeout; the group's default, which DCP's collectives use, is
# the peer bound). Weak, as _beating.
_patience: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def peer_group(ranks: list[int]) -> Any:
    """A new gloo group over the global ``ranks`` for pyckpt's background work (the manager's),
    bounded as every exchange of pyckpt is.

    Its default timeout, which collectives pyckpt does not run itself use (DCP's planning and
    result exchanges), is :func:`bound_s` of the default group (``PYCKPT_PEER_TIMEOUT``, capped
    at the job's own timeout), not torch's 30 minutes: a frozen or dead rank there fails the
    collective within the bound. pyckpt's own collectives on it keep their heartbeat check and
    wait for ranks that still beat up to the job's own timeout (the default group's).
    """
    import torch
    import torch.distributed as dist

    job = None
    try:
        world: Any = dist.group.WORLD
        job = world._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # another backend or torch version: torch's default
        pass
    if not job or job <= 0:
        job = dist.default_pg_timeout.total_seconds()
    bound = min(float(_knobs.peer_timeout()), job)
    pg = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                        timeout=timedelta(seconds=bound))
    _patience[pg] = job
    return pg


def _device(pg: Any) -> Any:
    import torch
    import torch.distributed as dist

    if dist.get_backend(pg) == "nccl":  # object collectives then travel as CUDA tensors
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
