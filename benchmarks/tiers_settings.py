"""The tier benchmark's settings: chunk sizes, batches, the arena's extents, lookups, its modes
and targets (what it shares with the daemon benchmark is in `benchmarks.harness.arena_runs`)."""

from __future__ import annotations

from benchmarks.harness.arena_runs import CHUNK_SIZES as CHUNK_SIZES
from benchmarks.harness.arena_runs import EXTENT as EXTENT
from benchmarks.harness.arena_runs import LOOKUP_CHUNK as LOOKUP_CHUNK
from benchmarks.harness.arena_runs import LOOKUP_KEYS as LOOKUP_KEYS
from benchmarks.harness.arena_runs import SYNC_INTERVAL_S as SYNC_INTERVAL_S
from benchmarks.harness.arena_runs import Mode
from benchmarks.harness.sizes import MiB
from benchmarks.harness.targets import Target

BATCH = 8

TARGETS: dict[str, Target] = {
    "arena_store_vs_memcpy": (">=", 0.8),
    "arena_load_vs_memcpy": (">=", 0.8),
    "lmdb_write_vs_disk": (">=", 0.6),
    "lmdb_hot_read_vs_memcpy": (">=", 0.7),
    "lookup_8192_keys_us": ("<=", 2000.0),
}

QUICK = Mode("quick", 128 * MiB, 3, 11)
FULL = Mode("full", 256 * MiB, 7, 31)
