"""Pausing Python's cyclic garbage collector around large, acyclic allocations.

Planning and metadata work at scale (a coordinator's global plan over N ranks' plans of T
items each, a metadata document of N x T pieces) allocates millions of small objects (tuples,
dicts, dataclasses) that all stay alive until the step returns. Each allocation burst triggers
generational collections that walk every live object and free nothing: at 512 ranks x 200
tensors they were more than half of ``SavePlanner.create_global_plan`` and of
``Reader.read_metadata`` (benchmarks/bench_scale.py). Reference counting still frees everything
that is dropped while paused; the collector runs again from the point it is resumed.

The same holds per tensor: a save, load or export of a model with thousands of tensors builds a
handful of objects per tensor and chunk (write and read items, parsed metadata, stitcher items),
and the collections they trigger walk every live object of the process, the training job's
included. With 4,000 tensors of 16 KiB in one process (``benchmarks/many_tensors.py``) they
were more than half of ``pyckpt.save``, ``pyckpt.load`` and ``pyckpt.consolidate``
(BENCHMARKS.md, "Many tensors").
So :func:`pyckpt.save`, :func:`pyckpt.load` and :func:`pyckpt.consolidate` pause the collector
for the whole call (what they build dies with the call, before any collection walks it); the
storage hooks DCP calls (local plans, ``write_data``, ``read_data``, metadata) and every read of
``pyckpt.json`` pause it around their own work (``write_data`` around its per-item loops only,
not the write: under ``dcp.async_save`` that runs for seconds beside training; ``read_data``
around its reads too, which block the caller of a load anyway). The pause is process-wide:
cyclic garbage of other threads waits for its end. ``tests/test_gc_pause.py`` counts the
collections.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused"]


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Disables the cyclic garbage collector for the block (process-wide), then restores it.

    Nested or concurrent uses are safe: the collector is re-enabled by the use that disabled it,
    and a collection that runs late only costs time.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
