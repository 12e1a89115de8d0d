"""Read the pixels of a PNG (8-bit RGB or RGBA, not interlaced: what Chromium's screenshots
are), so tests can look at a screenshot without an imaging library."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path


def read(path: Path) -> tuple[int, int, list[bytes]]:
    """``(width, height, rows)``: each row ``width * 3`` bytes of RGB (alpha dropped).

    Raises:
        ValueError: not a PNG this reader handles.
    """
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG")
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if depth != 8 or colour not in (2, 6) or interlace:
        raise ValueError(f"{path}: depth {depth}, colour type {colour}, interlace {interlace}")
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pred) & 0xFF
        prev = line
        rows.append(bytes(line) if bpp == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3))
    return width, height, rows


def count(rows: list[bytes], rgb: tuple[int, int, int], tolerance: int = 24) -> int:
    """Pixels within ``tolerance`` (per channel) of ``rgb``."""
    r0, g0, b0 = rgb
    n = 0
    for row in rows:
        for x in range(0, len(row), 3):
            if (
                abs(row[x] - r0) <= tolerance
                and abs(row[x + 1] - g0) <= tolerance
                and abs(row[x + 2] - b0) <= tolerance
            ):
                n += 1
    return n
