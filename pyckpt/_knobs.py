"""Every ``PYCKPT_*`` environment variable is read here, and only here.

Each knob has a getter that reads the environment at call time (so a value set before a save
applies to it) and an ``override`` context manager for tests::

    with _knobs.override(direct_io="off", num_threads=1):
        ...
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

__all__ = [
    "MIN_PINNED_POOL_BYTES",
    "num_threads",
    "shared_threads",
    "read_threads",
    "direct_io",
    "chunk_bytes",
    "fsync",
    "zstd_level",
    "cuda_mode",
    "cudart_path",
    "pinned_pool_bytes",
    "pinned_limit",
    "parse_pinned_limit",
    "host_memory_bytes",
    "local_world_size",
    "ranks_on_host",
    "node_id",
    "consolidate_input",
    "worker_bytes",
    "host_cache_bytes",
    "read_bytes",
    "progress_interval",
    "peer_timeout",
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


def shared_threads(ranks_on_host: int) -> int:
    """Threads per rank for work that ``ranks_on_host`` ranks of this host run at the same time
    (an export over a process group): ``PYCKPT_NUM_THREADS`` when set; else the CPUs this
    process may run on (its affinity: a container's cpuset, a ``taskset``) divided among those
    ranks, ``min(8, cpus // ranks)``, at least 1."""
    raw = _get("num_threads", "PYCKPT_NUM_THREADS")
    if raw is not None and raw != "":
        return num_threads()
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // max(1, ranks_on_host)))


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


def cooperative() -> bool | None:
    """``PYCKPT_COOPERATIVE``: default of ``Reader(cooperative=...)`` and ``pyckpt.load``:
    ``1`` forces cooperative loads (stored bytes several ranks load are read from storage by one
    of them and shared over the group), ``0`` turns them off. Unset (None): each load decides,
    on the coordinator (docs/REPLICATED.md: on for object stores, node-local checkpoints and
    replicated bytes wanted on more than one node; off when every rank is on one node and reads
    a file system)."""
    raw = _get("cooperative", "PYCKPT_COOPERATIVE")
    if raw is None or raw.strip() == "":
        return None
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


def host_memory_bytes() -> int:
    """Physical memory of this host in bytes (16 GiB when the system does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 16 << 30


def local_world_size() -> int:
    """``LOCAL_WORLD_SIZE`` (set by torchrun): ranks on this node (default 1)."""
    return _int("local_world_size", "LOCAL_WORLD_SIZE", 1, 1)


def ranks_on_host(world: int) -> int:
    """How many of a group of ``world`` ranks run on this host, without a collective: all of
    them when the rendezvous address (``MASTER_ADDR``) is a loopback address (every rank reached
    it on this machine), else at most ``LOCAL_WORLD_SIZE`` (torchrun's ranks per node)."""
    addr = (os.environ.get("MASTER_ADDR") or "").strip().lower()
    if addr in ("localhost", "::1") or addr.startswith("127."):
        return max(1, world)
    return max(1, min(world, local_world_size()))


def node_id() -> str:
    """This process's node (host) id: torchrun's ``GROUP_RANK`` when torchrun's variables are
    set (``GROUP_RANK`` and ``LOCAL_WORLD_SIZE``), else the host name. Ranks with the same id
    are taken to share a host (its page cache, its local disks): the ``CheckpointManager``'s
    nodes and the default of cooperative loads. Tests pretend several nodes on one machine by
    giving each rank its own ``GROUP_RANK`` (``override(node_id=...)`` sets the id itself)."""
    if _overrides.get("node_id") is not None:
        return str(_overrides["node_id"])
    group_rank = os.environ.get("GROUP_RANK")
    if group_rank and os.environ.get("LOCAL_WORLD_SIZE"):
        return group_rank
    return socket.gethostname()


def parse_pinned_limit(value: object, source: str = "PYCKPT_PINNED_LIMIT") -> int:
    """A pinned-memory bound in bytes from an int (bytes, >= 1 MiB) or a fraction of host memory
    (a float in (0, 1]; strings are parsed as either)."""
    raw = value
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{source}={raw!r} is neither bytes nor a fraction") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{source}={raw!r} must be bytes (int) or a fraction of host memory")
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{source}={raw!r}: a fraction of host memory must be in (0, 1]")
        return max(MIN_PINNED_POOL_BYTES, int(host_memory_bytes() * value))
    if value < MIN_PINNED_POOL_BYTES:
        raise ValueError(f"{source}={raw!r} must be >= {MIN_PINNED_POOL_BYTES} bytes")
    return value


PINNED_LIMIT_FRACTION = 0.4


def pinned_limit() -> int:
    """``PYCKPT_PINNED_LIMIT``: bound on the process's staging memory (page-locked when CUDA is
    usable), shared by every Writer and Reader: bytes, or a fraction of host memory such as
    ``0.25``. Default: 40% of host memory divided by the ranks on this node
    (``LOCAL_WORLD_SIZE``)."""
    raw = _get("pinned_limit", "PYCKPT_PINNED_LIMIT")
    if raw is None or raw.strip() == "":
        share = int(host_memory_bytes() * PINNED_LIMIT_FRACTION) // local_world_size()
        return max(MIN_PINNED_POOL_BYTES, share)
    return parse_pinned_limit(raw)


def consolidate_input() -> str:
    """``PYCKPT_CONSOLIDATE_INPUT``: how consolidation reads shards, ``pread`` (default) or ``mmap``."""
    return _choice("consolidate_input", "PYCKPT_CONSOLIDATE_INPUT", "pread", ("pread", "mmap"))


#: Default of PYCKPT_WORKER_BYTES.
WORKER_BYTES = 1 << 30


def worker_bytes() -> int:
    """``PYCKPT_WORKER_BYTES``: input bytes each ``pyckpt consolidate --workers`` process needs
    to be started (default 1 GiB, about what one process exports in the second another one
    takes to start; 0 starts every worker asked for, up to one per core)."""
    return _int("worker_bytes", "PYCKPT_WORKER_BYTES", WORKER_BYTES, 0)


#: Default of PYCKPT_HOST_CACHE_BYTES (the native kHostCacheBytes).
HOST_CACHE_BYTES = 128 << 20
#: Default of PYCKPT_READ_BYTES (the native kDefaultReadPieceBytes).
READ_BYTES = 128 << 10


def host_cache_bytes() -> int:
    """``PYCKPT_HOST_CACHE_BYTES``: idle pageable host memory (freed encode, O_DIRECT and copy
    blocks, native threads' scratch of 1 MiB or more) the process keeps for the next writer,
    reader or export instead of unmapping it (default 128 MiB; 0 keeps none)."""
    return _int("host_cache_bytes", "PYCKPT_HOST_CACHE_BYTES", HOST_CACHE_BYTES, 0)


def read_bytes() -> int:
    """``PYCKPT_READ_BYTES``: bytes per read call of pyckpt's native file reads (default 128
    KiB, at least 4096). Small sequential reads let Linux read a cold local file ahead of the
    reader into large page-cache folios; a network file system whose client wants larger
    requests may read faster with a chunk's size (4 MiB)."""
    return _int("read_bytes", "PYCKPT_READ_BYTES", READ_BYTES, 4096)


def progress_interval() -> float:
    """``PYCKPT_PROGRESS_INTERVAL``: seconds between progress lines when stderr is not a
    terminal (default 5; 0 writes a line at every update)."""
    raw = _get("progress_interval", "PYCKPT_PROGRESS_INTERVAL")
    if raw is None or raw == "":
        return 5.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"PYCKPT_PROGRESS_INTERVAL={raw!r} is not a number") from None
    if not value >= 0:
        raise ValueError(f"PYCKPT_PROGRESS_INTERVAL={raw!r} must be >= 0")
    return value


def peer_timeout() -> int:
    """``PYCKPT_PEER_TIMEOUT``: seconds one of pyckpt's collectives between ranks waits for the
    others (default 300) before it checks their heartbeats and raises ``PeerLostError`` for a
    rank that stopped beating; capped at the process group's own timeout. Also the group's
    timeout during a node-local load (docs/RELIABILITY.md, "Peers that die")."""
    return _int("peer_timeout", "PYCKPT_PEER_TIMEOUT", 300, 1)


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
