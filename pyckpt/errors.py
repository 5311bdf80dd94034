"""Exception types raised by pyckpt.

OS-level failures surface as the builtin :class:`OSError` subclasses (``FileNotFoundError``,
``PermissionError``, ...) with ``filename`` set; everything pyckpt-specific derives from
:class:`PyckptError`.
"""

from __future__ import annotations

__all__ = [
    "PyckptError",
    "CheckpointFormatError",
    "ChecksumError",
    "CompressionError",
    "CudaError",
    "UnsupportedDtypeError",
]


class PyckptError(Exception):
    """Base class of pyckpt's own errors."""


class CheckpointFormatError(PyckptError, ValueError):
    """On-disk data violates the format: truncated, inconsistent, unknown version, bad header."""


class ChecksumError(CheckpointFormatError):
    """Stored bytes do not match their recorded checksum (corruption)."""


class CompressionError(PyckptError):
    """zstd failed to compress or decompress a chunk."""


class CudaError(PyckptError, RuntimeError):
    """The CUDA runtime returned an error during staging."""


class UnsupportedDtypeError(PyckptError, TypeError):
    """A tensor's dtype cannot be stored in the requested format."""
