"""The object tier: chunks in S3, GCS or a shared filesystem, shared by every node.

Object names are ``prefix/tenant/namespace/hash[:2]/hash``, named after the first chunk they hold.
An object is one chunk, or a pack of consecutive chunks of one prefix written back to back in the
chunk format, each with its own verified header; the format version, chunk count and an xxh3-128
of the whole body are also in the object's metadata. Every read is verified: a corrupt object is
deleted, counted and answered as a miss.

Requests go through `RequestGuard` (retries, backoff, breaker). A broken identity or an open
breaker makes the tier unhealthy: it answers misses until a trial request succeeds.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from kvtier.core import blockfmt
from kvtier.core.errors import (
    ChunkFormatError,
    ObjectNotFoundError,
    ObjectStoreError,
    UnknownVersionError,
)
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.kvcodec import Codec
from kvtier.core.protocol import TierCode, TierStats, UsageStats
from kvtier.tiers.objstore.index import ChunkLocation
from kvtier.tiers.objstore.store import ObjectStore

log = logging.getLogger(__name__)

META_FORMAT = "kvtier-format"
META_CHUNKS = "kvtier-chunks"
META_CHECKSUM = "kvtier-xxh3-128"
REMOTE_REPLICA = "remote"
"""Owner recorded for chunks found in the store rather than uploaded from here."""
PINS_DIR = ".kvtier-pins"
"""Under the prefix: one object per node naming what it pinned, read by every node's gc."""
PINS_FORMAT = 1
COMPANION_SUFFIX = ".lineage"
"""Beside an object: its chunks' lineage, for the announcement of its deletion; a name no listing
mistakes for a chunk's (`ObjectStore.key_of`)."""


class Announcer(Protocol):
    """Tells routers what the store holds (`kvtier.fleet.shared_tier.SharedTierEvents`)."""

    def companion(self, keys: Sequence[ChunkKey]) -> bytes | None: ...
    def stored(self, companion: bytes) -> None: ...
    def removed(self, companion: bytes) -> None: ...


@dataclass(frozen=True, slots=True)
class FetchedChunk:
    key: ChunkKey
    payload: memoryview
    """Verified; valid as long as the fetched object's buffer is referenced."""


