"""The tier manager and the movers that run between tiers: `manager.TierManager` (lookup,
reserve/commit/abort, lease, stats), promotion from lmdb and the object store into the arena,
write-back from the arena down, maintenance (verify, warm-up, gc), draft revisions and
quarantines.

It may import `kvtier.core` and `kvtier.tiers`; the daemon, the clients, observability and the
hidden-state side build on it.
"""
