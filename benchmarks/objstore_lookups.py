"""The object benchmark's lookups against a slow store: how long a lookup waits when the store
answers late, against its budget."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.harness.buffers import filled
from benchmarks.harness.sizes import MiB
from benchmarks.harness.specs import spec_for_chunk
from benchmarks.harness.stats import percentile
from benchmarks.objstore_proxy import ProxyProcess
from benchmarks.objstore_settings import (
    BUCKET,
    EXTENT,
    LOOKUP_CHUNK,
    LOOKUP_KEYS,
    REQUEST_TIMEOUT_S,
    STORE_DELAY_MS,
)
from kvtier.core.config import ObjectStoreConfig, from_mapping
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.tiering.manager import TierManager
from kvtier.tiers.objstore.tier import ObjectTier
from tests.fixtures.keys import keys_for
from tests.fixtures.s3 import patched_env


def lookups_against_a_slow_store(
    proxy: ProxyProcess, root: Path, shm: Path, n: int, pool: ThreadPoolExecutor
) -> dict[str, Any]:
    """Lookup times of a manager whose object store answers at once, then ``STORE_DELAY_MS``
    late (through ``proxy``): ``n`` lookups of fresh keys each, every other one of a chunk
    another node uploaded."""
    registry = PoolRegistry()
    lookup_spec = spec_for_chunk("bench-objstore-lookup", LOOKUP_CHUNK)
    namespace = registry.register(lookup_spec, LOOKUP_CHUNK).namespace
    # two series (store answering at once, store slow), each lookup with fresh keys
    batches = [keys_for(namespace, LOOKUP_KEYS, i * LOOKUP_KEYS) for i in range(2 * n)]
    # another node's uploads: every other batch starts with a chunk that is in the store
    other = ObjectTier(
        ObjectStoreConfig(url=f"s3://{BUCKET}/lookup", index_path=root / "other-index"),
        registry,
    )
    try:
        payload = filled(LOOKUP_CHUNK, 7).tobytes()
        seeded = [batch[0] for batch in batches[::2]]
        for ok in pool.map(lambda key: other.put(key, payload), seeded):
            if not ok:
                raise RuntimeError("seeding the store failed")
    finally:
        other.close()
    config = from_mapping(
        {
            "arena": {
                "path": str(shm),
                "size_bytes": 2 * EXTENT + 4 * MiB,
                "extent_bytes": EXTENT,
                "min_slot_bytes": LOOKUP_CHUNK,
            },
            "lmdb": {
                "path": str(root / "lmdb"),
                "budget_bytes": 256 * MiB,
                "sync_interval_s": 3600.0,
            },
            "object": {
                "url": f"s3://{BUCKET}/lookup",
                "index_path": str(root / "lookup-index"),
                "request_timeout_s": REQUEST_TIMEOUT_S,
            },
        }
    )
    # S3 requests go through the proxy, STS straight to moto
    with patched_env({"AWS_ENDPOINT_URL_S3": proxy.url}):
        manager = TierManager(config)
    budget_ms = config.object.lookup_budget_ms
    try:
        manager.register_pool(lookup_spec, LOOKUP_CHUNK)
        proxy.set_delay(0.0)
        fast, _ = time_lookups(manager, batches[:n], budget_ms)
        proxy.set_delay(STORE_DELAY_MS)
        slow, pending = time_lookups(manager, batches[n:], budget_ms)
    finally:
        manager.close(flush_timeout=5.0)
    return {
        "lookup_budget_ms": budget_ms,
        "lookup_store_delay_ms": proxy.delay_ms,
        "lookup_budget_p50_ms": percentile(slow, 50),
        "lookup_budget_p99_ms": percentile(slow, 99),
        "lookup_budget_max_ms": max(slow),
        "lookup_pending_fraction": pending / len(slow),
        "lookup_fast_store_p50_ms": percentile(fast, 50),
        "lookup_fast_store_p99_ms": percentile(fast, 99),
        "lookups": len(slow),
        "lookup_keys": LOOKUP_KEYS,
    }


def time_lookups(
    manager: TierManager, batches: list[list[ChunkKey]], budget_ms: float
) -> tuple[list[float], int]:
    times: list[float] = []
    pending = 0
    for keys in batches:
        start = time.perf_counter()
        result = manager.lookup(keys)
        times.append((time.perf_counter() - start) * 1e3)
        pending += result.pending
        # leave the probe pool time to drain, as lookups of one engine are spaced
        time.sleep(max(0.0, budget_ms / 1e3 - (time.perf_counter() - start)))
    return times, pending
