"""The storage media, each behind the `base.Tier` contract: the shared-memory arena (`cpu`, with
its file layout in `arena` and `arena_index`, its slot classes and eviction), lmdb (`lmdb_tier`
over its environment, index and values) and the object store (`objstore`).

It may import `kvtier.core` only; the tier manager (`kvtier.tiering`) moves chunks between them.
Clients map the arena's file (`arena`, `arena_index`) and import nothing else from here.
"""
