"""GPU <-> host staging through page-locked pool blocks (private; used by the DCP writer/reader).

The copies are done by the C++ stager (``_C.Stager``) on a side stream per device, ordered after
the caller's current stream by an event (never a device-wide sync). The CUDA runtime is loaded at
run time (:func:`runtime`): the one torch already loaded, or ``PYCKPT_CUDART`` (tests point it at
a test double, ``pyckpt/_testing/libpyckpt_fake_cudart.so``). ``PYCKPT_CUDA=off`` disables it.

Three uses:

* :meth:`DeviceStaging.stream_to_host` -- synchronous save: device tensors are cut into pool
  blocks; the caller consumes batch k (encode + write) while batch k+1 is still being copied.
  Pinned memory is bounded by the owner's ``pinned_pool_bytes`` (default
  ``PYCKPT_PINNED_POOL_BYTES``).
* :meth:`DeviceStaging.stage_state_dict` -- asynchronous save (``AsyncStager.stage``): the whole
  state dict is copied into reused pinned extents and returned as CPU tensors that view them.
* :meth:`DeviceStaging.upload` -- loads: host bytes go to device tensors through pinned blocks,
  copies overlapping with the filling of the next block.

A :class:`pyckpt.Writer` or :class:`pyckpt.Reader` owns one :class:`DeviceStaging` (made on first
use, dropped by ``close()`` and by pickling); the writer's DCP ``AsyncStager`` methods delegate to
:meth:`DeviceStaging.stage_state_dict`. The memory and the stagers themselves belong to the
process (:mod:`pyckpt._pinned`): a new Writer per checkpoint reuses what earlier ones allocated,
and neither dropping nor closing an owner frees or unregisters anything.

Thread-safety: one :class:`DeviceStaging` serves one save or load at a time (the writer's
background thread and the next ``stage()`` call may overlap: the next stage leases other
extents).
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pyckpt import _C, _knobs, _pinned
from pyckpt._pinned import runtime
from pyckpt._tensors import local_view, plain, storable
from pyckpt.errors import CudaError

__all__ = [
    "DeviceStaging",
    "StagedPiece",
    "block_bytes_for",
    "is_device_tensor",
    "runtime",
]

logger = logging.getLogger(__name__)

_PIECE_ALIGN = 256  # matches D2HStream::kPieceAlign; every dtype's alignment divides it
_DEFAULT_BLOCK = 16 << 20

_unpinned_logged = False  # "staging into unpinned memory" is logged once per process


def block_bytes_for(chunk_bytes: int) -> int:
    """Staging block size: a multiple of the codec chunk so split tensors align with chunks."""
    return max(chunk_bytes, (_DEFAULT_BLOCK // chunk_bytes) * chunk_bytes)


class _TorchCuda:
    """How tensors map to devices and streams. Tests substitute a double (CPU tensors standing
    in for device memory, streams of the test runtime) through :data:`_device_api`."""

    def is_device(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def device_index(self, t: torch.Tensor) -> int:
        return t.device.index if t.device.index is not None else torch.cuda.current_device()

    def current_stream(self, device: int) -> int:
        return int(torch.cuda.current_stream(device).cuda_stream)


_device_api: Any = _TorchCuda()


def is_device_tensor(t: object) -> bool:
    """True when ``t`` is a tensor in device memory (a DTensor by its shard). The stager copies
    it when :attr:`DeviceStaging.available`; otherwise torch moves it."""
    return isinstance(t, torch.Tensor) and _device_api.is_device(local_view(t))


def _fqn(path: Sequence[Any]) -> str:
    """The dotted name DCP gives the leaf at pytree ``path`` (``model.layers.0.w``)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class StagedPiece:
    """A contiguous byte range of a staged item, readable at ``address`` until the batch ends.

    SAFETY: ``address`` is valid only until the iterator of :meth:`DeviceStaging.stream_to_host`
    is advanced again (the block then goes back to the pool).
    """

    item: int  # index into the list given to stream_to_host
    offset: int  # first byte of the item this piece holds
    address: int
    nbytes: int


