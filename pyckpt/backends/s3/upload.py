"""The write path of the S3 backend: data objects uploaded while they are encoded, and local
files (consolidation outputs) uploaded whole.

Chunks are encoded by the native pipeline into a :class:`pyckpt._C.BlockWriter` (a ChunkSink
whose blocks export the buffer protocol) and handed to an ``obstore`` writer that uploads them
as multipart parts, several in flight (memory bounded by ``part_bytes`` x (``max_concurrency`` +
2)); the GIL is released while encoding and while ``obstore`` waits. A failed upload is aborted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pyckpt import _C
from pyckpt.backends.base import NativeBlockSink
from pyckpt.backends.s3.client import (
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_PART_BYTES,
    MAX_PART_BYTES,
    MIN_PART_BYTES,
    Location,
    _obstore,
)

__all__ = ["DataUpload", "check_part_bytes", "upload_file"]

# Test hook: called as _after_part(object_url, part_number) after each part is handed over.
_after_part: Callable[[str, int], None] | None = None


class DataUpload(NativeBlockSink):
    """One data object uploaded as a multipart upload while it is encoded.

    Used like :class:`pyckpt._C.FileWriter` (``write_items``, ``commit``, ``size``); leaving the
    ``with`` block without :meth:`commit` aborts the upload, so no object appears.

    Raises:
        FileNotFoundError / PermissionError / ObjectStoreError: an upload failed (naming the
            object's URL).
    """

    def __init__(self, loc: Location, name: str, part_bytes: int, max_concurrency: int) -> None:
        obstore = _obstore()

        self.loc = loc
        self.name = name
        self.url = loc.url_of(name)
        self.parts = 0
        self.bytes_uploaded = 0
        self._writer = obstore.open_writer(
            loc.store(), loc.key(name), buffer_size=part_bytes, max_concurrency=max_concurrency
        )
        # A block's buffer is reused once the upload of its part lets go of it: up to as many
        # as can be in flight, so memory stays within the same bound.
        self._native = _C.BlockWriter(self.url, part_bytes, self._on_block,
                                      spare_blocks=max_concurrency + 2)
        self.committed = False

    def _on_block(self, block: Any) -> None:
        try:
            self._writer.write(block)
        except Exception as e:
            raise self.loc.error(e, "upload of", self.url) from e
        self.parts += 1
        self.bytes_uploaded += len(block)
        if _after_part is not None:
            _after_part(self.url, self.parts)

    @property
    def reused_blocks(self) -> int:
        """Parts encoded into the buffer of an earlier part that had been uploaded."""
        return int(self._native.reused_blocks)

    def commit(self) -> None:
        """Uploads the last part and completes the object."""
        self._native.commit()
        try:
            self._writer.close()
        except Exception as e:
            raise self.loc.error(e, "completing upload of", self.url) from e
        self.committed = True

    def abort(self) -> None:
        """Aborts the multipart upload (best effort: the store may be unreachable)."""
        if self.committed:
            return
        self._native.abort()
        err = RuntimeError("pyckpt: upload aborted")
        try:
            self._writer.__exit__(RuntimeError, err, None)
        except Exception:  # the store failed: it keeps the incomplete upload until it expires
            pass

    def __enter__(self) -> DataUpload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


def check_part_bytes(part_bytes: int | None) -> int:
    """Validates a multipart part size; None means :data:`DEFAULT_PART_BYTES`."""
    if part_bytes is None:
        return DEFAULT_PART_BYTES
    if not MIN_PART_BYTES <= part_bytes <= MAX_PART_BYTES:
        raise ValueError(
            f"part_bytes must be in [{MIN_PART_BYTES}, {MAX_PART_BYTES}] (S3 limits), "
            f"got {part_bytes}"
        )
    return part_bytes


def _plain_key(loc: Location, name: str) -> str:
    """``prefix/name`` for an output file's plain base name (no separators, not . or ..)."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"{loc.url}: illegal object name {name!r}")
    return f"{loc.prefix}/{name}" if loc.prefix else name


def upload_file(loc: Location, path: str, part_bytes: int = DEFAULT_PART_BYTES,
                single_put: bool = False) -> str:
    """Uploads local file ``path`` as ``prefix/<basename>`` (multipart above ``part_bytes``,
    or one PUT with ``single_put``); returns its URL."""
    import pathlib

    obstore = _obstore()

    name = os.path.basename(path)
    key = _plain_key(loc, name)
    url = loc.url_of(name)
    try:
        if single_put:
            with open(path, "rb") as f:
                obstore.put(loc.store(), key, f.read(), use_multipart=False)
        else:
            obstore.put(loc.store(), key, pathlib.Path(path), chunk_size=part_bytes,
                        max_concurrency=DEFAULT_MAX_CONCURRENCY)
    except Exception as e:
        raise loc.error(e, "upload of", url) from e
    return url
