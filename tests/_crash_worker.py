"""Child process of the crash-safety test: saves a seeded state dict and reports progress.

Lives in its own module (not a test file) so that processes started with ``forkserver`` can
import it by name. Pause points are injected here, in the child, by wrapping the writer's
steps; the library has no test hooks.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

__all__ = ["make_state_dict", "save"]


def make_state_dict(seed: int, nbytes: int) -> dict[str, Any]:
    """A deterministic state dict of about ``nbytes``: four float tensors, a bf16 one, a step."""
    g = torch.Generator().manual_seed(seed)
    quarter = nbytes // 4 // 4
    sd: dict[str, Any] = {f"layer{i}": torch.randn(quarter, generator=g) for i in range(3)}
    sd["emb"] = torch.randn(quarter, generator=g).to(torch.bfloat16)
    sd["step"] = seed
    return sd


class _PausingFileWriter:
    """Wraps ``_C.FileWriter``: before renaming ``pyckpt.json``'s temp file into place, report
    "paused" and sleep (the parent kills the process there)."""

    def __init__(self, real: Any, q: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        self._fw = real(path, *args, **kwargs)
        self._q = q
        self._meta = str(path).endswith("pyckpt.json")

    def __enter__(self) -> _PausingFileWriter:
        self._fw.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._fw.__exit__(*exc)

    def commit(self) -> None:
        if self._meta:
            self._q.put("paused")
            time.sleep(3600)
        self._fw.commit()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fw, name)


def save(path: str, seed: int, nbytes: int, mode: str, pause: str, q: Any) -> None:
    """Saves ``make_state_dict(seed, nbytes)`` into ``path``; puts "start", then "done".

    Args:
        mode: ``"sync"`` (dcp.save) or ``"async"`` (dcp.async_save, waited for).
        pause: ``""``; ``"finish"`` (sleep once every data file is committed, before the
            metadata is written); ``"metadata"`` (sleep with the metadata's temp file written,
            before its rename).
    """
    import types

    import torch.distributed.checkpoint as dcp

    import pyckpt
    from pyckpt import _C
    from pyckpt.backends import posix

    warnings.simplefilter("ignore")
    sd = make_state_dict(seed, nbytes)
    writer = pyckpt.Writer(path)
    if pause == "finish":
        real_finish = writer.finish

        def finish(*args: Any, **kwargs: Any) -> None:
            q.put("paused")
            time.sleep(3600)
            real_finish(*args, **kwargs)

        writer.finish = finish  # type: ignore[method-assign]
    elif pause == "metadata":
        proxy = types.ModuleType("_C_with_pause")
        proxy.__dict__.update({k: v for k, v in vars(_C).items() if k != "__name__"})
        proxy.FileWriter = lambda *a, **k: _PausingFileWriter(_C.FileWriter, q, *a, **k)
        posix._C = proxy  # type: ignore[assignment]  # the directory backend writes pyckpt.json
    q.put("start")
    try:
        if mode == "sync":
            dcp.save(sd, storage_writer=writer, no_dist=True)
        else:
            dcp.async_save(sd, storage_writer=writer, no_dist=True).result()
    except BaseException as e:
        q.put(f"error: {e!r}")
        raise
    q.put("done")
