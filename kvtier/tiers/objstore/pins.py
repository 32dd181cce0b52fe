"""Pins the whole fleet sees: each node writes the chunks it pinned, and the objects its index
knows to hold them, to ``prefix/.kvtier-pins/<node id>``; every node's gc and store budget read
them all before deleting anything.

A node rewrites its document at least every `REFRESH_S` while it holds pins, so a document left
unwritten longer than `DEAD_AFTER_S` (and gc's retention) is a dead node's: it holds nothing, and
gc deletes it.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from dataclasses import dataclass, field

from kvtier.core.errors import ObjectNotFoundError, ObjectStoreError
from kvtier.core.keys import ChunkKey
from kvtier.tiers.objstore.backend import ObjectBackend, ObjectInfo
from kvtier.tiers.objstore.index import ObjectIndex
from kvtier.tiers.objstore.resilience import RequestGuard

log = logging.getLogger("kvtier.tiers.objstore.tier")

PINS_DIR = ".kvtier-pins"
PINS_FORMAT = 1
REFRESH_S = 3600.0
"""A node holding pins rewrites its document this often, unchanged or not: it is alive."""
DEAD_AFTER_S = 4 * REFRESH_S
"""A document not rewritten for this long (and gc's retention) is a dead node's."""
CACHE_S = 30.0
"""How long the store budget trusts the fleet's pins it read."""


@dataclass(slots=True)
class PinSet:
    objects: set[str] = field(default_factory=set)
    chunks: set[ChunkKey] = field(default_factory=set)
    dead: list[ObjectInfo] = field(default_factory=list)
    """Documents of nodes dead by the cutoff given to `FleetPins.read`; their pins are left out."""


class FleetPins:
    def __init__(
        self, backend: ObjectBackend, guard: RequestGuard, index: ObjectIndex, node_id: str
    ) -> None:
        self.backend = backend
        self.guard = guard
        self.index = index
        self.name = f"{PINS_DIR}/{node_id}"
        self.node_id = node_id
        self.dirty = threading.Event()
        self._published_at = 0.0
        self._cached: PinSet | None = None
        self._cached_at = 0.0
        self._lock = threading.Lock()

    def own(self) -> PinSet:
        """This node's pins: chunks, and the objects its index places them in."""
        keys = set(self.index.pins)
        objects = {loc.obj for key in keys if (loc := self.index.get(key)) is not None}
        return PinSet(objects, keys)

    def publish(self) -> bool:
        """Write this node's pins (or delete the document when none are left); retried by the
        check loop until it succeeds."""
        mine = self.own()
        doc = {
            "format": PINS_FORMAT,
            "node": self.node_id,
            "chunks": sorted(key.hex() for key in mine.chunks),
            "objects": sorted(mine.objects),
        }
        body = json.dumps(doc).encode()
        self.dirty.set()
        try:
            if mine.chunks:
                self.guard.call(lambda: self.backend.put(self.name, body, {}))
            else:
                self.guard.call(lambda: self.backend.delete([self.name]))
        except ObjectStoreError as exc:
            log.warning("publishing this node's pins failed (retried): %s", exc)
            return False
        self._published_at = time.monotonic()
        self.dirty.clear()
        return True

    def due(self) -> bool:
        """Whether the check loop should publish: pins changed, or held and not rewritten for
        `REFRESH_S` (a live node's document never looks dead)."""
        if self.dirty.is_set():
            return True
        return bool(self.index.pins) and time.monotonic() - self._published_at >= REFRESH_S

    def read(self, dead_before: float | None = None) -> PinSet:
        """Every node's pins, this one's included. Documents last written before
        ``dead_before`` (Unix seconds) are dead nodes': listed in ``dead``, their pins left
        out. Raises `ObjectStoreError` when a document cannot be read or is in a format this
        build does not know: the caller must then delete nothing."""
        pins = self.own()
        for info in self.guard.call(lambda: list(self.backend.list(PINS_DIR + "/"))):
            if info.name == self.name:
                continue  # this node's: read from the index, current
            if dead_before is not None and info.modified < dead_before:
                pins.dead.append(info)
                continue
            try:
                raw = self.guard.call(functools.partial(self.backend.get, info.name))
            except ObjectNotFoundError:
                continue  # unpinned since the listing
            try:
                doc = json.loads(raw)
                if doc.get("format") != PINS_FORMAT:
                    raise ValueError(f"format {doc.get('format')!r}")
                pins.objects.update(str(n) for n in doc["objects"])
                pins.chunks.update(ChunkKey(bytes.fromhex(k)) for k in doc["chunks"])
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ObjectStoreError(f"pins {info.name} cannot be read: {exc}") from exc
        return pins

    def cached(self) -> PinSet | None:
        """Other nodes' pins as read at most `CACHE_S` ago (read again when older), with this
        node's current ones; None when they cannot be read and were never read."""
        with self._lock:
            if self._cached is None or time.monotonic() - self._cached_at >= CACHE_S:
                try:
                    self._cached = self.read(time.time() - DEAD_AFTER_S)
                    self._cached_at = time.monotonic()
                except ObjectStoreError as exc:
                    log.warning("reading the fleet's pins failed: %s", exc)
                    if self._cached is None:
                        return None
            mine = self.own()
            return PinSet(self._cached.objects | mine.objects, self._cached.chunks | mine.chunks)
