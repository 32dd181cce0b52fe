"""The object tier announced to routers: a chunk is stored for the whole fleet once the object
holding it is uploaded, and removed once that object is deleted (gc, capacity, an admin).

Each object gets a companion (`kvtier.tiers.objstore.tier.COMPANION_SUFFIX`), written before
it: the model and the lineage of each chunk it holds (`kvtier.core.lineage.pack`). Whoever
deletes the object, on any node, reads the companion to announce what left, then deletes both.
Chunks committed with no lineage (pools other than the target's, older connectors) are uploaded
unannounced.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.core import lineage
from kvtier.core.config_fleet import EventsConfig
from kvtier.core.counters import Counters
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.core.pools import PoolRegistry
from kvtier.fleet import kv_events
from kvtier.fleet.publisher import EventPublisher

log = logging.getLogger(__name__)

MAX_LINEAGE_BYTES = 1 << 20
"""Past any real chunk's: 4 bytes a token and 32 a block."""


class SharedTierEvents:
    def __init__(
        self,
        config: EventsConfig,
        publisher: EventPublisher,
        registry: PoolRegistry,
        counters: Counters,
    ) -> None:
        self.config = config
        self.publisher = publisher
        self._registry = registry
        self._counters = counters
        self._lineages: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self._lock = threading.Lock()

    # -- lineage of committed chunks ------------------------------------------------------

    def remember(self, keys: Sequence[ChunkKey], lineages: Sequence[bytes]) -> None:
        """Keep committed chunks' encoded lineages (empty: none) until they are uploaded. One
        that does not decode, or is longer than any chunk's, is dropped (counted): routers are
        never sent what a client got wrong."""
        valid = []
        for key, encoded in zip(keys, lineages, strict=False):
            if not encoded:
                continue
            try:
                if len(encoded) > MAX_LINEAGE_BYTES:
                    raise ValueError("too long")
                lineage.BlockLineage.decode(encoded)
            except ValueError:
                self._counters.add("lineage_invalid", 1)
                continue
            valid.append((key, encoded))
        with self._lock:
            for key, encoded in valid:
                self._lineages[key] = encoded
                self._lineages.move_to_end(key)
            excess = len(self._lineages) - self.config.lineage_chunks
            for _ in range(max(0, excess)):
                self._lineages.popitem(last=False)
            if excess > 0:
                self._counters.add("lineage_forgotten", excess)

    def companion(self, keys: Sequence[ChunkKey]) -> bytes | None:
        """The companion of an object holding ``keys``; None when none of them has a lineage."""
        with self._lock:
            known = [(k, self._lineages[k]) for k in keys if k in self._lineages]
        if len(known) < len(keys):
            self._counters.add("chunks_unannounced", len(keys) - len(known))
        if not known:
            return None
        return lineage.pack(self._model_of(keys[0]), known)

    def _model_of(self, key: ChunkKey) -> str:
        spec = self._registry.spec_of(namespace_of(key))
        return spec.model if spec is not None else ""

    # -- announcements --------------------------------------------------------------------

    def stored(self, companion: bytes) -> None:
        """The object ``companion`` describes is uploaded."""
        model, entries = lineage.unpack(companion)
        with self._lock:
            for key, _ in entries:
                self._lineages.pop(key, None)
        medium, as_int = self.config.medium, self.config.int_block_hashes
        events = [kv_events.block_stored(lin, medium, as_int) for _, lin in entries]
        self._publish(model, events)

    def removed(self, companion: bytes) -> None:
        """The object ``companion`` describes is deleted."""
        try:
            model, entries = lineage.unpack(companion)
        except ValueError as exc:
            log.warning("kvtier: unreadable lineage companion, removal not announced: %s", exc)
            self._counters.add("lineage_unreadable", 1)
            return
        medium, as_int = self.config.medium, self.config.int_block_hashes
        events = [kv_events.block_removed(lin.block_hashes, medium, as_int) for _, lin in entries]
        self._publish(model, events)

    def _publish(self, model: str, events: list[kv_events.Event]) -> None:
        if events:
            topic = self.config.topic.replace("{model}", model)
            self.publisher.publish(topic, kv_events.encode_batch(events))
            self._counters.add("events_published", len(events))

    def close(self) -> None:
        self.publisher.close()
