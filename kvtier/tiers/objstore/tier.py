"""The object tier: chunks in S3, GCS or a shared filesystem, shared by every node.

Object names are ``prefix/tenant/namespace/hash[:2]/hash``, named after the first chunk they hold.
An object is one chunk, or a pack of consecutive chunks of one prefix written back to back in the
chunk format, each with its own verified header; the format version, chunk count and an xxh3-128
of the whole body are also in the object's metadata, with the node that uploaded it. Every read
is verified: a corrupt object is deleted, counted and answered as a miss.

A node owns the objects it uploaded, and only those: its budget (`budget.StoreBudget`) counts and
evicts them, its uploads are exclusive (a writer never replaces another's object), and objects
it learned of from the store are knowledge it may forget, never delete to make room.

Requests go through `RequestGuard` (retries, backoff, breaker). A broken identity or an open
breaker makes the tier unhealthy: it answers misses until a trial request succeeds.

This module holds the uploads and the tier's contract; the tier holds its other parts, each
given what it needs: `health.StoreHealth`, `reads.ObjectReads`, `lineage.Lineage`,
`orphans.Orphans`, `pins.FleetPins` and `budget.StoreBudget`, with names from `naming`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence

import xxhash

from kvtier.core import blockfmt
from kvtier.core.config import ObjectStoreConfig
from kvtier.core.counters import Counters
from kvtier.core.errors import ObjectStoreError
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.kvcodec import Codec
from kvtier.core.pools import PoolRegistry
from kvtier.core.priority import enter_background
from kvtier.core.protocol import TierCode, TierStats, UsageStats
from kvtier.tiers.base import Tier
from kvtier.tiers.objstore import naming
from kvtier.tiers.objstore.backend import ObjectBackend, ObjectExistsError, open_backend
from kvtier.tiers.objstore.budget import Reservation, StoreBudget
from kvtier.tiers.objstore.health import StoreHealth, refuse_static_keys
from kvtier.tiers.objstore.index import REMOTE_REPLICA as REMOTE_REPLICA
from kvtier.tiers.objstore.index import ChunkLocation, IndexWriteError, ObjectIndex
from kvtier.tiers.objstore.lineage import Announcer, Lineage
from kvtier.tiers.objstore.naming import COMPANION_SUFFIX as COMPANION_SUFFIX
from kvtier.tiers.objstore.naming import META_NODE as META_NODE
from kvtier.tiers.objstore.orphans import Orphans
from kvtier.tiers.objstore.pins import PINS_DIR as PINS_DIR
from kvtier.tiers.objstore.pins import FleetPins
from kvtier.tiers.objstore.reads import FetchedChunk as FetchedChunk
from kvtier.tiers.objstore.reads import ObjectReads
from kvtier.tiers.objstore.resilience import CircuitBreaker, RequestGuard

log = logging.getLogger(__name__)

META_FORMAT = "kvtier-format"
META_CHUNKS = "kvtier-chunks"
META_CHECKSUM = "kvtier-xxh3-128"


class ObjectTier(Tier):
    """The tier over its parts: the guarded backend, the index, the store's health, reads,
    lineage, orphans, the fleet's pins and this node's budget. A thread of its own, started
    once they all exist, resolves the identity, sends trials while the store is not sound,
    resolves orphans and publishes pins."""

    name = TierCode.OBJECT.tier
    persistent = True

    def __init__(
        self,
        config: ObjectStoreConfig,
        registry: PoolRegistry,
        backend: ObjectBackend | None = None,
    ) -> None:
        super().__init__(registry)
        if config.url is None and backend is None:
            raise ValueError("the object tier needs object.url")
        self.config = config
        self.backend = backend or open_backend(str(config.url), config.request_timeout_s)
        self.index = ObjectIndex(config.index_path, int(config.index_map_bytes))
        self.counters = Counters()
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_reset_s)
        self.guard = RequestGuard(self.breaker, config.retries, config.backoff_s, self.counters)
        try:
            refuse_static_keys(self.backend, config)
            self.node_id = self.index.node_id(naming.new_node_id)
        except BaseException:
            self._close_index_and_backend()
            raise
        self.health = StoreHealth(self.backend, self.breaker, self.guard)
        self.lineage = Lineage(self.backend, self.guard, self.counters)
        self.reads = ObjectReads(
            config, registry, self.backend, self.guard, self.index, self.lineage, self.counters
        )
        self.orphans = Orphans(
            self.backend, self.guard, self.index, self.reads, self.node_id, self.counters
        )
        self.pins = FleetPins(self.backend, self.guard, self.index, self.node_id)
        limit = int(config.budget_bytes) if config.budget_bytes is not None else None
        self.budget = StoreBudget(
            limit, self.index, self.pins, self.lineage.delete_objects, self.counters
        )
        self._closing = threading.Event()
        self._checker = threading.Thread(
            target=self._check_loop, name="kvtier-object-check", daemon=True
        )
        self._checker.start()

    def _check_loop(self) -> None:
        """Resolves the identity, then sends trials while the store is not sound; on its own
        thread, so a slow identity or store never holds up a caller."""
        enter_background()
        self.health.resolve_principal()
        interval = max(0.05, min(1.0, self.config.breaker_reset_s / 4))
        while not self._closing.wait(interval):
            try:
                if self.health.check() and self.index.intents.orphans:
                    self.orphans.resolve()
                if self.pins.due():
                    self.publish_pins()
            except Exception:  # never let the checker die silently
                if self._closing.is_set():
                    return  # the backend was closed under a trial
                log.exception("object store check failed")

    # -- health and naming (`health.StoreHealth`, `naming`) ---------------------------------

    @property
    def healthy(self) -> bool:
        """Whether the store is counted on (`StoreHealth.healthy`)."""
        return self.health.healthy

    @property
    def principal(self) -> str:
        return self.health.principal

    @property
    def principal_resolved(self) -> threading.Event:
        return self.health.principal_resolved

    def check(self) -> bool:
        """Send a trial request unless the store is sound (`StoreHealth.check`)."""
        return self.health.check()

    def object_name(self, key: ChunkKey) -> str:
        return naming.object_name(self.registry, key)

    key_of = staticmethod(naming.key_of)

    @property
    def events(self) -> Announcer | None:
        """Who hears of objects stored and removed (`lineage.Lineage.events`)."""
        return self.lineage.events

    @events.setter
    def events(self, events: Announcer | None) -> None:
        self.lineage.events = events

    # -- writes ---------------------------------------------------------------------------

    def put(self, key: ChunkKey, payload: memoryview | bytes, replica: str = "default") -> bool:
        return self.put_pack([(key, payload)], replica) == 1

    def put_pack(
        self, items: Sequence[tuple[ChunkKey, memoryview | bytes]], replica: str = "default"
    ) -> int:
        """Upload chunks as one object; returns how many are now in the store (0 on failure,
        counted). Chunks already indexed are skipped."""
        regs = [self._check_payload(key, len(payload)) for key, payload in items]
        todo = [
            (key, payload, reg)
            for (key, payload), reg in zip(items, regs, strict=True)
            if key not in self.index
        ]
        if not todo:
            return len(items)
        codec = self.config.codec
        body = bytearray(
            sum(reg.descriptor.stored_size(len(payload), codec) for _, payload, reg in todo)
        )
        offset = 0
        coded: list[ChunkKey] = []
        for key, payload, reg in todo:
            written = blockfmt.encode_into(
                memoryview(body)[offset:], key, reg.descriptor, payload, codec=codec
            )
            if written is None:  # a value no code stands for: not stored
                self.counters.add("codec_refused", 1)
                continue
            offset += written
            coded.append(key)
        done = self.put_encoded(coded, memoryview(body)[:offset], replica)
        return len(items) - (len(todo) - len(coded)) if done else 0

    def in_store_codec(self, key: ChunkKey, encoded: memoryview) -> memoryview | bytes | None:
        """An encoded chunk as this store keeps it (``object.codec``): ``encoded`` itself where
        it already is, else stored again in that codec; None where it cannot be coded."""
        head = blockfmt.peek_header(encoded)
        reg = self.registry.resolve(key)
        if head.codec is reg.descriptor.codec_for(reg.chunk_bytes, self.config.codec):
            return encoded
        return blockfmt.recode(encoded, key, self.config.codec)

    def put_encoded(self, keys: Sequence[ChunkKey], body: memoryview, replica: str) -> int:
        """Upload chunks already in the chunk format, back to back in ``body``, as one object
        named after the first; returns how many are now in the store (0 on failure).

        The upload is exclusive: when another node wrote an object of that name first (the same
        first chunk, maybe another tail), the race is lost, not failed: its object is read and
        indexed, and the chunks it lacks go up as an object named after the first of them."""
        if not keys:
            return 0
        locations, coded = self._locations(keys, body, self.object_name(keys[0]), replica)
        reservation = self.budget.reserve(len(body))
        if reservation is None:
            self.counters.add("store_rejected", len(keys))
            return 0
        with reservation:  # settled by the index write, else released here
            won = self._upload(keys, body, locations, coded, reservation)
        if won is None:
            return 0
        if won:
            return len(keys)
        return self._after_lost_race(keys, body, locations, replica)

    def _locations(
        self, keys: Sequence[ChunkKey], body: memoryview, name: str, replica: str
    ) -> tuple[list[tuple[ChunkKey, ChunkLocation]], bool]:
        """Where each chunk lies in ``body``, checked; and whether any is coded."""
        locations: list[tuple[ChunkKey, ChunkLocation]] = []
        offset = 0
        coded = False
        for key in keys:
            reg = self.registry.resolve(key)
            head = blockfmt.peek_header(body[offset:])
            if head.key != key:
                raise ValueError(f"the chunk at {offset} of the body is not {key.hex()}")
            coded = coded or head.codec is not Codec.NONE
            length = head.encoded_len
            locations.append((key, ChunkLocation(name, offset, length, reg.pool, replica)))
            offset += length
        if offset != len(body):
            raise ValueError(f"body of {len(body)} bytes, {len(keys)} chunks need {offset}")
        return locations, coded

    def _upload(
        self,
        keys: Sequence[ChunkKey],
        body: memoryview,
        locations: list[tuple[ChunkKey, ChunkLocation]],
        coded: bool,
        reservation: Reservation,
    ) -> bool | None:
        """Put the object and index it as this node's: True when done, False when another
        writer had the name, None on failure (counted; nothing of ours is left unindexed)."""
        name = locations[0][1].obj
        metadata = {
            META_FORMAT: str(blockfmt.CODED_VERSION if coded else blockfmt.VERSION),
            META_CHUNKS: str(len(keys)),
            META_CHECKSUM: xxhash.xxh3_128_hexdigest(body),
            META_NODE: self.node_id,
        }
        if not self.index.intents.record(name, len(body)):  # a stop before the index write: a trace
            self.counters.add("intents_unrecorded", 1)
        started = time.perf_counter()
        try:
            if not self._put_new(name, body, metadata):
                self.index.intents.settle(name)  # not written by this node
                self.counters.add("upload_races_lost", 1)
                return False
        except ObjectStoreError as exc:  # maybe written: counted until resolved
            self.index.intents.orphaned(name, len(body))
            self.counters.add("store_errors", len(keys))
            log.warning("upload of %s failed: %s", name, exc)
            return None
        # only once the name is ours: no node's lineage ever lies beside another's object
        companion = self.lineage.write(name, keys)
        self.counters.add("upload_seconds_us", int((time.perf_counter() - started) * 1e6))
        self.counters.add("upload_bytes", len(body))
        self.counters.add("objects_uploaded", 1)
        try:
            # its lineage beside it is this node's too: counted and evicted with it
            size = len(body) + (len(companion) if companion is not None else 0)
            reservation.settle(lambda: self.index.add(name, size, locations, owned=True))
            self.index.intents.settle(name)
        except IndexWriteError as exc:  # an own object no index names would leak: remove it
            log.error("%s; removing the object just uploaded", exc)
            self.counters.add("index_full", 1)
            self.counters.add("store_errors", len(keys))
            self.orphans.withdraw(name, companion is not None)
            return None
        self.counters.add("stores", len(keys))
        if companion is not None and self.events is not None:
            self.events.stored(companion)
        if not self.index.pins.isdisjoint(keys):
            self.pins.dirty.set()  # the check loop names the new object in this node's pins
        return True

    def _put_new(self, name: str, body: bytes | memoryview, metadata: dict[str, str]) -> bool:
        """An exclusive put; False when the name was taken."""
        try:
            self.guard.call(lambda: self.backend.put(name, body, metadata, exclusive=True))
        except ObjectExistsError:
            return False
        return True

    def _after_lost_race(
        self,
        keys: Sequence[ChunkKey],
        body: memoryview,
        locations: list[tuple[ChunkKey, ChunkLocation]],
        replica: str,
    ) -> int:
        """Serve what the winner's object holds from it, and upload the rest named after its
        own first chunk (a lookup that found the winner's chunks probes there next)."""
        name = locations[0][1].obj
        try:
            self.fetch(name, hits=False)  # verified, indexed as learned; a corrupt one deleted
        except ObjectStoreError as exc:
            self.counters.add("store_errors", len(keys))
            log.warning("reading %s, written first by another node, failed: %s", name, exc)
            return 0
        self.orphans.claim_if_own(name)
        rest = [(key, loc) for key, loc in locations[1:] if key not in self.index]
        if rest:
            tail = b"".join(body[loc.offset : loc.offset + loc.length] for _, loc in rest)
            self.put_encoded([key for key, _ in rest], memoryview(tail), replica)
        return sum(key in self.index for key in keys)

    def delete_objects(self, names: Sequence[str]) -> bool:
        """Delete objects with their companions, and announce what left (`Lineage`)."""
        return self.lineage.delete_objects(names)

    # -- reads (`reads.ObjectReads`) -------------------------------------------------------

    def read_into(self, key: ChunkKey, dst: memoryview) -> bool:
        return self.reads.read_into(key, dst)

    def fetch(self, name: str, hits: bool = True) -> list[FetchedChunk] | None:
        """A whole object, verified (`ObjectReads.fetch`)."""
        return self.reads.fetch(name, hits)

    def remember(
        self, name: str, size: int, locations: Sequence[tuple[ChunkKey, ChunkLocation]]
    ) -> bool:
        """Index an object learned from the store (`ObjectReads.remember`)."""
        return self.reads.remember(name, size, locations)

    def probe(self, key: ChunkKey) -> list[FetchedChunk] | None:
        """Look for an object another node uploaded that starts with ``key``."""
        self.counters.add("probes", 1)
        return self.fetch(self.object_name(key))

    def quarantine(self, name: str, reason: Exception) -> None:
        self.reads.quarantine(name, reason)

    # -- the rest of the contract ---------------------------------------------------------

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        chunks = self.index.chunks
        return [key in chunks for key in keys]

    def __contains__(self, key: object) -> bool:
        return key in self.index.chunks

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Forget chunks; objects of this node's left holding none are deleted from the store,
        other nodes' only forgotten (gc deletes them)."""
        present = [k for k in keys if k in self.index]
        owned = {name for name, entry in self.index.objects.items() if entry.owned}
        emptied = self.index.drop_keys(present)
        self.delete_objects([name for name in emptied if name in owned])
        return len(present)

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        self.index.set_pinned(keys, True)
        self.publish_pins()

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        self.index.set_pinned(keys, False)
        self.publish_pins()

    # -- pins the whole fleet sees (`pins.FleetPins`) ---------------------------------------

    @property
    def pins_name(self) -> str:
        return self.pins.name

    def publish_pins(self) -> bool:
        return self.pins.publish()

    def namespace_chunks(self) -> Counter[bytes]:
        """Chunks the index knows per namespace."""
        return Counter(namespace_of(k) for k in list(self.index.chunks))

    def evict(
        self, *, pool: str | None = None, namespace: bytes | None = None, replica: str | None = None
    ) -> int:
        victims = [
            key
            for key, loc in list(self.index.chunks.items())
            if key not in self.index.pins
            and (pool is None or loc.pool == pool)
            and (namespace is None or namespace_of(key) == namespace)
            and (replica is None or loc.replica == replica)
        ]
        n = self.delete(victims)
        self.counters.add("evictions_admin", n)
        return n

    def corrupt_chunks(self) -> int:
        return self.counters.snapshot()["corrupt"]  # stats() walks the whole index

    def stats(self) -> TierStats:
        """Usage counts the chunks of the objects this node owns, as its budget does; those of
        objects it only learned of are apart (``learned``)."""
        pools: dict[str, UsageStats] = {}
        replicas: dict[tuple[str, str], UsageStats] = {}
        learned: dict[str, UsageStats] = {}
        objects = self.index.objects
        for loc in list(self.index.chunks.values()):
            entry = objects.get(loc.obj)
            usages: tuple[UsageStats, ...]
            if entry is not None and entry.owned:
                usages = (
                    pools.setdefault(loc.pool, UsageStats()),
                    replicas.setdefault((loc.replica, loc.pool), UsageStats()),
                )
            else:
                usages = (learned.setdefault(loc.pool, UsageStats()),)
            for usage in usages:
                usage.chunks += 1
                usage.used_bytes += loc.length
        counters = self.counters.snapshot()
        counters["healthy"] = int(self.healthy)
        return TierStats(
            tier=self.name,
            capacity_bytes=self.budget.limit or 0,
            used_bytes=sum(u.used_bytes for u in pools.values()),
            chunks=sum(u.chunks for u in pools.values()),
            pools=pools,
            replicas=replicas,
            counters=counters,
            learned=learned,
        )

    def close(self) -> None:
        self._closing.set()
        self._checker.join(1.0)  # a trial still out ends with the closed backend
        self._close_index_and_backend()

    def _close_index_and_backend(self) -> None:
        self.index.close()
        self.backend.close()
