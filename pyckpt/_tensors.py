"""How a tensor handed to a writer becomes the bytes that are stored (private).

The one place where the process-local values of a tensor are found: a DTensor stands for its
local shard, autograd history is dropped, and lazy conjugate / negative bits are resolved, so
the row-major bytes of the result are the values the tensor holds. Used by the DCP writer
(host and device saves) and by the GPU staging (device tensors, async staging, uploads).
"""

from __future__ import annotations

import torch

__all__ = ["local_view", "resolved", "plain"]


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The process-local data of ``t`` (a DTensor's shard, else ``t`` itself), detached."""
    local = getattr(t, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else t).detach()


def resolved(t: torch.Tensor) -> torch.Tensor:
    """:func:`local_view` of ``t`` without conj/neg bits (same device, same strides where no
    bit had to be resolved)."""
    t = local_view(t)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def plain(t: torch.Tensor) -> torch.Tensor:
    """:func:`resolved` ``t`` made contiguous on its device (for a device tensor the copies are
    queued on its current stream, so a staging fence after that stream orders them first)."""
    return resolved(t).contiguous()
