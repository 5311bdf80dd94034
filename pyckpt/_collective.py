"""Small collectives over a ``torch.distributed`` process group (objects, not tensors).

Used by consolidation and by node-local checkpoints. ``torch`` is imported lazily: a single
process without ``torch.distributed`` works too (every function then acts on one rank).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pyckpt.errors import PyckptError

__all__ = ["Group", "group_info", "broadcast", "all_gather", "portable", "add_note", "agree"]

T = TypeVar("T")


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


def broadcast(obj: Any, group: Group, src: int = 0) -> Any:
    """``obj`` of group rank ``src`` on every rank."""
    if not group.distributed:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, group=group.pg, group_src=src)
    return box[0]


def all_gather(obj: Any, group: Group) -> list[Any]:
    """Every rank's ``obj``, indexed by group rank."""
    if not group.distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * group.world
    dist.all_gather_object(out, obj, group=group.pg)
    return out


def portable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a PyckptError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return PyckptError(f"{type(exc).__name__}: {exc}")


def add_note(exc: BaseException, text: str) -> None:
    """``exc.add_note(text)`` where Python has it (3.11+); a no-op on 3.10."""
    method = getattr(exc, "add_note", None)
    if method is not None:
        method(text)


def agree(
    fn: Callable[[], T],
    group: Group,
    *,
    ranks: str = "all",
    on_failure: Callable[[], None] | None = None,
    what: str = "operation",
) -> tuple[T | None, list[Any]]:
    """Runs ``fn`` on every rank (or only rank 0), agrees on success, re-raises the first failure.

    Every rank of ``group`` must call this at the same point. ``fn``'s exceptions (``Exception``
    only: a ``KeyboardInterrupt`` propagates at once) are caught; then every rank learns every
    rank's outcome. If any rank failed, ``on_failure`` runs on every rank (cleanup), and every
    rank raises: a rank whose ``fn`` failed raises its own exception; the others raise the
    failure of the lowest failing rank (the same type when it can be pickled, with a note
    naming that rank).

    Args:
        fn: the work of this rank.
        group: from :func:`group_info`.
        ranks: ``"all"`` (every rank runs ``fn``) or ``"root"`` (only rank 0 does; its result is
            returned on every rank, so it must be picklable).
        on_failure: cleanup run on every rank when any rank failed, before raising.
        what: names the step in the note added to a re-raised remote failure.

    Returns:
        ``(value, values)``: this rank's result (rank 0's for ``ranks="root"``) and the list of
        every rank's result (``[value]`` for ``ranks="root"``).
    """
    if ranks not in ("all", "root"):
        raise ValueError(f"ranks must be 'all' or 'root', got {ranks!r}")
    runs = ranks == "all" or group.rank == 0
    value: T | None = None
    error: BaseException | None = None
    if runs:
        try:
            value = fn()
        except Exception as e:
            error = e
    status = None if error is None else portable(error)
    if ranks == "root":
        value, status = broadcast((value, status), group)
        outcomes = [status]
        values: list[Any] = [value]
    else:
        gathered = all_gather((value, status) if group.distributed else (None, status), group)
        outcomes = [s for _, s in gathered]
        values = [v for v, _ in gathered] if group.distributed else [value]
    failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
    if not failed:
        return value, values
    if on_failure is not None:
        on_failure()
    if error is not None:
        raise error
    bad_rank, remote = failed[0]
    add_note(remote, f"pyckpt: {what} failed on rank {bad_rank}")
    raise remote
