"""Process-wide staging memory: page-locked host memory owned once per process (private).

Every :class:`pyckpt.Writer` and :class:`pyckpt.Reader` (through its
:class:`~pyckpt._staging.DeviceStaging`) takes its pinned memory from the one
:class:`PinnedMemory` of the process (:func:`pinned_memory`), so a new Writer per checkpoint --
``dcp.async_save(state, storage_writer=pyckpt.Writer(f"ckpt/step-{step}"))`` -- reuses what the
previous checkpoints allocated:

* **extents** for asynchronous saves (``AsyncStager.stage``): page-locked blocks, each allocated
  once and sized to what a save needed beyond the extents that were free. A staged state dict
  leases the free extents it needs and packs its tensors into them (a tensor never spans two
  extents); the lease ends when the save's data is written, or when nothing views it any more.
  A larger state later adds an extent for the difference only.
* **streaming pools** of fixed-size blocks (synchronous saves and loads), one per
  ``(runtime, block size, bound)``, and one **stager** (its side stream and events) per pool and
  device.

Nothing is unregistered or freed on the training path. ``cudaHostRegister``,
``cudaHostUnregister`` and ``cudaFreeHost`` are device-synchronising calls, and with memory owned
by each Writer they ran whenever an old Writer was collected -- often while training steps ran
next to a save in flight. Here memory is allocated only on the thread that stages (``stage()``,
:func:`reserve_pinned`), returned to the free list without any CUDA call, and released only by
:func:`release_pinned` (idle memory only) or at interpreter exit.

A bound caps the total (``PYCKPT_PINNED_LIMIT`` or :func:`set_pinned_limit`; default 40% of host
memory divided by the ranks on this node). A state that does not fit is staged partly into
ordinary pageable memory: a :class:`pyckpt.errors.PinnedMemoryWarning` says how much, and
``stage()`` then blocks for that part's copy. :func:`reserve_pinned` allocates ahead, so even the
first save finds its memory ready.

Without a usable CUDA runtime the same extents are plain 4 KiB-aligned host memory: reusing them
still spares each save the first touch of fresh pages.

Thread-safety: every method may be called from any thread; allocation and lease selection happen
under one lock.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyckpt import _C, _knobs
from pyckpt.errors import PinnedMemoryWarning

__all__ = [
    "PinnedMemory",
    "StageLease",
    "pinned_memory",
    "pinned_stats",
    "release_pinned",
    "reserve_pinned",
    "set_pinned_limit",
]

logger = logging.getLogger(__name__)

_runtimes_lock = threading.Lock()
_runtimes: dict[str | None, Any] = {}


def runtime() -> Any | None:
    """The run-time loaded CUDA runtime used for staging (cached per path).

    Returns:
        ``None`` when ``PYCKPT_CUDA=off``; otherwise a ``_C.CudaRuntime`` whose ``available`` is
        False (with ``error`` saying why) when no usable runtime or device was found.
    """
    if _knobs.cuda_mode() == "off":
        return None
    path = _knobs.cudart_path()
    with _runtimes_lock:
        rt = _runtimes.get(path)
        if rt is None:
            rt = _C.CudaRuntime.load(path)
            _runtimes[path] = rt
            if not rt.available:
                logger.debug("pyckpt: CUDA staging unavailable: %s", rt.error)
    return rt


PIECE_ALIGN = 256  # tensors start on 256-byte boundaries in an extent (every dtype divides it)
EXTENT_ROUND = 2 << 20  # extents are sized in 2 MiB steps


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _size(n: int) -> str:
    """``1.50 GiB`` / ``3.0 MiB`` / ``512 bytes``."""
    if n >= 1 << 30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 1 << 20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n} bytes"


@dataclass
class _Extent:
    """One allocated block: a ``_C.PinnedPool`` holding exactly one block of ``nbytes``."""

    pool: Any
    nbytes: int
    pinned: bool
    rt: Any  # kept so the runtime (and its id) stays alive as long as the extent


@dataclass
class StageLease:
    """Extents leased for one staged state dict and where each item lies in them.

    ``places[i]`` is ``(block index, offset)`` for item ``i``, ``(-1, 0)`` for an empty item, or
    ``None`` when the item did not fit in the bound (the caller stages it in pageable memory).
    """

    blocks: list[Any]
    places: list[tuple[int, int] | None]
    overflow_bytes: int = 0
    pinned: bool = False

    def release(self) -> None:
        """Returns every extent to the free list (no CUDA call)."""
        for b in self.blocks:
            if not b.released:
                b.release()


@dataclass
class _Counters:
    allocations: int = 0  # extents allocated (page-locked when pinned) so far
    allocated_bytes: int = 0
    frees: int = 0  # extents freed by release()
    freed_bytes: int = 0
    leases: int = 0
    overflow_leases: int = 0
    overflow_bytes: int = 0


class PinnedMemory:
    """The staging memory of the process. Use :func:`pinned_memory` to get it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._extents: list[_Extent] = []
        self._stream_pools: dict[tuple[int, int, int], tuple[Any, Any]] = {}  # key -> (pool, rt)
        self._stagers: dict[tuple[int, int], Any] = {}  # (id(pool), device) -> Stager
        self._limit: int | None = None  # set_limit(); None: the knob
        self._counters = _Counters()
        self._atexit = False

    # -- the bound ---------------------------------------------------------------------------

    def limit(self) -> int:
        """The bound on staging memory, in bytes."""
        with self._lock:
            if self._limit is not None:
                return self._limit
        return _knobs.pinned_limit()

    def set_limit(self, limit: int | float | None) -> None:
        """Sets the bound: bytes (an int), a fraction of host memory (a float in (0, 1]), or
        ``None`` for ``PYCKPT_PINNED_LIMIT``'s value. Memory already allocated stays (release it
        with :meth:`release`)."""
        value = None if limit is None else _knobs.parse_pinned_limit(limit, "pinned limit")
        with self._lock:
            self._limit = value

    def _allocated_locked(self) -> int:
        total = sum(e.nbytes for e in self._extents)
        for pool, _ in self._stream_pools.values():
            s = pool.stats()
            total += s["allocated"] * s["block_bytes"]
        return total

    def _at_exit_locked(self) -> None:
        if not self._atexit:
            self._atexit = True
            atexit.register(self.release)

    # -- extents (asynchronous saves) ----------------------------------------------------------

    def _new_extent_locked(self, rt: Any, nbytes: int) -> tuple[_Extent, Any]:
        nbytes = _align(max(nbytes, 1), EXTENT_ROUND)
        pool = _C.PinnedPool(rt, nbytes, 1)
        block = pool.acquire()  # allocates (and page-locks) here, on the caller's thread
        ext = _Extent(pool, nbytes, rt is not None, rt)
        self._extents.append(ext)
        self._counters.allocations += 1
        self._counters.allocated_bytes += nbytes
        self._at_exit_locked()
        return ext, block

    def lease(self, rt: Any, sizes: Sequence[int], *, what: str = "a state dict") -> StageLease:
        """Leases extents for items of ``sizes`` bytes and places every item in one of them.

        Free extents are used first (largest first, items largest first); what does not fit goes
        to one new extent when the bound allows it, else to an extent filling the rest of the
        bound, and what still does not fit is left unplaced (``None``) with a
        :class:`~pyckpt.errors.PinnedMemoryWarning`.

        Args:
            rt: an available ``_C.CudaRuntime`` (page-locked extents), or ``None`` (plain ones).
            sizes: bytes of each item.
            what: names the state in the warning.

        Raises:
            CudaError: page-locking a new extent failed (nothing is leased).
        """
        order = sorted((i for i, n in enumerate(sizes) if n > 0), key=lambda i: -sizes[i])
        places: list[tuple[int, int] | None] = [
            None if n > 0 else (-1, 0) for n in sizes
        ]
        with self._lock:
            free: list[tuple[_Extent, Any]] = []
            for ext in self._extents:
                if ext.rt is rt:
                    blk = ext.pool.try_acquire()
                    if blk is not None:
                        free.append((ext, blk))
            free.sort(key=lambda eb: -eb[0].nbytes)
            blocks = [blk for _, blk in free]
            used = [0] * len(blocks)
            left = self._pack(order, sizes, blocks, used, places, 0)
            try:
                if left:
                    need = sum(_align(sizes[i], PIECE_ALIGN) for i in left)
                    room = self.limit() - self._allocated_locked()
                    size = _align(need, EXTENT_ROUND)
                    if size > room:  # the rest of the bound, in whole steps
                        size = max(0, room) // EXTENT_ROUND * EXTENT_ROUND
                    if size > 0 and min(sizes[i] for i in left) <= size:
                        _, blk = self._new_extent_locked(rt, size)
                        blocks.append(blk)
                        used.append(0)
                        left = self._pack(left, sizes, blocks, used, places, len(blocks) - 1)
            except BaseException:
                for b in blocks:
                    b.release()
                raise
            # Extents this lease does not need go straight back.
            keep = [k for k in range(len(blocks)) if used[k] > 0]
            for k in range(len(blocks)):
                if used[k] == 0:
                    blocks[k].release()
            remap = {k: j for j, k in enumerate(keep)}
            for i, p in enumerate(places):
                if p is not None and p[0] >= 0:
                    places[i] = (remap[p[0]], p[1])
            overflow = sum(sizes[i] for i in left)
            self._counters.leases += 1
            if overflow:
                self._counters.overflow_leases += 1
                self._counters.overflow_bytes += overflow
            limit, allocated = self.limit(), self._allocated_locked()
        lease = StageLease([blocks[k] for k in keep], places, overflow, rt is not None)
        if overflow and rt is None:
            # Plain host memory: a fresh allocation costs the same as an extent's first use.
            logger.debug("pyckpt: %s staged partly (%d bytes) outside the bound", what, overflow)
        elif overflow:
            total = sum(sizes)
            warnings.warn(
                f"pyckpt: {what} ({_size(total)}) does not fit in the pinned staging memory "
                f"under its bound ({_size(limit)}; {_size(allocated)} allocated, part of it "
                f"held by saves still in flight): {_size(overflow)} of it is copied into "
                f"pageable memory and this save blocks until that copy completed. Raise the "
                f"bound (PYCKPT_PINNED_LIMIT or pyckpt.set_pinned_limit) or reserve memory ahead "
                f"(pyckpt.reserve_pinned).",
                PinnedMemoryWarning,
                stacklevel=3,
            )
        return lease

    @staticmethod
    def _pack(
        order: list[int],
        sizes: Sequence[int],
        blocks: list[Any],
        used: list[int],
        places: list[tuple[int, int] | None],
        first: int,
    ) -> list[int]:
        """First fit of items ``order`` into ``blocks[first:]``; returns the items left over."""
        left = []
        for i in order:
            n = sizes[i]
            for k in range(first, len(blocks)):
                off = _align(used[k], PIECE_ALIGN)
                if off + n <= blocks[k].nbytes:
                    places[i] = (k, off)
                    used[k] = off + n
                    break
            else:
                left.append(i)
        return left

    def reserve(self, rt: Any, sizes: Sequence[int], copies: int = 1) -> int:
        """Makes sure ``copies`` states of items ``sizes`` could be leased at once without
        allocating; returns the bytes allocated by this call."""
        with self._lock:
            before = self._counters.allocated_bytes
            leases: list[StageLease] = []
            try:
                for _ in range(copies):
                    leases.append(self.lease(rt, sizes, what="the reserved state"))
            finally:
                for lease in leases:
                    lease.release()
            return self._counters.allocated_bytes - before

    # -- streaming pools and stagers -----------------------------------------------------------

    def stream_pool(self, rt: Any, block_bytes: int, max_blocks: int) -> Any:
        """The shared streaming pool for ``(rt, block_bytes, max_blocks)`` (made once)."""
        key = (id(rt), block_bytes, max_blocks)
        with self._lock:
            entry = self._stream_pools.get(key)
            if entry is None:
                entry = (_C.PinnedPool(rt, block_bytes, max_blocks), rt)
                self._stream_pools[key] = entry
                self._at_exit_locked()
            return entry[0]

    def stager(self, rt: Any, pool: Any, device: int) -> Any:
        """The shared stager (side stream) of ``device`` that streams through ``pool``."""
        key = (id(pool), device)
        with self._lock:
            st = self._stagers.get(key)
            if st is None:
                st = _C.Stager(rt, pool, device)
                self._stagers[key] = st
            return st

    # -- inspection and release ----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters: bound, extents (count, bytes, leased), stream pool bytes, allocations, frees,
        overflow."""
        with self._lock:
            in_use = [e for e in self._extents if e.pool.stats()["in_use"] > 0]
            stream = sum(
                p.stats()["allocated"] * p.stats()["block_bytes"]
                for p, _ in self._stream_pools.values()
            )
            c = self._counters
            return {
                "limit": self.limit(),
                "allocated_bytes": self._allocated_locked(),
                "extents": len(self._extents),
                "extent_bytes": sum(e.nbytes for e in self._extents),
                "pinned_extent_bytes": sum(e.nbytes for e in self._extents if e.pinned),
                "extents_in_use": len(in_use),
                "stream_pool_bytes": stream,
                "stream_pools": len(self._stream_pools),
                "stagers": len(self._stagers),
                "allocations": c.allocations,
                "total_allocated_bytes": c.allocated_bytes,
                "frees": c.frees,
                "freed_bytes": c.freed_bytes,
                "leases": c.leases,
                "overflow_leases": c.overflow_leases,
                "overflow_bytes": c.overflow_bytes,
            }

    def release(self) -> int:
        """Frees every idle extent and streaming pool (unregistering it), and the stagers of the
        pools freed; memory leased by a save in flight stays. Returns the bytes released.

        Call it outside training steps: unregistering page-locked memory synchronises the device.
        A tensor that still views a freed extent keeps that memory alive until it dies, and a
        Writer or Reader that streamed through a freed pool keeps it (and its stager) until it
        is dropped: call it once they are closed.
        """
        released = 0
        drop: list[Any] = []
        with self._lock:
            keep_ext = []
            for ext in self._extents:
                blk = ext.pool.try_acquire()
                if blk is None:
                    keep_ext.append(ext)
                    continue
                blk.release()
                drop.append(ext.pool)
                released += ext.nbytes
                self._counters.frees += 1
                self._counters.freed_bytes += ext.nbytes
            self._extents = keep_ext
            for key, (pool, _rt) in list(self._stream_pools.items()):
                if pool.stats()["allocated"] == 0:
                    continue  # nothing to free; its stager (used by async saves) stays
                stagers = [k for k in self._stagers if k[0] == id(pool)]
                for skey in stagers:
                    try:
                        # Its side stream only, never the device; recycles finished uploads.
                        self._stagers[skey].synchronize()
                    except Exception as e:  # a failed copy was reported to its caller already
                        logger.debug("pyckpt: staging stream failed before release: %s", e)
                s = pool.stats()
                if s["in_use"] > 0:
                    continue
                del self._stream_pools[key]
                for skey in stagers:
                    drop.append(self._stagers.pop(skey))
                drop.append(pool)
                released += s["allocated"] * s["block_bytes"]
        drop.clear()  # the last references: memory is unregistered and freed here
        return released


_instance: PinnedMemory | None = None
_instance_lock = threading.Lock()


def pinned_memory() -> PinnedMemory:
    """The process's :class:`PinnedMemory` (made on first use)."""
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = PinnedMemory()
        return _instance


