"""The checkpoint manager's own process groups (:func:`pyckpt._collective.own_group`: gloo
groups over the training's ranks, made once per set of ranks and purpose), and the decorator
that names a lost peer in the exceptions of DCP's collectives on them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from pyckpt._collective import own_group, peer_errors

__all__ = ["own_group", "peer_typed"]

_F = TypeVar("_F", bound=Callable[..., Any])


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
