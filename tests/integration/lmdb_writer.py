"""Writes chunks into an lmdb tier forever, reporting each transaction on stdout.

Run as ``python -m tests.integration.lmdb_writer PATH START SEED SYNC_INTERVAL_S``; it never exits
on its own, so the caller ends it with SIGKILL. Before each write it prints ``begin HI`` (every key
it may store has an index below HI), after it ``ack EVICTIONS I...`` (the indices stored), and
``bad I`` if a chunk read back with the wrong bytes.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from kvtier.core.keys import NAMESPACE_BYTES, ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.support import MiB, draft_spec, keys_for, lmdb_config, payload_for, target_spec

BUDGET = 8 * MiB
TARGET_CHUNK = 128 << 10
DRAFT_CHUNK = 64 << 10
BATCH_SIZES = (1, 1, 2, 3, 5, 8)
MAX_BATCH = max(BATCH_SIZES)

_TARGET_NS = target_spec().digest()
_DRAFT_NS = draft_spec().digest()
_CHUNK_BYTES = {_TARGET_NS: TARGET_CHUNK, _DRAFT_NS: DRAFT_CHUNK}


def registry() -> PoolRegistry:
    reg = PoolRegistry()
    reg.register(target_spec(), TARGET_CHUNK)
    reg.register(draft_spec(), DRAFT_CHUNK)
    return reg


def open_tier(path: Path, sync_interval_s: float = 0.2) -> LmdbTier:
    return LmdbTier(lmdb_config(path, budget=BUDGET, sync_interval_s=sync_interval_s), registry())


def key_of(index: int) -> ChunkKey:
    # two pools with different chunk sizes, so values of several sizes share the environment
    namespace = _DRAFT_NS if index % 4 == 3 else _TARGET_NS
    return keys_for(namespace, 1, start=index)[0]


def index_of(key: ChunkKey) -> int:
    return int.from_bytes(key[NAMESPACE_BYTES:], "big")


def chunk_bytes_of(key: ChunkKey) -> int:
    return _CHUNK_BYTES[key[:NAMESPACE_BYTES]]


def expected_payload(key: ChunkKey) -> bytes:
    return payload_for(key, chunk_bytes_of(key))


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    path, start, seed, sync_interval_s = Path(argv[0]), int(argv[1]), int(argv[2]), float(argv[3])
    rng = random.Random(seed)
    tier = open_tier(path, sync_interval_s)
    stored: list[int] = []
    next_index = start
    while True:
        indices = list(range(next_index, next_index + rng.choice(BATCH_SIZES)))
        next_index = indices[-1] + 1
        items = [(key_of(i), expected_payload(key_of(i))) for i in indices]
        _emit(f"begin {next_index}")
        if len(items) == 1 and rng.random() < 0.5:
            results = [tier.put(*items[0])]
        else:
            results = tier.put_many(items)
        evictions = tier.stats().counters["evictions_capacity"]
        acked = [i for i, ok in zip(indices, results, strict=True) if ok]
        _emit(" ".join(["ack", str(evictions), *map(str, acked)]))
        stored.extend(acked)
        # reads queue LRU touches, which the next write transaction commits
        for i in rng.sample(stored[-32:], min(2, len(stored))):
            key = key_of(i)
            dst = bytearray(chunk_bytes_of(key))
            if tier.read_into(key, memoryview(dst)) and dst != expected_payload(key):
                _emit(f"bad {i}")


if __name__ == "__main__":
    main(sys.argv[1:])
