"""This process's place in a process group, and the groups pyckpt makes for its own work.

``torch`` is imported lazily: a single process without ``torch.distributed`` works too.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pyckpt import _knobs

__all__ = ["Group", "group_info", "bound_s", "peer_group", "own_group", "coordination_group",
           "coordination_info"]


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
    pg = _new_gloo_group(list(ranks), timedelta(seconds=bound))
    _patience[pg] = job
    return pg


def _new_gloo_group(ranks: list[int], timeout: timedelta) -> Any:
    """A new gloo group over the global ``ranks``: the one place pyckpt makes a group.

    Over the whole world every rank calls it, and torch names the group by the count of
    groups made that way (the same on every rank). Over fewer ranks only the members call it
    (``use_local_synchronization``): torch then names it by a hash of the ranks and of the
    number of groups this process knows, so ranks that later make a local group together must
    have made the same groups before (torch's rule for such groups).
    """
    import torch.distributed as dist

    whole = sorted(ranks) == list(range(dist.get_world_size()))
    return dist.new_group(list(ranks), backend="gloo", timeout=timeout,
                          use_local_synchronization=not whole)


def _cpu_capable(pg: Any) -> bool:
    """Whether object collectives on ``pg`` travel in host memory (gloo, or a group with a CPU
    backend beside its accelerator one): torch then picks the CPU for them."""
    import torch
    import torch.distributed as dist

    try:
        return torch.device("cpu") in pg._device_types
    except Exception:  # another torch: the backend's name
        return "gloo" in str(dist.get_backend(pg))


def _timeout_of(pg: Any) -> timedelta:
    """The default timeout of ``pg``'s collectives (torch's default where it cannot be read)."""
    import torch.distributed as dist

    try:
        for device in pg._device_types:
            timeout = pg._get_backend(device).options._timeout
            if timeout.total_seconds() > 0:
                return timedelta(seconds=timeout.total_seconds())
    except Exception:  # another backend or torch version
        pass
    return dist.default_pg_timeout


# (ranks, purpose) -> weak references to (the default group it was made under, the gloo group).
# Groups are kept for the life of the default group and reused by later users: destroying a
# subgroup makes torch give the next one over the same ranks the same store prefix as an
# earlier one, whose stale keys then break its rendezvous. Weak: torch's registry keeps a group
# until destroy_process_group(), which then frees it (with the managers that used it); a strong
# reference here would keep it until the interpreter finalizes, where tearing down a gloo group
# can abort a process whose work is done.
_GROUPS: dict[tuple[tuple[int, ...], str], tuple[Any, Any]] = {}
_GROUPS_LOCK = threading.Lock()


def own_group(process_group: Any, purpose: str) -> Group:
    """A gloo group over the ranks of ``process_group`` (or one process), for background
    collectives (the checkpoint manager's, :func:`pyckpt.async_save`'s), so they never
    interleave with the training's on its group, gloo or not.

    Bounded as every exchange of pyckpt (:func:`pyckpt._collective.peer_group`): DCP's
    collectives on it wait ``PYCKPT_PEER_TIMEOUT`` at most, pyckpt's own up to the job's
    timeout for ranks that still beat; a frozen or dead rank raises ``PeerLostError`` naming it
    (the manager's ``peer_typed``, :func:`peer_errors` around ``pyckpt.async_save``'s save)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is not initialised")
        return Group(None, 0, 1, False)
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    world = dist.group.WORLD
    with _GROUPS_LOCK:
        made = _GROUPS.get((ranks, purpose))
        pg = None if made is None or made[0]() is not world else made[1]()
        if pg is None:
            pg = peer_group(list(ranks))
            _GROUPS[(ranks, purpose)] = (weakref.ref(world), weakref.ref(pg))
    return Group(pg, dist.get_rank(pg), dist.get_world_size(pg), True)


# User group -> weak reference to the gloo group derived from it (coordination_group). Weak
# both ways: torch's registry keeps a group until destroy_process_group(), which must free it
# (tearing a gloo group down at interpreter exit can abort a process whose work is done).
_derived: weakref.WeakKeyDictionary[Any, weakref.ReferenceType[Any]] = (
    weakref.WeakKeyDictionary())
_derived_lock = threading.Lock()


def coordination_group(group: Any = None) -> Any:
    """A gloo (CPU) process group with the ranks of ``group``, for checkpoint coordination.

    DCP's planning and result exchanges and pyckpt's own exchanges move small pickled objects;
    on an NCCL group each of them travels through GPU memory (torch allocates device buffers
    for every ``gather_object``). On the group returned here they stay in host memory.
    :func:`pyckpt.save`, :func:`pyckpt.load` and :func:`pyckpt.consolidate` use it by
    themselves; with DCP directly, pass it on::

        dcp.save(state, storage_writer=pyckpt.Writer(path),
                 process_group=pyckpt.coordination_group(pg))

    The group is made once per ``group`` object and returned again by later calls (it lives
    as long as ``group`` does, until ``destroy_process_group``). Making it is collective: the
    first call for a ``group`` must be made by every member of ``group``, at the same point of
    the program (every member of the world for the default group); non-members need not call.
    Its default timeout is ``group``'s own.

    Args:
        group: the user's process group (default: the default group).

    Returns:
        ``group`` itself when it already carries CPU tensors (gloo, or a group with a CPU
        backend), else the derived gloo group; None in a single process (no default group).

    Raises:
        ValueError: ``group`` was given but ``torch.distributed`` is not initialised, or this
            process is not a member of ``group``.
    """
    if group is None and "torch.distributed" not in sys.modules:
        return None  # a single process (see group_info)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("process_group given but torch.distributed is not initialised")
        return None
    pg = group if group is not None else dist.group.WORLD
    if dist.get_rank(pg) < 0:
        raise ValueError(
            f"pyckpt: this process (global rank {dist.get_rank()}) is not a member of the "
            "process group it was asked to checkpoint with; only the group's ranks may call "
            "pyckpt.save / pyckpt.load / pyckpt.coordination_group with it")
    if _cpu_capable(pg):
        return pg
    with _derived_lock:
        made = _derived.get(pg)
        derived = made() if made is not None else None
        if derived is None:
            ranks = dist.get_process_group_ranks(pg)
            if ranks != sorted(ranks):  # torch's groups hold their ranks in order
                raise ValueError(f"pyckpt: cannot derive a gloo group from a process group "
                                 f"whose ranks are not in ascending order: {ranks}")
            derived = _new_gloo_group(ranks, _timeout_of(pg))
            _derived[pg] = weakref.ref(derived)
    return derived


def coordination_arg(group: Any = None) -> Any:
    """What pyckpt's own calls pass on as their process group: :func:`coordination_group` of
    ``group``, except that None stays None when the default group carries CPU tensors itself.

    Their frames then never hold the default group: a failed call's exception keeps its frames
    alive through a reference cycle until the cyclic collector runs, and a gloo group still
    alive when the interpreter finalizes is torn down there, where its threads can abort the
    process ("terminate called without an active exception") after its work is done.
    """
    derived = coordination_group(group)
    if group is None and derived is not None:  # torch.distributed is imported then
        import torch.distributed as dist

        if derived is dist.group.WORLD:
            return None
    return derived


def coordination_info(process_group: Any) -> Group:
    """:func:`group_info` of :func:`coordination_arg` of ``process_group``: for pyckpt's own
    exchanges, which every rank of the group starts at the same point."""
    return group_info(coordination_arg(process_group))


def _device(pg: Any) -> Any:
    import torch
    import torch.distributed as dist

    if dist.get_backend(pg) == "nccl":  # object collectives then travel as CUDA tensors
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
