"""Every ``PYCKPT_*`` environment variable is read here, and only here.

Each knob has a getter that reads the environment at call time (so a value set before a save
applies to it) and an ``override`` context manager for tests::

    with _knobs.override(direct_io="off", num_threads=1):
        ...
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = [
    "MIN_PINNED_POOL_BYTES",
    "num_threads",
    "read_threads",
    "direct_io",
    "chunk_bytes",
    "fsync",
    "zstd_level",
    "cuda_mode",
    "cudart_path",
    "pinned_pool_bytes",
    "consolidate_input",
    "cooperative",
    "coop_window_bytes",
    "override",
]

_overrides: dict[str, Any] = {}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _get(name: str, env: str) -> str | None:
    if name in _overrides:
        value = _overrides[name]
        return None if value is None else str(value)
    return os.environ.get(env)


def _int(name: str, env: str, default: int, minimum: int) -> int:
    raw = _get(name, env)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{env}={raw!r} must be >= {minimum}")
    return value


def _choice(name: str, env: str, default: str, choices: tuple[str, ...]) -> str:
    raw = _get(name, env)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ValueError(f"{env}={raw!r} must be one of {', '.join(choices)}")
    return value


def num_threads() -> int:
    """``PYCKPT_NUM_THREADS``: worker threads per writer/reader (default ``min(8, cpus)``)."""
    return _int("num_threads", "PYCKPT_NUM_THREADS", max(1, min(8, os.cpu_count() or 1)), 1)


def read_threads() -> int:
    """``PYCKPT_READ_THREADS``: reader threads (default ``max(8, PYCKPT_NUM_THREADS)``).

    Reads wait on the device more than they compute: more reads in flight raised cold-load
    throughput on the 2-core VM measured here (see BENCHMARKS.md), while decoding still uses
    every core.
    """
    return _int("read_threads", "PYCKPT_READ_THREADS", max(8, num_threads()), 1)


def direct_io() -> str:
    """``PYCKPT_DIRECT_IO``: ``auto`` (default; fall back when refused), ``on`` or ``off``."""
    return _choice("direct_io", "PYCKPT_DIRECT_IO", "auto", ("auto", "on", "off"))


def chunk_bytes(default: int = 4 << 20) -> int:
    """``PYCKPT_CHUNK_BYTES``: raw bytes per independently decodable chunk (default 4 MiB; the
    caller's ``default`` where it differs, as for object stores)."""
    value = _int("chunk_bytes", "PYCKPT_CHUNK_BYTES", default, 4096)
    if value % 4096:
        raise ValueError(f"PYCKPT_CHUNK_BYTES={value} must be a multiple of 4096")
    from pyckpt._C import MAX_CHUNK_BYTES  # the format's bound on a chunk (native core's limit)

    if value > MAX_CHUNK_BYTES:
        raise ValueError(f"PYCKPT_CHUNK_BYTES={value} exceeds the format's {MAX_CHUNK_BYTES}")
    return value


def _bool(name: str, env: str, default: bool) -> bool:
    raw = _get(name, env)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{env}={raw!r} must be 0 or 1")


def fsync() -> bool:
    """``PYCKPT_FSYNC``: fsync data files and metadata (default on)."""
    return _bool("fsync", "PYCKPT_FSYNC", True)


def cooperative() -> bool:
    """``PYCKPT_COOPERATIVE``: default of ``Reader(cooperative=...)``: stored bytes several
    ranks load are read from storage by one of them and shared over the group (default on)."""
    return _bool("cooperative", "PYCKPT_COOPERATIVE", True)


def coop_window_bytes() -> int:
    """``PYCKPT_COOP_WINDOW_BYTES``: stored bytes a rank of a cooperative load asks the others
    for per exchange round (default 64 MiB; at least one chunk travels per round)."""
    return _int("coop_window_bytes", "PYCKPT_COOP_WINDOW_BYTES", 64 << 20, 1)


def zstd_level() -> int:
    """``PYCKPT_ZSTD_LEVEL``: zstd level for ``compression="zstd"`` (default 1)."""
    return _int("zstd_level", "PYCKPT_ZSTD_LEVEL", 1, -7)


def cuda_mode() -> str:
    """``PYCKPT_CUDA``: ``auto`` (default: use the CUDA runtime when present) or ``off``."""
    return _choice("cuda_mode", "PYCKPT_CUDA", "auto", ("auto", "off"))


def cudart_path() -> str | None:
    """``PYCKPT_CUDART``: explicit CUDA runtime library to load (tests point it at a double)."""
    raw = _get("cudart_path", "PYCKPT_CUDART")
    return raw or None


MIN_PINNED_POOL_BYTES = 1 << 20


def pinned_pool_bytes() -> int:
    """``PYCKPT_PINNED_POOL_BYTES``: default of the ``pinned_pool_bytes`` argument of
    :class:`pyckpt.Writer` and :class:`pyckpt.Reader`, the bound on the pinned staging pool
    (default 1 GiB)."""
    return _int("pinned_pool_bytes", "PYCKPT_PINNED_POOL_BYTES", 1 << 30, MIN_PINNED_POOL_BYTES)


def consolidate_input() -> str:
    """``PYCKPT_CONSOLIDATE_INPUT``: how consolidation reads shards, ``pread`` (default) or ``mmap``."""
    return _choice("consolidate_input", "PYCKPT_CONSOLIDATE_INPUT", "pread", ("pread", "mmap"))


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily overrides knobs by getter name (``None`` means "unset")."""
    unknown = set(values) - set(__all__)
    if unknown:
        raise TypeError(f"unknown knob(s): {sorted(unknown)}")
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