def _forget_in_child() -> None:
    # A forked child must not touch its parent's page-locked memory or streams (CUDA does not
    # survive fork); it starts with none and leaves the parent's objects alone.
    global _instance
    _instance = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _forget_for_tests() -> None:
    """Drops the process's staging memory without waiting for leases (tests only)."""
    global _instance
    with _instance_lock:
        old, _instance = _instance, None
    if old is not None:
        old.release()


# -- public entry points (re-exported by pyckpt) -----------------------------------------------


def _item_sizes(state_or_bytes: Any) -> list[int]:
    if isinstance(state_or_bytes, bool):
        raise TypeError("reserve_pinned: expected a state dict or a number of bytes, got a bool")
    if isinstance(state_or_bytes, int):
        if state_or_bytes < 0:
            raise ValueError(f"reserve_pinned: bytes must be >= 0, got {state_or_bytes}")
        return [state_or_bytes]
    import torch
    from torch.utils._pytree import tree_flatten

    from pyckpt._tensors import local_view

    leaves, _ = tree_flatten(state_or_bytes)
    return [
        local_view(t).numel() * local_view(t).element_size()
        for t in leaves
        if isinstance(t, torch.Tensor)
    ]


def reserve_pinned(
    state_or_bytes: Any, *, copies: int = 1, limit: int | float | None = None
) -> int:
    """Allocates staging memory ahead, so that even the first ``async_save`` finds it ready.

    Page-locking memory is slow (BENCHMARKS.md, "GPU staging") and synchronises the device;
    call this once before training, with the state dict you will save (the same nested dict you
    pass to ``dcp.async_save``) or a number of bytes.

    Args:
        state_or_bytes: a state dict (its tensors' sizes are used; device tensors' bytes are
            not read) or a number of bytes.
        copies: how many saves may be in flight at once (2 when a save may start before the
            previous one finished writing).
        limit: also set the process's bound first (as :func:`set_pinned_limit`).

    Returns:
        Bytes newly allocated (0 when enough memory was already there).

    Warns:
        PinnedMemoryWarning: the state does not fit in the bound; part of each save will be
            copied into pageable memory.

    Raises:
        CudaError: page-locking failed.
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"reserve_pinned: copies must be an int >= 1, got {copies!r}")
    mem = pinned_memory()
    if limit is not None:
        mem.set_limit(limit)
    sizes = _item_sizes(state_or_bytes)
    rt = runtime()
    return mem.reserve(rt if rt is not None and rt.available else None, sizes, copies)


def release_pinned() -> int:
    """Frees the process's idle staging memory (memory of a save in flight stays).

    Unregistering page-locked memory synchronises the device: call it between training phases,
    never while steps run. Memory is also released at interpreter exit.

    Returns:
        Bytes released.
    """
    return pinned_memory().release()


def set_pinned_limit(limit: int | float | None) -> None:
    """Sets the bound on the process's staging memory.

    Args:
        limit: bytes (an int >= 1 MiB), a fraction of host memory (a float in (0, 1]), or
            ``None`` to go back to ``PYCKPT_PINNED_LIMIT`` (default: 40% of host memory divided
            by ``LOCAL_WORLD_SIZE``).

    Raises:
        ValueError: the value is out of range.
    """
    pinned_memory().set_limit(limit)


def pinned_stats() -> dict[str, Any]:
    """Counters of the process's staging memory (bound, bytes allocated, extents in use, ...)."""
    return pinned_memory().stats()
