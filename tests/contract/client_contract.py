"""The contract every `TierClient` passes, whatever serves it. A client's test module subclasses
`ClientContract` and supplies three fixtures:

- ``connect``: ``connect(replica)`` -> a client of one set of tiers (each call a new client,
  all of the same tiers), closed at teardown;
- ``evict_arena``: ``evict_arena()`` empties the arena, its chunks written to lmdb first;
- ``foreign``: a namespace the ``client`` may not use, and the error a batch naming it raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from kvtier.core.errors import KVTierError, UnknownPoolError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import SlotRef, TierClient
from kvtier.core.protocol import in_lmdb as in_lmdb_ref
from kvtier.tiers.arena import ArenaMemory
from tests.support import draft_spec, keys_for, payload_for, target_spec

CHUNK = 256 << 10
DRAFT_CHUNK = 64 << 10
PROMOTE_TIMEOUT_S = 10.0
BATCH_CALLS = ("lookup", "reserve", "lease", "promote", "leasing_lookup")

Connect = Callable[[str], TierClient]
Foreign = tuple[bytes, type[KVTierError]]


def unregistered() -> Foreign:
    """A namespace no client registered: refused by every client."""
    return target_spec(model="never-registered").digest(), UnknownPoolError


class ClientContract:
    @pytest.fixture
    def client(self, connect: Connect) -> TierClient:
        return connect("r0")

    @pytest.fixture
    def ns(self, client: TierClient) -> bytes:
        return client.register_pool(target_spec(), CHUNK)

    @pytest.fixture
    def arena(self, client: TierClient, ns: bytes) -> Iterator[ArenaMemory]:
        memory = ArenaMemory.attach(client.arena_path)
        yield memory
        memory.close()

    def _write(self, arena: ArenaMemory, refs: Sequence[SlotRef | None]) -> list[SlotRef]:
        written = [r for r in refs if r is not None]
        for ref in written:
            arena.view(ref.offset, ref.nbytes)[:] = payload_for(ref.key, ref.nbytes)
        return written

    def _store(self, client: TierClient, arena: ArenaMemory, keys: Sequence[ChunkKey]) -> None:
        refs = self._write(arena, client.reserve(keys))
        assert len(refs) == len(keys)
        assert client.commit(refs) == len(keys)

    def _read(self, arena: ArenaMemory, ref: SlotRef) -> bytes:
        return bytes(arena.view(ref.offset, ref.nbytes))

    # -- registration -----------------------------------------------------------------------

    def test_register_names_the_pool_the_same_way_every_time(
        self, client: TierClient, connect: Connect, ns: bytes
    ) -> None:
        assert ns == target_spec().digest()
        assert client.register_pool(target_spec(), CHUNK) == ns
        assert connect("r1").register_pool(target_spec(), CHUNK) == ns
        assert client.register_pool(target_spec(model="other"), CHUNK) != ns
        assert client.arena_path.exists()
        assert client.serving

    def test_draft_pools_report_their_revision(self, client: TierClient) -> None:
        client.register_pool(draft_spec(), DRAFT_CHUNK)
        (state,) = client.draft_states(refresh=True).values()
        assert (state.revision, state.swapping) == ("d1", False)

    # -- store: reserve, commit, abort ------------------------------------------------------

    def test_committed_chunks_are_found_and_load_byte_exact(
        self, client: TierClient, arena: ArenaMemory, ns: bytes
    ) -> None:
        keys = keys_for(ns, 4)
        assert client.lookup(keys).hits == 0
        self._store(client, arena, keys)
        found = client.lookup(keys)
        assert (found.hits, found.tiers) == (4, ["cpu"] * 4)
        leases = client.lease(keys)
        assert all(leases)
        assert [self._read(arena, r) for r in leases if r] == [payload_for(k, CHUNK) for k in keys]
        client.release([r for r in leases if r is not None])

    def test_in_arena_names_the_held_prefixs_slots_without_a_lease(
        self, client: TierClient, arena: ArenaMemory, ns: bytes
    ) -> None:
        keys = keys_for(ns, 3)
        self._store(client, arena, keys[:2])
        found = client.in_arena(keys)
        if found is None:  # a client that cannot read the arena so asks instead
            return
        leases = [r for r in client.lease(keys[:2]) if r is not None]
        assert [(r.key, r.slot, r.generation) for r in found] == [
            (r.key, r.slot, r.generation) for r in leases
        ]
        client.release(leases)
        client.release(found)  # nothing to end: no lease stands behind them
        assert client.lookup(keys[:2]).hits == 2

    def test_a_lookup_asked_again_answers_the_same(
        self, client: TierClient, arena: ArenaMemory, ns: bytes
    ) -> None:
        keys = keys_for(ns, 3)
        self._store(client, arena, keys[:2])
        first, leased = client.lookup(keys, lease=True)
        again, leased_again = client.lookup(keys, release=leased, lease=True, again=True)
        assert (first.hits, first.tiers) == (again.hits, again.tiers) == (2, ["cpu"] * 2)
        assert [r.key for r in leased_again if r is not None] == keys[:2]
        client.release([r for r in leased_again if r is not None])

    def test_lookup_counts_the_present_prefix(
        self, client: TierClient, arena: ArenaMemory, ns: bytes
    ) -> None:
        keys = keys_for(ns, 3)
        self._store(client, arena, [keys[0], keys[2]])
        assert client.lookup(keys).hits == 1
        assert client.lease([keys[1]]) == [None]

    def test_reserve_skips_what_is_stored(
        self, client: TierClient, arena: ArenaMemory, ns: bytes
    ) -> None:
        keys = keys_for(ns, 2)
        self._store(client, arena, keys[:1])
        first, second = client.reserve(keys)
        assert first is None  # already there
        assert second is not None
        client.abort([second])

    def test_abort_stores_nothing_and_frees_the_slot(
        self, client: TierClient, arena: ArenaMemory, ns: bytes
    ) -> None:
        keys = keys_for(ns, 2)
        refs = self._write(arena, client.reserve(keys))
        client.abort(refs)
        assert client.lookup(keys).hits == 0
        assert client.commit(refs) == 0  # what was aborted cannot be committed
        self._store(client, arena, keys)  # and may be reserved again
        assert client.lookup(keys).hits == 2

    def test_commit_again_counts_once(
        self, client: TierClient, arena: ArenaMemory, ns: bytes
    ) -> None:
        refs = self._write(arena, client.reserve(keys_for(ns, 2)))
        assert client.commit(refs) == 2
        assert client.commit(refs) == 0
        client.abort(refs)  # nothing held: does nothing
        assert client.lookup([r.key for r in refs]).hits == 2

    def test_reserve_with_commit_in_one_call(
        self, client: TierClient, arena: ArenaMemory, ns: bytes
    ) -> None:
        first, second = keys_for(ns, 2), keys_for(ns, 2, start=2)
        refs = self._write(arena, client.reserve(first))
        committed, more = client.reserve(second, commit=refs)
        assert committed == 2
        assert all(more)
        assert client.commit(self._write(arena, more)) == 2
        assert client.lookup(first + second).hits == 4

    # -- lease, release -------------------------------------------------------------------

    def test_a_leased_chunk_stays_in_the_arena_until_released(
        self,
        client: TierClient,
        arena: ArenaMemory,
        ns: bytes,
        evict_arena: Callable[[], None],
    ) -> None:
        keys = keys_for(ns, 2)
        self._store(client, arena, keys)
        leases = [r for r in client.lease(keys[:1]) if r is not None]
        assert len(leases) == 1
        evict_arena()
        assert client.lookup(keys).tiers == ["cpu", "lmdb"]
        assert self._read(arena, leases[0]) == payload_for(keys[0], CHUNK)
        client.release(leases)
        client.release(leases)  # a release sent again ends nothing more
        evict_arena()
        assert client.lookup(keys).tiers == ["lmdb", "lmdb"]

    def test_lookup_with_release_and_lease_in_one_call(
        self, client: TierClient, arena: ArenaMemory, ns: bytes
    ) -> None:
        keys = keys_for(ns, 3)
        self._store(client, arena, keys)
        leases = [r for r in client.lease(keys[:1]) if r is not None]
        found, refs = client.lookup(keys, release=leases, lease=True)
        assert found.hits == 3
        assert [r.key for r in refs if r is not None] == keys  # the arena holds them all
        again = client.lease(keys[:2], release=[r for r in refs if r is not None])
        assert [r.key for r in again if r is not None] == keys[:2]
        client.release([r for r in again if r is not None])

    @pytest.mark.parametrize("in_lmdb", [False, True], ids=["arena-only", "lmdb-read"])
    def test_a_hit_lmdb_holds_part_of_is_leased_in_the_same_call_only_where_lmdb_is_read(
        self,
        client: TierClient,
        arena: ArenaMemory,
        ns: bytes,
        evict_arena: Callable[[], None],
        in_lmdb: bool,
    ) -> None:
        keys = keys_for(ns, 3)
        self._store(client, arena, keys[:1])
        evict_arena()
        self._store(client, arena, keys[1:2])
        found, refs = client.lookup(keys, lease=True, in_lmdb=in_lmdb)
        assert (found.hits, found.tiers) == (2, ["lmdb", "cpu"])
        leased = [r for r in refs if r is not None]
        if not in_lmdb:
            assert leased == [], "the arena holds part of the hit: nothing is leased"
            return
        assert [(r.key, in_lmdb_ref(r)) for r in leased] == [(keys[0], True), (keys[1], False)]
        assert client.lookup(keys).tiers == ["lmdb", "cpu"], "read from lmdb: not promoted"
        client.release(leased)

    # -- promote ----------------------------------------------------------------------------

    def test_promote_brings_lmdb_chunks_back_to_the_arena(
        self,
        client: TierClient,
        arena: ArenaMemory,
        ns: bytes,
        evict_arena: Callable[[], None],
    ) -> None:
        keys = keys_for(ns, 3)
        self._store(client, arena, keys)
        evict_arena()
        assert client.lookup(keys).tiers == ["lmdb"] * 3
        assert client.promote(keys) == 3
        deadline = time.monotonic() + PROMOTE_TIMEOUT_S
        while client.lookup(keys).tiers != ["cpu"] * 3:
            assert time.monotonic() < deadline, "not promoted"
            time.sleep(0.05)
        assert client.promote(keys) == 0  # already there
        leases = [r for r in client.lease(keys) if r is not None]
        assert [self._read(arena, r) for r in leases] == [payload_for(k, CHUNK) for k in keys]
        client.release(leases)

    # -- events -----------------------------------------------------------------------------

    def test_chunk_events_tell_what_entered_and_left_the_tiers(
        self,
        client: TierClient,
        arena: ArenaMemory,
        ns: bytes,
        evict_arena: Callable[[], None],
    ) -> None:
        keys = keys_for(ns, 2)
        start = client.chunk_events(-1).result()
        self._store(client, arena, keys)
        evict_arena()
        found = client.chunk_events(start.cursor).result()
        events = [(e.stored, e.tier, e.key) for e in found.events]
        entered_and_left = ((True, "cpu"), (True, "lmdb"), (False, "cpu"))
        assert sorted(events) == sorted((s, t, k) for k in keys for s, t in entered_and_left)
        assert found.lost == 0
        assert client.chunk_events(found.cursor).result().events == []

    # -- namespaces -------------------------------------------------------------------------

    @pytest.mark.parametrize("where", ["first", "last"])
    @pytest.mark.parametrize("call", BATCH_CALLS)
    def test_every_namespace_of_a_batch_is_checked(
        self,
        client: TierClient,
        arena: ArenaMemory,
        ns: bytes,
        foreign: Foreign,
        call: str,
        where: str,
    ) -> None:
        namespace, refused = foreign
        own, theirs = keys_for(ns, 2), keys_for(namespace, 1)
        self._store(client, arena, own[:1])
        batch = theirs + own if where == "first" else own + theirs
        calls: dict[str, Callable[[], object]] = {
            "lookup": lambda: client.lookup(batch),
            "reserve": lambda: client.reserve(batch),
            "lease": lambda: client.lease(batch),
            "promote": lambda: client.promote(batch),
            "leasing_lookup": lambda: client.lookup(batch, lease=True),
        }
        with pytest.raises(refused, match=namespace.hex()):
            calls[call]()
        # a refused batch changed nothing: the own key is still free to reserve
        (ref,) = client.reserve(own[1:])
        assert ref is not None
        client.abort([ref])