class ObjectTier(ObjectStore):
    name = TierCode.OBJECT.tier
    persistent = True
    events: Announcer | None = None

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
        named after the first; returns how many are now in the store (0 on failure)."""
        if not keys:
            return 0
        name = self.object_name(keys[0])
        locations: list[tuple[ChunkKey, ChunkLocation]] = []
        offset = 0
        version = blockfmt.VERSION
        for key in keys:
            reg = self.registry.resolve(key)
            head = blockfmt.peek_header(body[offset:])
            if head.key != key:
                raise ValueError(f"the chunk at {offset} of the body is not {key.hex()}")
            length = head.encoded_len
            if head.codec is not Codec.NONE:
                version = blockfmt.CODED_VERSION
            locations.append((key, ChunkLocation(name, offset, length, reg.pool, replica)))
            offset += length
        if offset != len(body):
            raise ValueError(f"body of {len(body)} bytes, {len(keys)} chunks need {offset}")
        if not self._make_room(len(body)):
            self.counters.add("store_rejected", len(keys))
            return 0
        metadata = {
            META_FORMAT: str(version),
            META_CHUNKS: str(len(keys)),
            META_CHECKSUM: xxhash.xxh3_128_hexdigest(body),
        }
        companion = self.events.companion(keys) if self.events is not None else None
        started = time.perf_counter()
        try:
            if companion is not None:  # first: a listed object always has its lineage
                self.guard.call(lambda: self.backend.put(name + COMPANION_SUFFIX, companion, {}))
            self.guard.call(lambda: self.backend.put(name, body, metadata))
        except ObjectStoreError as exc:
            self.counters.add("store_errors", len(keys))
            log.warning("upload of %s failed: %s", name, exc)
            return 0
        self.counters.add("upload_seconds_us", int((time.perf_counter() - started) * 1e6))
        self.counters.add("upload_bytes", len(body))
        self.counters.add("objects_uploaded", 1)
        self.index.add(name, len(body), locations)
        self.counters.add("stores", len(keys))
        if companion is not None and self.events is not None:
            self.events.stored(companion)
        if not self.index.pins.isdisjoint(keys):
            self._pins_dirty.set()  # the check loop names the new object in this node's pins
        return len(keys)

    def _make_room(self, incoming: int) -> bool:
        if self.budget is None:
            return True
        if incoming > self.budget:
            return False
        used = self.index.used_bytes()
        if used + incoming <= self.budget:
            return True  # the common case: no need to order every object by age
        for name in self.index.oldest_first():
            if used + incoming <= self.budget:
                break
            if self.index.pinned(name):
                continue
            entry = self.index.objects.get(name)
            if entry is None:
                continue
            if self.delete_objects([name]):
                used -= entry.size
                dropped = self.index.drop_object(name)  # empties entry.keys: count its return
                self.counters.add("evictions_capacity", len(dropped))
        return used + incoming <= self.budget

    def delete_objects(self, names: Sequence[str]) -> bool:
        """Delete objects with their companions, and announce what left; False when the store
        refused (nothing is announced then)."""
        if not names:
            return True
        companions = self._companions(names) if self.events is not None else []
        doomed = [*names, *(n + COMPANION_SUFFIX for n in names)]
        try:
            self.guard.call(lambda: self.backend.delete(doomed))
        except ObjectStoreError as exc:
            log.warning("deleting %d objects failed: %s", len(names), exc)
            return False
        for companion in companions:
            assert self.events is not None
            self.events.removed(companion)
        return True

    def _companions(self, names: Sequence[str]) -> list[bytes]:
        found = []
        for name in names:
            companion = functools.partial(self.backend.get, name + COMPANION_SUFFIX)
            try:
                found.append(self.guard.call(companion))
            except ObjectNotFoundError:
                continue  # uploaded unannounced: nothing to withdraw
            except ObjectStoreError as exc:
                log.warning("lineage of %s unreadable, its removal not announced: %s", name, exc)
                self.counters.add("lineage_unreadable", 1)
        return found

    # -- reads ----------------------------------------------------------------------------

    def read_into(self, key: ChunkKey, dst: memoryview) -> bool:
        loc = self.index.get(key)
        if loc is None:
            self.counters.add("misses", 1)
            return False
        if not self.breaker.admit_peek():  # fail fast while the breaker is open
            self.counters.add("misses", 1)
            self.counters.add("misses_unhealthy", 1)
            return False
        try:
            value = self.guard.call(
                lambda: self.backend.get(loc.obj, loc.offset, loc.length),
                self.config.request_timeout_s,
            )
            blockfmt.decode_into(value, key, dst)
        except ObjectNotFoundError:  # deleted behind our back (gc, another node)
            self.counters.add("misses", 1)
            self.index.drop_object(loc.obj)
            return False
        except ObjectStoreError:
            self.counters.add("misses", 1)
            return False
        except UnknownVersionError as exc:
            self.unknown_format(loc.obj, exc)
            return False
        except ChunkFormatError as exc:
            self.quarantine(loc.obj, exc)
            return False
        self.index.touch(loc.obj)
        self.counters.add("hits", 1)
        self.counters.add("download_bytes", len(value))
        return True

    def fetch(self, name: str) -> list[FetchedChunk] | None:
        """GET a whole object and verify every chunk in it; None when it does not exist or is
        corrupt (then deleted). Indexes what it found. Raises `ObjectStoreError` when the store
        cannot answer."""
        try:
            body = self.guard.call(lambda: self.backend.get(name), self.config.request_timeout_s)
        except ObjectNotFoundError:
            self.index.drop_object(name)
            return None
        try:
            chunks = blockfmt.split(body)
            if not chunks or self.object_name(chunks[0][0]) != name:
                raise ChunkFormatError(f"object {name} does not start with the chunk it names")
            regs = [self._check_payload(key, len(payload)) for key, payload, _ in chunks]
        except UnknownVersionError as exc:
            self.unknown_format(name, exc)
            return None
        except (ChunkFormatError, ValueError, KeyError) as exc:  # incl. a foreign namespace
            self.quarantine(name, exc)
            return None
        self.counters.add("download_bytes", len(body))
        if name not in self.index.objects:
            locations = []
            offset = 0
            for (key, _, length), reg in zip(chunks, regs, strict=True):
                locations.append(
                    (key, ChunkLocation(name, offset, length, reg.pool, REMOTE_REPLICA))
                )
                offset += length
            self.index.add(name, len(body), locations)
        self.index.touch(name)
        self.counters.add("hits", len(chunks))
        return [FetchedChunk(key, payload) for key, payload, _ in chunks]

    def probe(self, key: ChunkKey) -> list[FetchedChunk] | None:
        """Look for an object another node uploaded that starts with ``key``."""
        self.counters.add("probes", 1)
        return self.fetch(self.object_name(key))

    def unknown_format(self, name: str, reason: Exception) -> None:
        """An object in a chunk format this build does not read (a newer node wrote it, in a
        rolling upgrade): a miss, counted, and left in the store for the nodes that read it."""
        log.info("object %s: %s; a miss here, left in the store", name, reason)
        self.counters.add("misses", 1)
        self.counters.add("unknown_format", 1)
        self.index.drop_object(name)

    def quarantine(self, name: str, reason: Exception) -> None:
        log.error("object %s failed verification (%s); deleting it", name, reason)
        self.counters.add("corrupt", 1)
        self.index.drop_object(name)
        self.delete_objects([name])

    # -- the rest of the contract ---------------------------------------------------------

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        chunks = self.index.chunks
        return [key in chunks for key in keys]

    def __contains__(self, key: object) -> bool:
        return key in self.index.chunks

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        present = [k for k in keys if k in self.index]
        emptied = self.index.drop_keys(present)
        self.delete_objects(emptied)
        return len(present)

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        self.index.set_pinned(keys, True)
        self.publish_pins()

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        self.index.set_pinned(keys, False)
        self.publish_pins()

    # -- pins the whole fleet sees ----------------------------------------------------------

    @property
    def pins_name(self) -> str:
        return f"{PINS_DIR}/{self.node_id}"

    def publish_pins(self) -> bool:
        """Write this node's pins (chunk keys, and the objects known to hold them) where every
        node's gc reads them; retried by the check loop until it succeeds."""
        index = self.index
        keys = sorted(index.pins)
        objects = sorted({loc.obj for key in keys if (loc := index.get(key)) is not None})
        doc = {
            "format": PINS_FORMAT,
            "node": self.node_id,
            "chunks": [key.hex() for key in keys],
            "objects": objects,
        }
        body = json.dumps(doc).encode()
        self._pins_dirty.set()
        try:
            if keys:
                self.guard.call(lambda: self.backend.put(self.pins_name, body, {}))
            else:
                self.guard.call(lambda: self.backend.delete([self.pins_name]))
        except ObjectStoreError as exc:
            log.warning("publishing this node's pins failed (retried): %s", exc)
            return False
        self._pins_dirty.clear()
        return True

    def fleet_pins(self) -> tuple[set[str], set[ChunkKey]]:
        """Objects and chunks pinned by any node, this one included. Raises `ObjectStoreError`
        when a node's pins cannot be read or are in a format this build does not know: gc
        must then delete nothing."""
        names: set[str] = set()
        keys: set[ChunkKey] = set(self.index.pins)
        for key in keys:
            loc = self.index.get(key)
            if loc is not None:
                names.add(loc.obj)
        for info in self.guard.call(lambda: list(self.backend.list(PINS_DIR + "/"))):
            try:
                raw = self.guard.call(functools.partial(self.backend.get, info.name))
            except ObjectNotFoundError:
                continue  # unpinned since the listing
            try:
                doc = json.loads(raw)
                if doc.get("format") != PINS_FORMAT:
                    raise ValueError(f"format {doc.get('format')!r}")
                names.update(str(n) for n in doc["objects"])
                keys.update(ChunkKey(bytes.fromhex(k)) for k in doc["chunks"])
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ObjectStoreError(f"pins {info.name} cannot be read: {exc}") from exc
        return names, keys

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

    def stats(self) -> TierStats:
        pools: dict[str, UsageStats] = {}
        replicas: dict[tuple[str, str], UsageStats] = {}
        for loc in list(self.index.chunks.values()):
            for usage in (
                pools.setdefault(loc.pool, UsageStats()),
                replicas.setdefault((loc.replica, loc.pool), UsageStats()),
            ):
                usage.chunks += 1
                usage.used_bytes += loc.length
        counters = self.counters.snapshot()
        counters["healthy"] = int(self.healthy)
        return TierStats(
            tier=self.name,
            capacity_bytes=self.budget or 0,
            used_bytes=sum(u.used_bytes for u in pools.values()),
            chunks=sum(u.chunks for u in pools.values()),
            pools=pools,
            replicas=replicas,
            counters=counters,
        )

    def close(self) -> None:
        closing = getattr(self, "_closing", None)
        if closing is not None:
            closing.set()
            self._checker.join(1.0)  # a trial still out ends with the closed backend
        self.close_index_and_backend()
