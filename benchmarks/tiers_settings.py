"""The tier benchmark's settings: chunk sizes, batches, the arena's extents, lookups, its modes
and targets."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.harness.sizes import MiB
from benchmarks.harness.targets import Target

CHUNK_SIZES = (1 * MiB, 2 * MiB, 4 * MiB)
BATCH = 8
EXTENT = 32 * MiB
LOOKUP_KEYS = 8192
LOOKUP_CHUNK = 4096
SYNC_INTERVAL_S = 3600.0

TARGETS: dict[str, Target] = {
    "arena_store_vs_memcpy": (">=", 0.8),
    "arena_load_vs_memcpy": (">=", 0.8),
    "lmdb_write_vs_disk": (">=", 0.6),
    "lmdb_hot_read_vs_memcpy": (">=", 0.7),
    "lookup_8192_keys_us": ("<=", 2000.0),
}


@dataclass(frozen=True)
class Mode:
    name: str
    working_set: int
    reps: int
    lookup_runs: int


QUICK = Mode("quick", 128 * MiB, 3, 11)
FULL = Mode("full", 256 * MiB, 7, 31)
