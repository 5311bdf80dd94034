"""The native collaborators a Writer or Reader owns: the worker thread pool and the GPU staging.

Native worker threads (one of the thread models of docs/ARCHITECTURE.md, "Threads"): this is
the only module that makes a native ``ThreadPool``. Each Writer and each Reader owns one (made
on first use, stopped by ``close()``), and every encode, write, read, verify and decode of that
object runs on it with the GIL released; work outside a Writer or Reader (consolidation, a
verify, the manager's copy check) takes one for the call (:func:`call_pool`). A backend only
moves bytes; where its client has its own concurrency (obstore's uploads) that stays inside the
client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pyckpt import _C, _knobs

if TYPE_CHECKING:  # imports torch: only when a Writer or Reader stages (consolidate does not)
    from pyckpt._staging import DeviceStaging

__all__ = ["_Native", "_check_pinned_pool_bytes", "apply_native_settings", "call_pool"]


def apply_native_settings() -> None:
    """Sets the process-wide native settings from their knobs, read now, as every knob is at
    the start of the work it governs: the host cache's bound (``PYCKPT_HOST_CACHE_BYTES``) and
    the bytes per file read call (``PYCKPT_READ_BYTES``)."""
    _C.set_host_cache_limit(_knobs.host_cache_bytes())
    _C.set_read_piece_bytes(_knobs.read_bytes())


def _new_pool(threads: int) -> Any:
    """A native pool of ``threads`` workers (started on first use): the one constructor."""
    return _C.ThreadPool(threads)


@contextlib.contextmanager
def call_pool(threads: int) -> Iterator[Any]:
    """A native pool of ``threads`` workers for one call, stopped (its threads joined) when the
    block ends, normally or not."""
    pool = _new_pool(threads)
    try:
        yield pool
    finally:
        pool.shutdown()


def _check_pinned_pool_bytes(value: int | None) -> None:
    if value is not None and (type(value) is not int or value < _knobs.MIN_PINNED_POOL_BYTES):
        raise ValueError(
            f"pinned_pool_bytes must be an int >= {_knobs.MIN_PINNED_POOL_BYTES}, got {value!r}"
        )


class _Native:
    """The native collaborators of a Writer or Reader, each made on first use: the worker
    thread pool and the GPU staging (:class:`~pyckpt._staging.DeviceStaging`, a handle on the
    pinned memory and per-device stagers that the process owns once, :mod:`pyckpt._pinned`, so a
    new Writer per checkpoint reuses them). :meth:`close` drops both handles (the owner stays
    usable: they are made again when needed; the pinned memory is not freed); pickling keeps
    only the configuration."""

    def __init__(
        self,
        threads: int | None,
        default: Any = _knobs.num_threads,
        *,
        pinned_pool_bytes: int | None = None,
    ) -> None:
        self._threads = threads
        self._default = default
        self._pinned_pool_bytes = pinned_pool_bytes
        self._pool: Any = None
        self._staging: DeviceStaging | None = None

    def pool(self) -> Any:
        if self._pool is None:
            apply_native_settings()
            self._pool = _new_pool(self._threads or self._default())
        return self._pool

    def staging(self, block_bytes: int | None = None) -> DeviceStaging:
        """The GPU staging (made on first use with ``block_bytes`` blocks, default 16 MiB)."""
        if self._staging is None:
            from pyckpt._staging import DeviceStaging

            self._staging = DeviceStaging(
                block_bytes=block_bytes, pool_bytes=self._pinned_pool_bytes
            )
        return self._staging

    def made_staging(self) -> DeviceStaging | None:
        """The GPU staging if it was made (and not closed since), else None."""
        return self._staging

    def close(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.close()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = state["_staging"] = None
        return state
