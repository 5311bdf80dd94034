"""The state every part of :class:`pyckpt.CheckpointManager` shares (declared once here) and
its bookkeeping of background work: failures kept for the caller, notices warned in the
caller's thread, waiting for the work in flight."""

from __future__ import annotations

import logging
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from pyckpt import _background
from pyckpt._collective import add_note
from pyckpt.errors import TierWarning

if TYPE_CHECKING:
    from pyckpt._collective import Group
    from pyckpt._manager.info import RestoreInfo, SaveInfo
    from pyckpt._tier_io import DurableTier, LocalTier
    from pyckpt.storage import Writer

__all__ = ["ManagerBase"]

logger = logging.getLogger("pyckpt.manager")


class ManagerBase:
    """The attributes :class:`pyckpt.CheckpointManager`'s constructor sets (see it), and the
    helpers of its background work. Not used alone."""

    save_every: int
    persist_every: int
    keep_local: int
    keep_durable: int
    local_budget_bytes: int | None
    replication_window_bytes: int
    check_replicas: bool | str
    store: DurableTier
    node: str
    tier: LocalTier | None
    nodes: list[str]
    replicas: int
    last_save: SaveInfo | None
    last_restore: RestoreInfo | None
    last_persisted: int | None
    _fsync: bool
    _group: Group
    _persist_group: Group
    _leader: bool
    _fast_writer: Writer | None
    _durable_writer: Writer | None
    _save_ex: ThreadPoolExecutor
    _persist_ex: ThreadPoolExecutor
    _fast_future: Future[int] | None
    _persist_future: Future[int | None] | None
    _pinned_lock: threading.Lock
    _failures: list[BaseException]
    _notices: list[str]
    _pending: list[tuple[int, dict[str, int], dict[str, list[str]]]]
    _in_flight: int | None
    _closed: bool

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed")

    def _settle(self, fut: Future[int] | None) -> None:
        """Waits for fast-tier save ``fut``; keeps its failure for :meth:`_raise_failure`
        (persistence tasks keep their own)."""
        if fut is None:
            return
        exc = fut.exception()
        with self._pinned_lock:
            if exc is not None and not getattr(fut, "_pyckpt_seen", False):
                self._failures.append(exc)
            fut._pyckpt_seen = True  # type: ignore[attr-defined]

    def _raise_failure(self, note: str | None = None) -> None:
        """Raises the failures kept (each once): the first, with a note naming every later
        one, and ``note``."""
        with self._pinned_lock:
            failures, self._failures = self._failures, []
        if not failures:
            return
        exc = failures[0]
        add_note(exc, "pyckpt: raised by CheckpointManager from earlier background work")
        for other in failures[1:]:
            notes = [n for n in getattr(other, "__notes__", []) if n.startswith("pyckpt: ")]
            add_note(exc, f"pyckpt: later background work failed too: {type(other).__name__}: "
                          f"{other}" + (f" ({'; '.join(notes)})" if notes else ""))
        if note is not None:
            add_note(exc, note)
        raise exc

    def _notice(self, message: str) -> None:
        """A TierWarning of background work: logged now, warned in the caller's thread by the
        next :meth:`save` or :meth:`wait` (a warning raised in a background thread, where
        warnings are errors, would fail the work)."""
        logger.warning("%s", message)
        with self._pinned_lock:
            self._notices.append(message)

    def _warn_notices(self) -> None:
        with self._pinned_lock:
            notices, self._notices = self._notices, []
        for message in notices:
            warnings.warn(TierWarning(message), stacklevel=3)

    def _drain(self) -> None:
        """Waits for the work in flight, and for other managers' saves on this group (the
        restore's collectives follow on it); a failure of this manager's work is logged, not
        raised (a restore is what follows a failure)."""
        self._settle(self._fast_future)
        if self._persist_future is not None:
            wait_futures([self._persist_future])
        _background.idle(self._save_ex)
        with self._pinned_lock:
            failures, self._failures = self._failures, []
        for exc in failures:
            logger.warning("pyckpt: a checkpoint save failed before this restore: %r", exc)
