"""Work on the whole store behind an object tier: rebuild the index from a listing, download a
namespace's objects, and delete objects past their retention (gc), with what uploads and nodes
leave behind: lineage companions whose object is gone, a filesystem store's temporary files, and
the pins of nodes that stopped rewriting them.

Each operation is a generator of its progress, so a caller can stream it; every yield hands out
the same mutable counters object, to be read before the next step. Only objects whose names
kvtier writes are touched; anything else under the prefix is left alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from kvtier.core import blockfmt
from kvtier.core.errors import (
    ChunkFormatError,
    CorruptChunkError,
    ObjectNotFoundError,
    ObjectStoreError,
    UnknownVersionError,
)
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.priority import enter_background
from kvtier.tiers.objstore.backend import ObjectInfo
from kvtier.tiers.objstore.index import ChunkLocation
from kvtier.tiers.objstore.pins import DEAD_AFTER_S
from kvtier.tiers.objstore.tier import COMPANION_SUFFIX, REMOTE_REPLICA, FetchedChunk, ObjectTier

log = logging.getLogger(__name__)

PROGRESS_EVERY = 256
"""Objects listed or handled between two progress reports."""
DELETE_BATCH = 256
"""Names per delete request (S3 takes up to 1000)."""

T = TypeVar("T")
R = TypeVar("R")


class Outcome(Enum):
    DONE = "done"
    CORRUPT = "corrupt"
    UNKNOWN_FORMAT = "unknown_format"
    FAILED = "failed"
    GONE = "gone"
    SKIPPED = "skipped"


@dataclass(slots=True)
class WarmupCounts:
    phase: str = ""
    """One of "list", "index" and "fetch"."""
    listed: int = 0
    checked: int = 0
    """Objects the current phase has handled, of ``total``."""
    total: int = 0
    indexed: int = 0
    chunks_indexed: int = 0
    corrupt: int = 0
    unknown_format: int = 0
    """Objects in a chunk format this build does not read: left alone."""
    failed: int = 0
    fetched: int = 0
    chunks_fetched: int = 0


@dataclass(slots=True)
class GcCounts:
    retention_s: float
    dry_run: bool
    listed: int = 0
    checked: int = 0
    total: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    pinned: int = 0
    failed: int = 0
    leftovers: int = 0
    """Lone lineage companions, temporary files and dead nodes' pins deleted (or, in a dry
    run, found: temporary files are not counted then)."""
    done: bool = False


def _bounded_map(
    fn: Callable[[T], R], items: Iterable[T], concurrency: int
) -> Iterator[tuple[T, R]]:
    """``fn`` over ``items`` on a few threads, results in completion order; no more than
    twice ``concurrency`` submitted at once, so millions of objects do not sit in futures."""
    pool = ThreadPoolExecutor(max(1, concurrency), "kvtier-catalog", initializer=enter_background)
    pending: dict[Future[R], T] = {}
    try:
        for item in items:
            pending[pool.submit(fn, item)] = item
            while len(pending) >= 2 * concurrency:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    yield pending.pop(future), future.result()
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                yield pending.pop(future), future.result()
    finally:  # a cancelled stream stops here: drop what has not started
        pool.shutdown(wait=True, cancel_futures=True)


class Catalog:
    def __init__(self, tier: ObjectTier) -> None:
        self.tier = tier
        self.concurrency = tier.config.download_concurrency

    # -- listing --------------------------------------------------------------------------

    def _list(
        self,
        counts: WarmupCounts | GcCounts,
        into: list[ObjectInfo],
        companions: list[ObjectInfo] | None = None,
    ) -> Iterator[None]:
        """Append kvtier's objects to ``into`` (and lineage companions to ``companions``),
        yielding now and then to report ``listed``."""
        for info in self.tier.backend.list():
            counts.listed += 1
            if ObjectTier.key_of(info.name) is not None:
                into.append(info)
            elif (
                companions is not None
                and info.name.endswith(COMPANION_SUFFIX)
                and ObjectTier.key_of(info.name.removesuffix(COMPANION_SUFFIX)) is not None
            ):
                companions.append(info)
            if counts.listed % PROGRESS_EVERY == 0:
                yield

    # -- index ----------------------------------------------------------------------------

    def rebuild_index(self, counts: WarmupCounts | None = None) -> Iterator[WarmupCounts]:
        """Index every object of the store not indexed yet, reading only its chunk headers."""
        counts = WarmupCounts() if counts is None else counts
        counts.phase = "list"
        objects: list[ObjectInfo] = []
        for _ in self._list(counts, objects):
            yield counts
        known = self.tier.index.objects
        todo = [info for info in objects if info.name not in known]
        counts.phase, counts.checked, counts.total = "index", 0, len(todo)
        yield counts
        for info, (outcome, chunks) in _bounded_map(self._index_one, todo, self.concurrency):
            counts.checked += 1
            if outcome is Outcome.DONE:
                counts.indexed += 1
                counts.chunks_indexed += chunks
            elif outcome is Outcome.CORRUPT:
                counts.corrupt += 1
            elif outcome is Outcome.UNKNOWN_FORMAT:
                counts.unknown_format += 1
            elif outcome is Outcome.FAILED:
                counts.failed += 1
                log.warning("could not index %s now; a later warmup retries it", info.name)
            if counts.checked % PROGRESS_EVERY == 0 and counts.checked < counts.total:
                yield counts
        yield counts

    def _peek(self, name: str, offset: int) -> blockfmt.PeekedHeader:
        tier = self.tier
        raw = tier.guard.call(
            lambda: tier.backend.get(name, offset, blockfmt.HEADER_SIZE),
            tier.config.request_timeout_s,
        )
        return blockfmt.peek_header(raw)

    def _index_one(self, info: ObjectInfo) -> tuple[Outcome, int]:
        name, size = info.name, info.size
        first = ObjectTier.key_of(name)
        assert first is not None
        try:
            head = self._peek(name, 0)
            if head.key != first:
                raise CorruptChunkError(
                    "the object does not start with the chunk it is named after"
                )
            length = head.encoded_len
            # one namespace per object, hence one chunk length: n = size / length
            if size % length:
                raise CorruptChunkError(
                    f"{size} bytes is not a whole number of {length}-byte chunks"
                )
            reg = self.tier.registry.get(namespace_of(first))
            expected = (
                None if reg is None else reg.descriptor.stored_size(reg.chunk_bytes, head.codec)
            )
            if expected is not None and length != expected:
                raise CorruptChunkError(
                    f"chunks of {length} bytes, the pool's are {expected} ({head.codec})"
                )
            locations = [(head.key, ChunkLocation(name, 0, length, str(head.pool), REMOTE_REPLICA))]
            for offset in range(length, size, length):
                other = self._peek(name, offset)
                if other.encoded_len != length or namespace_of(other.key) != namespace_of(first):
                    raise CorruptChunkError(f"the chunk at {offset} belongs to another namespace")
                locations.append(
                    (
                        other.key,
                        ChunkLocation(name, offset, length, str(other.pool), REMOTE_REPLICA),
                    )
                )
        except ObjectNotFoundError:
            return Outcome.GONE, 0  # deleted since the listing
        except ObjectStoreError as exc:
            log.debug("reading headers of %s failed: %s", name, exc)
            return Outcome.FAILED, 0
        except UnknownVersionError as exc:  # a newer node's: not ours to judge
            log.info("object %s: %s; left in the store", name, exc)
            self.tier.counters.add("unknown_format", 1)
            return Outcome.UNKNOWN_FORMAT, 0
        except ChunkFormatError as exc:
            return self._corrupt(info, exc), 0
        if not self.tier.remember(name, size, locations):
            return Outcome.FAILED, 0
        return Outcome.DONE, len(locations)

    def _corrupt(self, info: ObjectInfo, reason: Exception) -> Outcome:
        """Quarantine an object whose headers did not add up, unless it was rewritten since the
        listing (then what was read mixes two versions and proves nothing)."""
        tier = self.tier
        try:
            now = tier.guard.call(lambda: tier.backend.head(info.name))
        except ObjectStoreError:
            return Outcome.FAILED
        if now is None:
            return Outcome.GONE
        if now.size != info.size or now.modified != info.modified:
            return Outcome.FAILED
        tier.quarantine(info.name, reason)
        return Outcome.CORRUPT

    # -- fetch ----------------------------------------------------------------------------

    def objects_of(self, namespaces: Iterable[bytes]) -> list[str]:
        """Indexed objects holding chunks of ``namespaces``."""
        wanted = set(namespaces)
        return sorted(
            name
            for name in list(self.tier.index.objects)
            if (key := ObjectTier.key_of(name)) is not None and namespace_of(key) in wanted
        )

    def fetch(
        self,
        names: Sequence[str],
        keep: Callable[[Sequence[FetchedChunk]], object],
        local: Callable[[ChunkKey], bool],
        counts: WarmupCounts | None = None,
    ) -> Iterator[WarmupCounts]:
        """Download and verify whole objects, handing their chunks to ``keep``; objects whose
        chunks are all ``local`` already are skipped."""
        counts = WarmupCounts() if counts is None else counts
        counts.phase, counts.checked, counts.total = "fetch", 0, len(names)
        yield counts

        def one(name: str) -> tuple[Outcome, int]:
            entry = self.tier.index.objects.get(name)
            if entry is not None and entry.keys and all(map(local, list(entry.keys))):
                return Outcome.SKIPPED, 0
            try:
                chunks = self.tier.fetch(name)
            except ObjectStoreError as exc:
                log.debug("download of %s failed: %s", name, exc)
                return Outcome.FAILED, 0
            if chunks is None:  # gone, or corrupt and quarantined by fetch
                return Outcome.GONE, 0
            keep(chunks)
            return Outcome.DONE, len(chunks)

        for _name, (outcome, chunks) in _bounded_map(one, names, self.concurrency):
            counts.checked += 1
            if outcome is Outcome.DONE:
                counts.fetched += 1
                counts.chunks_fetched += chunks
            elif outcome in (Outcome.FAILED, Outcome.GONE):
                counts.failed += 1
            if counts.checked % PROGRESS_EVERY == 0 and counts.checked < counts.total:
                yield counts
        yield counts

    # -- gc -------------------------------------------------------------------------------

    def gc(
        self, retention_s: float, dry_run: bool = False, now: float | None = None
    ) -> Iterator[GcCounts]:
        """Delete objects last written more than ``retention_s`` ago, except those holding
        chunks pinned by any live node (each node publishes its pins in the store), and forget
        them in the index; then the leftovers past the retention (`_leftovers`). Pins that
        cannot all be read stop gc before it deletes anything."""
        counts = GcCounts(retention_s, dry_run)
        now = time.time() if now is None else now
        cutoff = now - retention_s
        objects: list[ObjectInfo] = []
        companions: list[ObjectInfo] = []
        for _ in self._list(counts, objects, companions):
            yield counts
        counts.total = len(objects)
        yield counts
        pins = self.tier.pins.read(dead_before=now - max(retention_s, DEAD_AFTER_S))
        pinned_names, pinned_keys = pins.objects, pins.chunks
        batch: list[ObjectInfo] = []
        for info in objects:
            counts.checked += 1
            if info.modified >= cutoff:
                continue
            entry = self.tier.index.objects.get(info.name)
            if (
                info.name in pinned_names
                or ObjectTier.key_of(info.name) in pinned_keys
                or (entry is not None and not pinned_keys.isdisjoint(entry.keys))
            ):
                counts.pinned += 1
                continue
            batch.append(info)
            if len(batch) >= DELETE_BATCH:
                self._delete(batch, counts)
                batch = []
                yield counts
        self._delete(batch, counts)
        self._leftovers(objects, companions, pins.dead, cutoff, counts)
        counts.done = True
        yield counts

    def _leftovers(
        self,
        objects: Sequence[ObjectInfo],
        companions: Sequence[ObjectInfo],
        dead_pins: Sequence[ObjectInfo],
        cutoff: float,
        counts: GcCounts,
    ) -> None:
        """Delete lineage companions of no listed object (an upload that stopped between the
        two puts), the pins of dead nodes, and temporary files of puts cut short: all last
        written before ``cutoff``."""
        listed = {info.name for info in objects}
        doomed = [
            info.name
            for info in companions
            if info.modified < cutoff and info.name.removesuffix(COMPANION_SUFFIX) not in listed
        ]
        doomed += [info.name for info in dead_pins]
        counts.leftovers += len(doomed)
        if counts.dry_run:
            return
        tier = self.tier
        try:
            if doomed:
                tier.guard.call(lambda: tier.backend.delete(doomed))
            swept = tier.backend.sweep_temporaries(cutoff)
        except ObjectStoreError as exc:
            log.warning("gc: deleting what uploads and dead nodes left failed: %s", exc)
            counts.failed += len(doomed)
            return
        counts.leftovers += swept
        tier.counters.add("objects_gc", len(doomed) + swept)
        if doomed or swept:
            log.info(
                "gc: deleted %d lone lineage companions, %d temporary files and the pins of %d "
                "dead nodes",
                len(doomed) - len(dead_pins),
                swept,
                len(dead_pins),
            )

    def _delete(self, batch: Sequence[ObjectInfo], counts: GcCounts) -> None:
        if not batch:
            return
        names = [info.name for info in batch]
        if not counts.dry_run:
            tier = self.tier
            if not tier.delete_objects(names):
                counts.failed += len(names)
                return
            for name in names:
                tier.index.drop_object(name)
            tier.counters.add("objects_gc", len(names))
        counts.deleted += len(names)
        counts.deleted_bytes += sum(info.size for info in batch)