class DeviceStaging:
    """Stagers (one per device) and the pinned memory they use, owned by a writer or reader.

    Args:
        block_bytes: streaming block size (default 16 MiB; use :func:`block_bytes_for`).
        pool_bytes: bound on streaming pinned memory (default ``PYCKPT_PINNED_POOL_BYTES``, read
            when this object is made).
        rt: runtime to use (default :func:`runtime`).
    """

    def __init__(
        self,
        *,
        block_bytes: int | None = None,
        pool_bytes: int | None = None,
        rt: Any | None = None,
    ) -> None:
        self._rt = rt if rt is not None else runtime()
        self.block_bytes = _align(block_bytes or _DEFAULT_BLOCK, 4096)
        bound = pool_bytes if pool_bytes is not None else _knobs.pinned_pool_bytes()
        self.max_blocks = max(2, bound // self.block_bytes)
        self._lock = threading.Lock()
        self._pool: Any = None
        self._stagers: dict[int, Any] = {}
        # Extents handed out by stage_state_dict and not yet released, by address, and the
        # addresses of the extents staged by the same call.
        self._regions: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._groups: dict[int, tuple[int, ...]] = {}

    # -- resources ---------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """True when a usable CUDA runtime was loaded (device tensors can be staged)."""
        return self._rt is not None and bool(self._rt.available)

    def has_regions(self) -> bool:
        """True while a region handed out by :meth:`stage_state_dict` is not released."""
        return bool(self._regions)

    def _require(self, what: str) -> None:
        if self._rt is None:
            raise CudaError(f"{what}: CUDA staging is disabled (PYCKPT_CUDA=off)")
        if not self._rt.available:
            raise CudaError(f"{what}: CUDA runtime not available ({self._rt.error})")

    def pool(self) -> Any:
        """The bounded streaming pool (shared by every owner with the same runtime, block size
        and bound; made on first use and kept by the process, see :mod:`pyckpt._pinned`)."""
        with self._lock:
            if self._pool is None:
                rt = self._rt if self.available else None
                self._pool = _pinned.pinned_memory().stream_pool(
                    rt, self.block_bytes, self.max_blocks
                )
            return self._pool

    def stager(self, device: int) -> Any:
        """The stager of ``device`` (its side stream is created once per process and pool)."""
        pool = self.pool()
        self._require("staging on a device")
        assert self._rt is not None  # _require() refuses a missing runtime
        with self._lock:
            st = self._stagers.get(device)
            if st is None:
                st = _pinned.pinned_memory().stager(self._rt, pool, device)
                self._stagers[device] = st
            return st

    def stats(self) -> dict[str, Any]:
        """Pool, staging-memory and stager counters (for tests and benchmarks)."""
        with self._lock:
            out: dict[str, Any] = {
                "pool": self._pool.stats() if self._pool is not None else None,
                "region_pool": _pinned.pinned_stats(),
                "regions_outstanding": len(self._regions),
            }
            out["stagers"] = {d: s.stats() for d, s in self._stagers.items()}
        return out

    def close(self) -> None:
        """Forgets this owner's handles on the shared pools and stagers. No memory is freed and no
        stream waited for: both belong to the process (:func:`pyckpt.release_pinned` frees idle
        memory); pending uploads are ordered on the caller's stream already."""
        with self._lock:
            self._stagers = {}
            self._pool = None

    # -- synchronous save: stream blocks ------------------------------------------------

    def stream_to_host(
        self, items: Sequence[tuple[str, torch.Tensor]], *, batch_blocks: int | None = None
    ) -> Iterator[list[StagedPiece]]:
        """Copies device tensors to pinned blocks and yields them batch by batch.

        Each yielded batch's copies are complete; the next batch's copies are already queued and
        run while the caller consumes this one. Blocks of a batch return to the pool when the
        iterator is advanced (or closed), so at most ``max_blocks`` blocks are ever leased.

        Args:
            items: ``(name, tensor)``; every tensor on a device (DTensors give their shard).
                The tensors must not be modified by work queued after this call until the
                iterator is exhausted.
            batch_blocks: blocks per batch (default half the pool, for double buffering).

        Yields:
            Lists of :class:`StagedPiece` in item order (an item larger than a block comes in
            several pieces; an empty item as one empty piece).

        Raises:
            CudaError: the runtime failed; the message names the tensor. No block is returned
                to the pool while a copy into it may still run.
        """
        self._require("staging tensors to host")
        per_batch = batch_blocks or max(1, self.max_blocks // 2)
        if not 1 <= per_batch <= self.max_blocks:
            raise ValueError(f"batch_blocks must be in [1, {self.max_blocks}], got {per_batch}")
        # Group by device, keeping the caller's order within a device.
        by_device: dict[int, list[int]] = {}
        for i, (_, t) in enumerate(items):
            by_device.setdefault(_device_api.device_index(t), []).append(i)
        for device, indices in by_device.items():
            keep = [plain(items[i][1]) for i in indices]  # alive until consumed
            specs = [_C.StageItem(items[i][0], k.data_ptr(), _nbytes(k))
                     for i, k in zip(indices, keep)]
            st = self.stager(device)
            stream = st.stream_to_host(specs, _device_api.current_stream(device))
            inflight: deque[Any] = deque()

            def top_up(s: Any = stream, q: deque[Any] = inflight) -> None:
                while not s.done and len(q) < self.max_blocks:
                    q.append(s.next())

            try:
                top_up()
                while inflight:
                    batch = [inflight.popleft() for _ in range(min(per_batch, len(inflight)))]
                    for b in batch:
                        b.wait()
                    pieces = [
                        StagedPiece(indices[p.item], p.item_offset, b.address + p.block_offset,
                                    p.nbytes)
                        for b in batch
                        for p in b.pieces
                    ]
                    yield pieces
                    for b in batch:
                        b.release()
                    top_up()
            finally:
                # On error or early close: every leased block waits for its copies, then goes back.
                for b in inflight:
                    b.release()
                del keep

    # -- asynchronous save: one region per staged state dict -----------------------------

    def _lease(self, sizes: list[int]) -> _pinned.StageLease:
        global _unpinned_logged
        if not self.available and not _unpinned_logged:
            # Without a usable runtime (none installed, or one without a driver or device)
            # nothing can be page-locked and nothing needs to be: plain aligned host memory.
            _unpinned_logged = True
            logger.debug(
                "pyckpt: staging into unpinned host memory (%s)",
                "PYCKPT_CUDA=off" if self._rt is None else self._rt.error,
            )
        rt = self._rt if self.available else None
        lease = _pinned.pinned_memory().lease(rt, sizes)
        addresses = tuple(b.address for b in lease.blocks)
        with self._lock:
            for blk in lease.blocks:
                self._regions[blk.address] = blk
                self._groups[blk.address] = addresses
        return lease

    def release_all(self) -> int:
        """Releases every extent this owner staged and did not release yet (:meth:`release_regions`
        of them all): for a driver whose save ended, whatever its outcome."""
        with self._lock:
            addresses = list(self._regions.keys())
        return self.release_regions(addresses)

    def release_regions(self, addresses: Sequence[int]) -> int:
        """Returns to the process's free list every staged extent containing one of
        ``addresses``, with the other extents staged by the same call (no CUDA call).

        Called by the writer once a save's data is written; tensors that still view the extents
        stay valid memory but may be overwritten by a later stage().

        Returns:
            The number of extents released.
        """
        released = 0
        with self._lock:
            hit: set[int] = set()
            for region in list(self._regions.values()):
                lo, hi = region.address, region.address + region.nbytes
                if any(lo <= a < hi for a in addresses):
                    hit.update(self._groups.get(lo, (lo,)))
            blocks = [self._regions.get(a) for a in hit]
            for a in hit:
                self._regions.pop(a, None)
                self._groups.pop(a, None)
            for a in [a for a in self._groups if a not in self._regions]:
                del self._groups[a]  # extents whose views all died (returned by themselves)
        for blk in blocks:
            if blk is not None and not blk.released:
                blk.release()
                released += 1
        return released

    def stage_state_dict(self, state_dict: Any) -> Any:
        """Returns a "training-safe" copy of ``state_dict`` whose tensors view the process's
        staging memory (:mod:`pyckpt._pinned`).

        Device tensors (and DTensor shards) are copied by the stager, ordered after each
        device's current stream; CPU tensors are copied on the host meanwhile (training may
        modify them after this returns); other leaves are deep-copied. Returns when every copy
        is complete. The extents are reused by later calls (of any owner) once
        :meth:`release_regions` freed them, or once nothing views them any more. Tensors that do
        not fit in the bound are copied into pageable memory (with a
        :class:`~pyckpt.errors.PinnedMemoryWarning`); that copy blocks.

        Raises:
            CudaError: a copy failed; the message names the tensor. The extents are released and
                no staged state dict is returned.
            UnsupportedDtypeError: a tensor a save cannot store (sparse, quantized, ...).
        """
        from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

        leaves_with_path, spec = tree_flatten_with_path(state_dict)
        layout: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # leaf, src, local
        for i, (path, leaf) in enumerate(leaves_with_path):
            if isinstance(leaf, torch.Tensor):
                # Refused here, as a save refuses it, before any memory is leased for it (a
                # sparse tensor's dense size may be terabytes).
                storable(leaf, _fqn(path))
                local = local_view(leaf)
                src = plain(local) if _device_api.is_device(local) else local
                layout.append((i, src, local))
        if any(_device_api.is_device(local) for _, _, local in layout):
            self._require("staging a state dict")
        lease = self._lease([_nbytes(src) for _, src, _ in layout])
        by_target: dict[tuple[int, int], list[_C.CopySpec]] = {}
        try:
            for (i, src, local), place in zip(layout, lease.places):
                if place is not None and place[0] >= 0 and _device_api.is_device(local):
                    name = keystr(leaves_with_path[i][0])
                    key = (_device_api.device_index(local), place[0])
                    by_target.setdefault(key, []).append(
                        _C.CopySpec(place[1], src.data_ptr(), _nbytes(src), name)
                    )
            events = [
                self.stager(d).copy_into(lease.blocks[k], specs, _device_api.current_stream(d))
                for (d, k), specs in by_target.items()
            ]
            views: dict[int, torch.Tensor] = {}
            for (i, src, local), place in zip(layout, lease.places):
                if place is None:
                    # Over the bound: pageable memory; a device copy into it is synchronous
                    # (ordered on the current stream by torch).
                    view = torch.empty(local.shape, dtype=local.dtype)
                    view.copy_(src)
                else:
                    block = lease.blocks[place[0]] if place[0] >= 0 else None
                    view = self._view(block, place[1], local)
                    if not _device_api.is_device(local):
                        view.copy_(src)  # host copy overlaps the device copies
                views[i] = view
            for ev in events:
                ev.wait()
        except BaseException:
            # No extent goes back while a device copy into it may still run: the next stage
            # would lease it, and the late copy would overwrite what that stage put there.
            self._drain({d for d, _ in by_target})
            self.release_regions([b.address for b in lease.blocks])
            raise
        out_leaves = []
        for i, (_, leaf) in enumerate(leaves_with_path):
            if i in views:
                out_leaves.append(self._wrap(leaf, views[i]))
            else:
                out_leaves.append(copy.deepcopy(leaf))
        return tree_unflatten(out_leaves, spec)

    def _drain(self, devices: set[int]) -> None:
        """Waits for the side streams of ``devices`` after a failed stage (their failures were
        or will be reported by the stage itself)."""
        for device in devices:
            try:
                self.stager(device).synchronize()
            except Exception as e:
                logger.debug("pyckpt: staging stream of device %d failed: %s", device, e)

    @staticmethod
    def _view(region: Any, offset: int, like: torch.Tensor) -> torch.Tensor:
        n = _nbytes(like)
        if n == 0 or region is None:
            return torch.empty(like.shape, dtype=like.dtype)
        flat = torch.frombuffer(region, dtype=torch.uint8, count=n, offset=offset)
        return flat.view(like.dtype).view(like.shape)

    @staticmethod
    def _wrap(leaf: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        local = getattr(leaf, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            from torch.distributed.tensor import DTensor

            # Same spec (mesh, placements, global shape); only the shard now lives on the host,
            # which DCP's planners handle (they read `to_local()`). from_local would move it back.
            return DTensor(view, leaf._spec, requires_grad=False)  # type: ignore[attr-defined]
        if leaf.requires_grad:
            view.requires_grad_(True)
        return view

    # -- loads: host -> device ------------------------------------------------------------

    def upload(
        self,
        name: str,
        dst: torch.Tensor,
        fill: Callable[[memoryview, int, int], None],
    ) -> None:
        """Fills device tensor ``dst`` through pinned blocks.

        ``fill(block_view, offset, n)`` writes bytes ``[offset, offset + n)`` of ``dst``'s
        row-major contents into ``block_view[:n]``. The copy of one block overlaps the filling
        of the next. Ordered after ``dst``'s device's current stream, and that stream is
        ordered after the copies on return (no host wait), so later kernels see the data.

        Raises:
            CudaError: the runtime failed; the message names ``name``.
        """
        self._require(f"loading {name!r} to the device")
        device = _device_api.device_index(dst)
        target = dst if dst.is_contiguous() and not dst.is_conj() and not dst.is_neg() else None
        temp = None
        if target is None:
            temp = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
            target = temp
        st = self.stager(device)
        stream = _device_api.current_stream(device)
        st.order_after(stream)
        total, base, step = _nbytes(target), target.data_ptr(), self.block_bytes
        for off in range(0, total, step):
            n = min(step, total - off)
            blk = st.acquire_upload_block()
            try:
                fill(memoryview(blk), off, n)
            except BaseException:
                blk.release()
                raise
            st.upload(blk, [_C.CopySpec(0, base + off, n, name)])
        if temp is None:
            st.finish_uploads(stream)  # later work on `stream` sees the data; no host wait
            return
        # A strided destination goes through a contiguous temporary. Waiting for the side stream
        # here (a stream sync, not a device one) keeps `temp` alive past its last write however
        # the caller's stream is modelled; such destinations are rare in DCP loads.
        st.synchronize()
        dst.copy_(temp)

    def upload_from_host(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copies CPU tensor ``src`` (same shape and dtype as ``dst``) into device tensor ``dst``
        through pinned blocks (see :meth:`upload`)."""
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
            raise ValueError(
                f"tensor {name!r}: source {tuple(src.shape)} {src.dtype} does not match "
                f"destination {tuple(dst.shape)} {dst.dtype}"
            )
        flat = plain(src).reshape(-1).view(torch.uint8)

        def fill(view: memoryview, offset: int, n: int) -> None:
            torch.frombuffer(view, dtype=torch.uint8, count=n).copy_(flat[offset : offset + n])

        self.upload(name, dst, fill)

    def synchronize(self) -> None:
        """Waits for every side stream (and recycles upload blocks)."""
        with self._lock:
            stagers = list(self._stagers.values())
        for st in stagers:
            st.synchronize()
