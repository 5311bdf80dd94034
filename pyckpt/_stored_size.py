"""Stored-size estimates of tensors, so that :class:`pyckpt.SavePlanner` balances what is written.

With compression, the bytes a rank stores are not its raw bytes: a zero or small-integer tensor
shrinks to almost nothing while random bf16 weights keep most of theirs. Balancing replicated
items by raw bytes then leaves some ranks storing far more than others. The writer tells the
planner how it encodes (an :class:`Encoding`, carried to ``set_up_planner`` in DCP's
``StorageMeta``, see :class:`WriterMeta`); the planner estimates each tensor's stored size from
a small sample encoded with the same native codec (:func:`stored_sizes`), and the coordinator
balances those estimates (:mod:`pyckpt._balance`). Imported through :mod:`pyckpt.planner` and
:mod:`pyckpt.storage`.

The sample is :data:`SAMPLE_BLOCKS` blocks of :data:`SAMPLE_BLOCK_BYTES` at positions fixed by
the tensor's size alone (the first, the last, and evenly spaced ones between), so equal copies
give equal estimates on every rank; tensors up to the sample's size are encoded whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import StorageMeta

from pyckpt import _C, _background, _format, _knobs
from pyckpt._replicas import _flat_bytes, _to_host
from pyckpt._tensors import dtype_name

if TYPE_CHECKING:
    from pyckpt._C import CodecParams

SAMPLE_BLOCK_BYTES = 16 << 10
"""A stored-size sample reads blocks of this many bytes (16 KiB, a multiple of every element
size)."""

SAMPLE_BLOCKS = 4
"""A stored-size sample reads this many blocks of a larger tensor (64 KiB in all)."""

_SAMPLE_BYTES = SAMPLE_BLOCK_BYTES * SAMPLE_BLOCKS


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How a writer encodes tensors (what :func:`pyckpt._format.codec_params_for` takes).

    Attributes:
        compression: ``None`` (raw) or ``"zstd"``.
        level: zstd level.
        byte_grouping: split elements into byte planes before compressing.
        raw_threshold: a plane is stored compressed only below this fraction of its raw size.
    """

    compression: str | None
    level: int
    byte_grouping: bool
    raw_threshold: float

    @property
    def compresses(self) -> bool:
        """Whether stored sizes differ from raw sizes."""
        return self.compression not in (None, _format.CODEC_NONE)

    def params(self, dtype_name: str) -> CodecParams:
        """The codec params of a tensor of ``dtype_name`` (a key of ``DTYPE_SIZES``)."""
        return _format.codec_params_for(
            dtype_name, self.compression, self.level, self.byte_grouping, self.raw_threshold
        )


@dataclasses.dataclass
class WriterMeta(StorageMeta):
    """DCP's ``StorageMeta`` as :meth:`pyckpt.Writer.storage_meta` returns it: DCP hands it to
    the planner's ``set_up_planner``, which is how :class:`pyckpt.SavePlanner` learns the
    writer's :class:`Encoding` (any other planner ignores the extra field)."""

    encoding: Encoding | None = None


def _sample_starts(nbytes: int) -> list[int]:
    """Start offsets of the sampled blocks of a tensor of ``nbytes > _SAMPLE_BYTES`` bytes:
    evenly spaced from the first block to the last whole one, at multiples of 16 bytes (whole
    elements of every dtype)."""
    last = nbytes - SAMPLE_BLOCK_BYTES
    return [last * k // (SAMPLE_BLOCKS - 1) // 16 * 16 for k in range(SAMPLE_BLOCKS)]


def _sample(flat: torch.Tensor) -> torch.Tensor:
    """The bytes a stored-size estimate encodes (on ``flat``'s device)."""
    n = flat.numel()
    if n <= _SAMPLE_BYTES:
        return flat
    return torch.cat([flat[s : s + SAMPLE_BLOCK_BYTES] for s in _sample_starts(n)])


def stored_sizes(
    tensors: Sequence[torch.Tensor], encoding: Encoding, *, threads: int | None = None
) -> list[int]:
    """Estimated bytes each tensor takes once written with ``encoding``.

    Each tensor's sample (at most 64 KiB: the whole tensor up to that size, else
    :data:`SAMPLE_BLOCKS` blocks at positions fixed by its size) is encoded with the tensor's
    codec params, and the stored size scales with the tensor's bytes. Device tensors are sampled
    on the device; only the samples are copied to the host (one transfer per device). Encoding
    runs on ``threads`` threads (the native encoder releases the GIL). Deterministic: equal
    tensors give equal estimates.

    Args:
        tensors: Plain tensors (a DTensor's local tensor) of dtypes the format stores.
        encoding: The writer's encoding.
        threads: Encoding threads (default ``PYCKPT_NUM_THREADS``).

    Returns:
        One estimate per tensor, in order: its raw size without compression, else at least 1
        byte for a non-empty tensor (0 for an empty one).
    """
    flats = [_flat_bytes(t) for t in tensors]
    if not encoding.compresses:
        return [f.numel() for f in flats]
    samples: list[np.ndarray] = [np.empty(0, dtype=np.uint8)] * len(flats)
    on_device: dict[torch.device, list[int]] = {}
    for i, flat in enumerate(flats):
        if flat.device.type == "cpu":
            samples[i] = _sample(flat).numpy()
        else:
            on_device.setdefault(flat.device, []).append(i)
    for slots in on_device.values():
        for i, host in zip(slots, _to_host([_sample(flats[i]) for i in slots])):
            samples[i] = host
    params = [encoding.params(dtype_name(t.dtype)) for t in tensors]

    def estimate(i: int) -> int:
        n, sample = flats[i].numel(), samples[i]
        if n == 0:
            return 0
        record = _C.encode_chunk(cast(Any, sample), params[i]).record
        stored = sum(record[4][1::2])  # the planes' stored lengths
        return max(1, -(-stored * n // sample.size))  # scaled up to the tensor, rounded up

    nthreads = threads if threads is not None else _knobs.num_threads()
    return _background.map_parallel(estimate, range(len(flats)), nthreads)
