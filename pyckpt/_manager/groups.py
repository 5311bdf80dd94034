"""The checkpoint manager's own process groups: gloo groups over the training's ranks, made
once per set of ranks and purpose, and the decorator that names a lost peer in the exceptions
of DCP's collectives on them."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from pyckpt._collective import Group, peer_errors, peer_group

__all__ = ["own_group", "peer_typed"]

_F = TypeVar("_F", bound=Callable[..., Any])


# (ranks, purpose) -> weak references to (the default group it was made under, the gloo group).
# Groups are kept for the life of the default group and reused by later managers: destroying a
# subgroup makes torch give the next one over the same ranks the same store prefix as an
# earlier one, whose stale keys then break its rendezvous. Weak: torch's registry keeps a group
# until destroy_process_group(), which then frees it (with the managers that used it); a strong
# reference here would keep it until the interpreter finalizes, where tearing down a gloo group
# can abort a process whose work is done.
_GROUPS: dict[tuple[tuple[int, ...], str], tuple[Any, Any]] = {}
_GROUPS_LOCK = threading.Lock()


def own_group(process_group: Any, purpose: str) -> Group:
    """A gloo group over the ranks of ``process_group`` (or one process), for the manager's
    background collectives, so they never interleave with the training's on its group.

    Bounded as every exchange of pyckpt (:func:`pyckpt._collective.peer_group`): DCP's
    collectives on it wait ``PYCKPT_PEER_TIMEOUT`` at most, pyckpt's own up to the job's
    timeout for ranks that still beat; a frozen or dead rank raises ``PeerLostError`` naming it
    (:func:`peer_typed`)."""
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


def peer_typed(group: str, what: str) -> Callable[[_F], _F]:
    """Decorates a method of :class:`pyckpt.CheckpointManager` whose collectives run on its group
    ``group`` (an attribute): the transport's report of a lost peer, raised by DCP's collectives
    there, becomes ``PeerLostError`` naming the rank (pyckpt's own raise it already)."""
    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with peer_errors(getattr(self, group).pg, what):
                return method(self, *args, **kwargs)
        return run  # type: ignore[return-value]
    return wrap
