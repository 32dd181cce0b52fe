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
        assert m.cpu.slots.reserved == 0, "a reservation leaked"
        stats = m.stats()
        assert stats.tiers["cpu"].counters["writeback_ok"] > 0
        assert stats.tiers["lmdb"].counters["corrupt"] == 0
    finally:
        m.close()


def test_admin_evict_waits_for_the_write_back_batch_in_flight(
    shm_path: Path, tmp_path: Path
) -> None:
    """A chunk the write-back thread is copying to lmdb is nobody's lease: an admin eviction of
    its namespace waits for that batch and drops it with the rest, instead of skipping it."""
    m = TierManager(manager_config(shm_path, tmp_path, arena_mib=8, lmdb_mib=32))
    writing, go_on = threading.Event(), threading.Event()
    try:
        assert m.lmdb is not None
        ns = m.register_pool(target_spec(), CHUNK)
        keys = keys_for(ns, 8)
        put = m.lmdb.put_many_checked

        def held_put(*args: object, **kwargs: object) -> object:
            writing.set()
            assert go_on.wait(30), "the test never let the write-back go on"
            return put(*args, **kwargs)  # type: ignore[arg-type]

        m.lmdb.put_many_checked = held_put  # type: ignore[method-assign]
        refs = [r for r in m.reserve(keys) if r is not None]
        for ref in refs:
            m.cpu.view(ref)[:] = payload_for(ref.key, CHUNK)
        assert m.commit(refs) == len(keys)
        flushing = threading.Thread(target=m.flush)  # idle: writes every dirty chunk
        flushing.start()
        assert writing.wait(30), "no write-back batch started"
        evicted: list[dict[str, int]] = []
        evicting = threading.Thread(target=lambda: evicted.append(m.evict(namespace=ns)))
        evicting.start()
        evicting.join(0.2)
        assert evicting.is_alive(), "the eviction did not wait for the batch in flight"
        go_on.set()
        evicting.join(30)
        flushing.join(30)
        assert len(evicted) == 1, "the eviction did not return"
        assert evicted[0]["cpu"] == len(keys), evicted
        assert m.lookup(keys).hits == 0
        assert int(m.cpu.memory.refcount.sum()) == 0
    finally:
        go_on.set()
        m.close()
