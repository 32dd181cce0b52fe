"""Many threads storing and loading through one TierManager while write-back runs: every byte
loaded matches its key, and no lease or reservation is left behind."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from kvtier.tiering.manager import TierManager
from tests.support import keys_for, manager_config, payload_for, target_spec

CHUNK = 256 << 10
THREADS = 4
SECONDS = 3.0


def test_concurrent_store_and_load_never_serve_wrong_bytes(shm_path: Path, tmp_path: Path) -> None:
    m = TierManager(manager_config(shm_path, tmp_path, arena_mib=8, lmdb_mib=32))
    ns = m.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 120)  # more than the arena (24) and the lmdb budget (~110) hold
    errors: list[str] = []
    loads = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline and not errors:
            batch = rng.sample(keys, 4)
            refs = [r for r in m.reserve(batch, f"r{seed % 2}") if r is not None]
            for ref in refs:
                m.cpu.view(ref)[:] = payload_for(ref.key, CHUNK)
            if rng.random() < 0.1:
                m.abort(refs)
            else:
                m.commit(refs)
            hit = m.lookup(batch)
            leases = m.lease(batch[: hit.hits], f"r{seed % 2}")
            for lease in leases:
                if lease is None:
                    continue
                if bytes(m.cpu.view(lease)) != payload_for(lease.key, CHUNK):
                    errors.append(f"wrong bytes for {lease.key.hex()}")
                loads[0] += 1
            m.release([lease for lease in leases if lease is not None])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors[:3]
        assert loads[0] > 100
        assert m.flush()
        mem = m.cpu.memory
        assert int(mem.refcount.sum()) == 0, "a lease or write-back reference leaked"
        assert not m.cpu._writing, "a reservation leaked"
        stats = m.stats()
        assert stats.tiers["cpu"].counters["writeback_ok"] > 0
        assert stats.tiers["lmdb"].counters["corrupt"] == 0
    finally:
        m.close()
