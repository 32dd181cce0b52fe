"""The daemon benchmark's settings: chunk sizes and batches, the daemon's arena and lmdb, its
modes and targets."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.harness.sizes import KiB, MiB
from benchmarks.harness.targets import Target

CHUNK_SIZES = (1 * MiB, 2 * MiB, 4 * MiB)
BATCH = 64  # chunks per call on the transfer paths
EXTENT = 32 * MiB
LOOKUP_KEYS = 8192
LOOKUP_CHUNK = 4 * KiB  # 8192 of them fit one extent
FILL_BATCH = 1024
STORE_BATCH = 64
STORE_CHUNK = 64 * KiB
LMDB_BUDGET = 1 << 30
SYNC_INTERVAL_S = 3600.0
DROP_TIMEOUT_S = 10.0
CLIENT_TIMEOUT_S = 120.0

TARGETS: dict[str, Target] = {
    "lookup_8192_keys_p99_us": ("<=", 3000.0),
    "cross_process_arena_vs_memcpy": (">=", 0.7),
    "rpc_per_chunk": ("<=", 0.1),
}


@dataclass(frozen=True)
class Mode:
    name: str
    working_set: int
    reps: int
    lookup_runs: int
    store_chunks: int
    store_reps: int


QUICK = Mode("quick", 128 * MiB, 5, 50, 1024, 15)
FULL = Mode("full", 256 * MiB, 11, 200, 2048, 31)
