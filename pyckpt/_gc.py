"""Pausing Python's cyclic garbage collector around large, acyclic allocations.

Planning and metadata work at scale (a coordinator's global plan over N ranks' plans of T
items each, a metadata document of N x T pieces) allocates millions of small objects (tuples,
dicts, dataclasses) that all stay alive until the step returns. Each allocation burst triggers
generational collections that walk every live object and free nothing: at 512 ranks x 200
tensors they were more than half of ``SavePlanner.create_global_plan`` and of
``Reader.read_metadata`` (benchmarks/bench_scale.py). Reference counting still frees everything
that is dropped while paused; the collector runs again from the point it is resumed.
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
