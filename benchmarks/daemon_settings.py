"""The daemon benchmark's settings: chunk sizes and batches, the daemon's arena and lmdb, its
modes and targets (what it shares with the tier benchmark is in `benchmarks.harness.arena_runs`)."""

from __future__ import annotations

from benchmarks.harness.arena_runs import CHUNK_SIZES as CHUNK_SIZES
from benchmarks.harness.arena_runs import EXTENT as EXTENT
from benchmarks.harness.arena_runs import LOOKUP_CHUNK as LOOKUP_CHUNK
from benchmarks.harness.arena_runs import LOOKUP_KEYS as LOOKUP_KEYS
from benchmarks.harness.arena_runs import SYNC_INTERVAL_S as SYNC_INTERVAL_S
from benchmarks.harness.arena_runs import Mode
from benchmarks.harness.sizes import KiB, MiB
from benchmarks.harness.targets import Target

BATCH = 64  # chunks per call on the transfer paths
FILL_BATCH = 1024
STORE_BATCH = 64
STORE_CHUNK = 64 * KiB
LMDB_BUDGET = 1 << 30
DROP_TIMEOUT_S = 10.0
CLIENT_TIMEOUT_S = 120.0

TARGETS: dict[str, Target] = {
    "lookup_8192_keys_p99_us": ("<=", 3000.0),
    "cross_process_arena_vs_memcpy": (">=", 0.7),
    "rpc_per_chunk": ("<=", 0.1),
}

QUICK = Mode("quick", 128 * MiB, 5, 50, store_chunks=1024, store_reps=15)
FULL = Mode("full", 256 * MiB, 11, 200, store_chunks=2048, store_reps=31)
