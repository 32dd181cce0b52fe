"""Byte units and the sizes the engine benchmarks give kvtier: lmdb's budget, the arena's
extents, a socket path's limit."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
LMDB_BUDGET = 3 * GiB
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def extent_for(chunk_bytes: int) -> int:
    """The arena's allocation unit: 32 MiB, or the next power of two that holds a chunk."""
    extent = 32 * MiB
    while extent < chunk_bytes:
        extent *= 2
    return extent
