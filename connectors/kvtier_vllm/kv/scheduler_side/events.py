"""KV events for routers: which of this engine's blocks the arena (medium ``CPU``) and lmdb
(``STORAGE``) hold, from the stores this engine made and the tiers' own journal of what entered
and left them (evictions, write-backs, promotions)."""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.core.errors import KVTierError
from kvtier.core.journal import ChunkEvents
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import Answer, TierClient
from kvtier_vllm.shared.vllm_compat import block_removed_event, block_stored_event

log = logging.getLogger(__name__)

MEDIA = {"cpu": "CPU", "lmdb": "STORAGE"}
_POLL_S = 0.25
_TRACKED = 1 << 16
"""Chunks followed at most; the oldest is forgotten first (no more events for it)."""
_WITH_TOKENS = 1 << 12
"""Chunks whose token ids are kept for a later BlockStored (a write-back to lmdb)."""

Handle = tuple[int, int]


@dataclass(slots=True)
class _Chunk:
    hashes: list[bytes]
    parent: bytes | None
    tokens: array[int] | None
    media: set[str] = field(default_factory=set)


class KVEventFeed:
    def __init__(self, block_size: int, enabled: bool) -> None:
        """``enabled`` False (vLLM publishes no events): the journal is never asked, which would
        cost a call every poll for events nobody reads, and stores are not announced."""
        self.block_size = block_size
        self.enabled = enabled
        self._chunks: OrderedDict[ChunkKey, _Chunk] = OrderedDict()
        self._with_tokens: OrderedDict[ChunkKey, None] = OrderedDict()
        self._planned: dict[Handle, tuple[ChunkKey, _Chunk]] = {}
        self._events: list[object] = []
        self._cursor = -1
        self._answer: Answer[ChunkEvents] | None = None
        self._next_poll = 0.0

    # -- this engine's stores -------------------------------------------------------------

    def store_planned(
        self,
        handle: Handle,
        key: ChunkKey,
        hashes: list[bytes],
        parent: bytes | None,
        tokens: list[int],
    ) -> None:
        self._planned[handle] = (key, _Chunk(hashes, parent, array("l", tokens)))

    def store_done(self, handle: Handle) -> None:
        planned = self._planned.pop(handle, None)
        if planned is None:
            return
        key, chunk = planned
        self._chunks[key] = chunk
        self._chunks.move_to_end(key)
        self._with_tokens[key] = None
        self._stored(chunk, "CPU")
        while len(self._chunks) > _TRACKED:
            self._forget(next(iter(self._chunks)))
        while len(self._with_tokens) > _WITH_TOKENS:
            oldest, _ = self._with_tokens.popitem(last=False)
            self._chunks[oldest].tokens = None

    def store_dropped(self, handle: Handle) -> None:
        self._planned.pop(handle, None)

    # -- the tiers' journal ---------------------------------------------------------------

    def follow(self, client: TierClient) -> None:
        """Start from the journal's end (a new connection)."""
        if not self.enabled:
            return
        self._answer = None
        self._cursor = client.chunk_events(-1).result().cursor

    def poll(self, client: TierClient) -> None:
        """Take an answer that came, and ask again when due; never waits."""
        if not self.enabled:
            return
        if self._answer is not None:
            if not self._answer.done():
                return
            answer, self._answer = self._answer, None
            try:
                found = answer.result()
            except KVTierError as exc:
                log.debug("kvtier: chunk events unavailable: %s", exc)
                return
            if found.lost:  # the feed fell behind the journal's window
                log.warning(
                    "kvtier: %d chunk events lost; routers may list stale blocks", found.lost
                )
            self._cursor = found.cursor
            for event in found.events:
                self._apply(event.stored, event.tier, event.key)
        if not self._chunks or time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + _POLL_S
        self._answer = client.chunk_events(self._cursor)

    def _apply(self, stored: bool, tier: str, key: ChunkKey) -> None:
        chunk = self._chunks.get(key)
        medium = MEDIA.get(tier)
        if chunk is None or medium is None:
            return
        if stored:
            self._stored(chunk, medium)
        elif medium in chunk.media:
            chunk.media.discard(medium)
            self._events.append(block_removed_event(chunk.hashes, medium))
            if not chunk.media:
                self._forget(key)

    def _stored(self, chunk: _Chunk, medium: str) -> None:
        if medium in chunk.media or chunk.tokens is None:
            return  # told already, or its tokens are gone: a router would get a partial block
        chunk.media.add(medium)
        tokens = list(chunk.tokens)
        self._events.append(
            block_stored_event(chunk.hashes, chunk.parent, tokens, self.block_size, medium)
        )

    def _forget(self, key: ChunkKey) -> None:
        self._chunks.pop(key, None)
        self._with_tokens.pop(key, None)

    def take(self) -> list[object]:
        events, self._events = self._events, []
        return events
