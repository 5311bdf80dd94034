"""The CUDA runtime test double, loaded for a test (shared by the staging test modules).

The double (``pyckpt/_testing/libpyckpt_fake_cudart.so``) is loaded through the same run-time path
as a real runtime (``PYCKPT_CUDART``); "device memory" is host memory, streams are worker threads,
so copies really are asynchronous and missing waits show up as wrong bytes.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.resources
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pyckpt import _knobs, _pinned, _staging


def double_path() -> str:
    return str(importlib.resources.files("pyckpt") / "_testing" / "libpyckpt_fake_cudart.so")


class FakeDevice:
    """CPU tensors registered here play device tensors on device 0; `stream` is the caller's."""

    def __init__(self) -> None:
        self.ptrs: set[int] = set()
        self.stream = 0

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        self.ptrs.add(t.untyped_storage().data_ptr())
        return t

    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.ptrs

    def device_index(self, t: torch.Tensor) -> int:
        return 0

    def current_stream(self, device: int) -> int:
        return self.stream


def load_double(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Body of the ``fake`` fixtures: the double with reset counters, ``lib.counter(name)``,
    ``lib.dev`` (a :class:`FakeDevice` standing in for torch's device API), and the process's
    staging memory emptied before and after the test."""
    path = double_path()
    assert os.path.isfile(path), "the CUDA runtime test double is part of every build"
    lib = ctypes.CDLL(path)
    lib.fake_cudart_counter.restype = ctypes.c_longlong
    lib.fake_cudart_counter.argtypes = [ctypes.c_char_p]
    lib.fake_cudart_fail_on.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.fake_cudart_set_copy_delay_us.argtypes = [ctypes.c_long]
    lib.fake_cudart_enqueue_fill.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_long
    ]
    lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    lib.cudaStreamDestroy.argtypes = [ctypes.c_void_p]
    _pinned._forget_for_tests()  # the process's staging memory starts empty for every test
    gc.collect()
    lib.fake_cudart_reset()
    lib.counter = lambda name: lib.fake_cudart_counter(name.encode())
    dev = FakeDevice()
    lib.dev = dev
    monkeypatch.setattr(_staging, "_device_api", dev)
    with _knobs.override(cudart_path=path, cuda_mode="auto"):
        yield lib
    _pinned._forget_for_tests()
    gc.collect()
    lib.fake_cudart_reset()
