"""Checking a PNG file without Pillow (the report's pictures)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file, after checking it is one: signature, IHDR first, IEND last,
    every chunk's CRC, image data that inflates (no Pillow needed)."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, (path, kind)
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND", path
    assert zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT")), path
    width, height = struct.unpack(">II", chunks[0][1][:8])
    return width, height
