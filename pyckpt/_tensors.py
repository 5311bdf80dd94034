"""How a tensor handed to a writer becomes the bytes that are stored (private).

The one place where the process-local values of a tensor are found: a DTensor stands for its
local shard, autograd history is dropped, and lazy conjugate / negative bits are resolved, so
the row-major bytes of the result are the values the tensor holds. Used by the DCP writer
(host and device saves) and by the GPU staging (device tensors, async staging, uploads).
"""

from __future__ import annotations

import torch

from pyckpt._format_spec import DTYPE_SIZES
from pyckpt.errors import UnsupportedDtypeError

__all__ = ["device_bytes", "dtype_name", "host_bytes", "local_view", "plain", "resolved",
           "storable"]


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def storable(tensor: torch.Tensor, fqn: str) -> torch.Tensor:
    """``tensor``'s local values (:func:`resolved`); refuses what cannot be
    stored.

    Raises:
        UnsupportedDtypeError: a dtype outside the format's table, or a non-strided layout.
    """
    if dtype_name(tensor.dtype) not in DTYPE_SIZES:
        if tensor.is_quantized:  # the format holds no quantizer (scale, zero point, axis)
            raise UnsupportedDtypeError(
                f"tensor {fqn!r}: quantized dtype {tensor.dtype} cannot be stored; save its "
                "integer values (t.int_repr()) with its quantizer parameters (t.q_scale(), "
                "t.q_zero_point(), or t.q_per_channel_scales() ...) as plain tensors")
        raise UnsupportedDtypeError(f"tensor {fqn!r}: dtype {tensor.dtype} cannot be stored")
    if tensor.layout != torch.strided:
        raise UnsupportedDtypeError(f"tensor {fqn!r}: layout {tensor.layout} cannot be stored")
    return resolved(tensor)


def host_bytes(tensor: torch.Tensor, fqn: str) -> torch.Tensor:
    """Returns a CPU, contiguous, plain tensor with ``tensor``'s values."""
    t = storable(tensor, fqn)
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def device_bytes(tensor: torch.Tensor, fqn: str) -> torch.Tensor:
    """A device tensor's bytes as a flat uint8 tensor on the device (made contiguous there)."""
    t = storable(tensor, fqn).contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
