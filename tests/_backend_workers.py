"""Child-process bodies of tests/backends/ (importable by name: pytest imports test modules
under names a spawned child cannot import)."""

from __future__ import annotations

import errno
import logging
import threading
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import pyckpt


def sd(seed: int, mib: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn((mib << 20) // 4, generator=g), "step": seed}


def save_overlapping(path: str, seed: int, barrier: Any, q: Any, flock: bool) -> None:
    """One of two processes saving into ``path``; both wait at ``barrier`` after set-up (in the
    data sink), so their saves overlap whatever the scheduling. ``flock=False`` runs the save
    as on a filesystem without flock (NFS without a lock manager, some FUSE mounts)."""
    import fcntl
    import warnings

    from pyckpt.backends import posix

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    if not flock:
        def no_flock(fd: int, op: int) -> None:
            raise OSError(errno.ENOLCK, "No locks available")

        fcntl.flock = no_flock  # type: ignore[assignment]
    real = posix.PosixBackend.data_sink

    def data_sink(self: Any, name: str, options: Any) -> Any:
        # Both saves are set up before either writes (or the other was refused at set-up and
        # broke the barrier: this one holds the place).
        try:
            barrier.wait(timeout=120)
        except threading.BrokenBarrierError:
            pass
        return real(self, name, options)

    posix.PosixBackend.data_sink = data_sink  # type: ignore[method-assign]
    try:
        barrier.wait(timeout=120)
        dcp.save(sd(seed), storage_writer=pyckpt.Writer(path), no_dist=True)
        q.put((seed, "ok", ""))
    except BaseException as e:
        failures = getattr(e, "failures", None) or {}
        inner = next(iter(failures.values()))[0] if failures else e
        barrier.abort()  # the other save must not wait for this one in its data sink
        q.put((seed, type(inner).__name__, str(inner)))


def peer_clean_up_fails_on_rank_1(rank: int, world: int, root: str) -> list[str]:
    """Node-local saves into one directory per rank; rank 1 cannot delete files. Returns the
    clean-up warnings this rank logged."""
    import os

    from pyckpt.backends import posix

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("pyckpt.backends").addHandler(Collect(logging.WARNING))
    path = os.path.join(root, f"node{rank}")
    pyckpt.save(sd(1, 1), path, shared_filesystem=False)
    if rank == 1:
        def delete(self: Any, names: Any) -> None:
            raise OSError(errno.EIO, "injected: I/O error", self.path)

        posix.PosixBackend.delete = delete  # type: ignore[method-assign]
    pyckpt.save(sd(2, 1), path, shared_filesystem=False)  # committed: succeeds on every rank
    out = {"w": torch.zeros((1 << 20) // 4), "step": -1}
    pyckpt.load(out, path, shared_filesystem=False)
    assert out["step"] == 2 and torch.equal(out["w"], sd(2, 1)["w"])
    return [m for m in records if "removing files of earlier saves failed" in m]
