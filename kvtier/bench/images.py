"""Images for multimodal workloads, made without an imaging library: deterministic blocks of
colour, encoded as PNG (8-bit RGB, no filter) and sent as ``data:`` URLs."""

from __future__ import annotations

import base64
import random
import struct
import zlib

BLOCKS = 8
"""Blocks per side: a picture with content, yet small to encode."""


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(seed: int | str, side: int) -> bytes:
    """A ``side`` x ``side`` PNG of coloured blocks, the same for the same seed."""
    if side < BLOCKS:
        raise ValueError(f"an image side is at least {BLOCKS} pixels, got {side}")
    rng = random.Random(f"image/{seed}")
    colours = [
        [bytes(rng.randrange(256) for _ in range(3)) for _ in range(BLOCKS)] for _ in range(BLOCKS)
    ]
    rows = []
    for y in range(side):
        line = colours[y * BLOCKS // side]
        rows.append(b"\0" + b"".join(line[x * BLOCKS // side] for x in range(side)))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"".join(
        (
            b"\x89PNG\r\n\x1a\n",
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(b"".join(rows), 6)),
            _chunk(b"IEND", b""),
        )
    )


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()
