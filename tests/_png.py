"""Strict PNG check for tests that produce plots (no imaging library needed)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

__all__ = ["png_size"]


def png_size(path: Path) -> tuple[int, int]:
    """Parses a PNG strictly (signature, chunk CRCs, IHDR first, IEND last, image data
    decompresses to exactly one filter byte plus one row per line); returns (width, height)."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG signature"
    pos, chunks, idat = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in chunk {kind!r}"
        chunks.append((kind, body))
        if kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert pos == len(data), f"{path}: truncated chunk"
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND", f"{path}: bad chunk order"
    width, height, depth, color = struct.unpack(">IIBB", chunks[0][1][:10])
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color]
    row = (width * channels * depth + 7) // 8
    assert len(zlib.decompress(idat)) == height * (1 + row), f"{path}: wrong image data size"
    return width, height
