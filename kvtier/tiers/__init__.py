"""The storage media, each behind the `base.Tier` contract: the shared-memory arena (`cpu`, asking
the slots it holds, `cpu_slots`, which choose room in `arena_room` and count replicas in
`arena_usage`, with its file layout in `arena` and `arena_index`, slot tables in `slots`, eviction
policies and commit checksums), lmdb (`lmdb_tier` holding `lmdb_store`,
with its environment, index and values) and the object store (`objstore`).

It may import `kvtier.core` only; the tier manager (`kvtier.tiering`) moves chunks between them.
Clients map the arena's file (`arena`, `arena_index`) and import nothing else from here.
"""
