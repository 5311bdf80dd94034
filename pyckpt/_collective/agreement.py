"""Agreement: run a step on every rank (or one), agree on the outcome, raise the same failure
everywhere."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pyckpt._collective.group import Group
from pyckpt._collective.transport import all_gather, broadcast
from pyckpt.errors import PyckptError

__all__ = ["agree", "portable", "add_note", "raise_first"]

T = TypeVar("T")


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


def attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``(fn(), None)``, or ``(None, the exception)`` when ``fn`` raised one (a
    ``KeyboardInterrupt`` propagates at once): a rank's step whose outcome the others must
    learn through a collective."""
    try:
        return fn(), None
    except Exception as e:
        return None, e


def raise_first(errors: Sequence[BaseException | None] | Mapping[int, BaseException | None],
                mine: BaseException | None, what: str) -> None:
    """The failure every rank raises after an exchange of outcomes: this rank's own ``mine``
    when it has one, else the failure of the lowest failing rank in ``errors`` (by group rank:
    a list of every rank's failure or None, or a mapping of some ranks to theirs; as sent, so
    :func:`portable`), with a note naming that rank and ``what``. Returns when no rank failed.
    """
    if mine is not None:
        raise mine
    by_rank = sorted(errors.items()) if isinstance(errors, Mapping) else enumerate(errors)
    for rank, remote in by_rank:
        if remote is not None:
            add_note(remote, f"pyckpt: {what} failed on rank {rank}")
            raise remote


def _check_root(group: Group, root: int) -> None:
    """Refuses a root that is not a rank of ``group`` (before any step runs)."""
    if not 0 <= root < max(group.world, 1):
        raise ValueError(f"root must be a rank of the group (0..{group.world - 1}), got {root}")


def agree(
    fn: Callable[[], T],
    group: Group,
    *,
    ranks: str = "all",
    on_failure: Callable[[], None] | None = None,
    what: str = "operation",
    root: int = 0,
) -> tuple[T | None, list[Any]]:
    """Runs ``fn`` on every rank (or only ``root``), agrees on success, re-raises the first
    failure.

    Every rank of ``group`` must call this at the same point. ``fn``'s exceptions (``Exception``
    only: a ``KeyboardInterrupt`` propagates at once) are caught; then every rank learns every
    rank's outcome. If any rank failed, ``on_failure`` runs on every rank (cleanup), and every
    rank raises: a rank whose ``fn`` failed raises its own exception; the others raise the
    failure of the lowest failing rank (the same type when it can be pickled, with a note
    naming that rank).

    Args:
        fn: the work of this rank.
        group: from :func:`group_info`.
        ranks: ``"all"`` (every rank runs ``fn``) or ``"root"`` (only group rank ``root``
            does; its result is returned on every rank, so it must be picklable).
        on_failure: cleanup run on every rank when any rank failed, before raising.
        what: names the step in the note added to a re-raised remote failure.
        root: the rank that runs ``fn`` with ``ranks="root"`` (default 0).

    Returns:
        ``(value, values)``: this rank's result (``root``'s for ``ranks="root"``) and the list
        of every rank's result (``[value]`` for ``ranks="root"``).
    """
    if ranks not in ("all", "root"):
        raise ValueError(f"ranks must be 'all' or 'root', got {ranks!r}")
    _check_root(group, root)
    runs = ranks == "all" or group.rank == root
    value: T | None = None
    error: BaseException | None = None
    if runs:
        try:
            value = fn()
        except Exception as e:
            error = e
    status = None if error is None else portable(error)
    if ranks == "root":
        value, status = broadcast((value, status), group, src=root, what=what)
        statuses: dict[int, BaseException | None] = {root: status}  # by rank
        values: list[Any] = [value]
    else:
        gathered = all_gather((value, status) if group.distributed else (None, status), group,
                              what=what)
        statuses = {r: s for r, (_, s) in enumerate(gathered)}
        values = [v for v, _ in gathered] if group.distributed else [value]
    if on_failure is not None and any(s is not None for s in statuses.values()):
        on_failure()
    raise_first(statuses, error, what)
    return value, values
