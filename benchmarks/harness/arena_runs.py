"""What the tier and the daemon benchmarks share, so that their figures compare: the chunk sizes
they move, the arena's extent, the lookup they time, lmdb's sync interval (none within a run) and
the size of a run (`Mode`)."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.harness.sizes import KiB, MiB

CHUNK_SIZES = (1 * MiB, 2 * MiB, 4 * MiB)
EXTENT = 32 * MiB
LOOKUP_KEYS = 8192
LOOKUP_CHUNK = 4 * KiB  # 8192 of them fit one extent
SYNC_INTERVAL_S = 3600.0


@dataclass(frozen=True)
class Mode:
    """A run's size: the bytes it moves, its repetitions and lookup runs, and, where it times
    store-and-commit rounds, their chunks and repetitions."""

    name: str
    working_set: int
    reps: int
    lookup_runs: int
    store_chunks: int = 0
    store_reps: int = 0
