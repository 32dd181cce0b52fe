"""Where an encoder output's parts are, for vLLM's ask whether to wait for it: the arena (a
hit), lmdb (a hit leased there, read from lmdb's map, with ``lmdb_loads``), on its way into the
arena (the request waits, up to ``promote_wait_ms``) or nowhere (the encoder runs).

The arena is read without a call (sidecar) or by a function call into the tiers' indexes
(embedded); lmdb and the object store are asked in the background, and what the object store
holds (or lmdb, without ``lmdb_loads``) is promoted. Parts to lease in lmdb are verified here
first, in lmdb's map (one read transaction, nothing copied): a load the workers fail would fail
the request, so a corrupt part is reported (the tiers drop it) and its item is a miss.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvtier.core.encoder import PartLayout
from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import Answer, LookupResult, TierClient, TierCode, leasable_hit
from kvtier_vllm.encoder.settings import EncoderCacheConfig
from kvtier_vllm.shared.lmdb_reads import LmdbReads, readable_lmdb

log = logging.getLogger(__name__)

ARENA, LMDB, PROMOTING, ABSENT = "arena", "lmdb", "promoting", "absent"
READABLE = frozenset((TierCode.CPU, TierCode.LMDB))
"""Tiers a hit is leased in without a promotion, with ``lmdb_loads``."""
RETRY_S = 1.0
"""An item given up on (nowhere, or promoted too slowly) is looked up again after this."""
PROMOTER_TURN_S = 0.0002
MAX_ITEMS = 8192
"""Items whose keys are remembered (a request asks about its items every step it waits)."""


@dataclass(slots=True)
class Item:
    identifier: str
    rows: int
    keys: list[ChunkKey]
    layout: PartLayout
    below: bool = False
    """lmdb holds the parts the arena lacks, read and verified here: leased in lmdb."""
    verified: bool = False
    """Its parts in lmdb were read here and found whole (a chunk there is never rewritten)."""
    verify: bool | None = None
    """Whether its next hit is sampled for verification (None: not drawn yet)."""
    counted: bool = False
    """A lookup counted its next hit in the tiers' figures already."""


@dataclass(slots=True)
class Promotion:
    deadline: float
    asked: Answer[LookupResult] | None = None


def _scratch(nbytes: int) -> memoryview:
    """Where a coded part would be decoded to be verified (lmdb stores encoder parts as they
    are: they are checked in its map itself)."""
    return memoryview(bytearray(nbytes))


def in_arena(client: TierClient, item: Item) -> bool | None:
    """Whether the arena holds every part; None where only a call can tell."""
    refs = client.in_arena(item.keys)
    if refs is None:
        return None
    return len(refs) == len(item.keys)


class ItemLocator:
    """Finds items in the tiers, following their lookups and promotions step by step.
    ``draw``: whether an item's next hit is sampled for verification (its lookups say so)."""

    def __init__(
        self, cfg: EncoderCacheConfig, draw: Callable[[Item], bool], promoted: Callable[[], None]
    ) -> None:
        self.cfg = cfg
        self._draw = draw
        self._promoted = promoted
        self.lmdb_path = ""
        """Where the workers read hits leased in lmdb ("": none is leased there)."""
        self._lmdb_of: TierClient | None = None
        self._lmdb = LmdbReads()
        self._promoting: OrderedDict[str, Promotion] = OrderedDict()
        """Items looked up in the slower tiers, bounded as the items are (every miss leaves
        one)."""

    def connected(self, client: TierClient) -> None:
        """The tiers' client in use: lmdb's path read anew where it is another one."""
        if client is not self._lmdb_of:
            self._lmdb_of = client
            self.lmdb_path = readable_lmdb(client, self.cfg.lmdb_loads)

    def where(self, client: TierClient, item: Item) -> str:
        """ "arena", "promoting" (the request waits) or "absent" (the encoder runs)."""
        arena = in_arena(client, item)
        if arena:
            self._promoting.pop(item.identifier, None)
            item.below = False
            return ARENA
        if item.below and item.counted:
            return LMDB  # looked up for this hit already
        now = time.monotonic()
        promotion = self._promoting.get(item.identifier)
        if promotion is not None and now >= promotion.deadline + RETRY_S:
            promotion = None  # given up on long ago: another engine may have stored it since
        if promotion is None:
            promotion = Promotion(now + self.cfg.promote_wait_ms / 1000)
            promotion.asked = client.lookup_behind(item.keys, verify=self._draw(item))
            item.counted = True
            self._promoting[item.identifier] = promotion
            if len(self._promoting) > MAX_ITEMS:
                self._promoting.popitem(last=False)
            promotion.asked.wait(self.cfg.lookup_wait_ms / 1000)
        elif now >= promotion.deadline:
            return ABSENT  # waited long enough: the encoder runs
        return self._follow(client, item, promotion, embedded=arena is None)

    def _follow(self, client: TierClient, item: Item, promotion: Promotion, embedded: bool) -> str:
        """A lookup of the slower tiers under way, or a promotion: follow it one step."""
        asked = promotion.asked
        if asked is None:  # promoting
            if embedded:
                # the promoting thread is this process's: a step that only asks again holds
                # the interpreter, and would let it run once a switch interval (5 ms)
                time.sleep(PROMOTER_TURN_S)
                # the step never waits on an object-store probe: the arena is what counts here;
                # the lookup that started the promotion counted the hit
                found = client.lookup(item.keys, again=True, probe_wait=False)
                if leasable_hit(found) == len(item.keys):
                    self._promoting.pop(item.identifier, None)
                    return ARENA
            return PROMOTING
        if not asked.done():
            return PROMOTING
        found = asked.result()
        if found.hits < len(item.keys):
            if found.pending:  # the object store is still being probed
                promotion.asked = client.lookup_behind(item.keys, verify=self._draw(item))
                return PROMOTING
            promotion.deadline = time.monotonic()  # nowhere: never waited for again soon
            return ABSENT
        if leasable_hit(found):
            self._promoting.pop(item.identifier, None)
            return ARENA
        if self.lmdb_path and set(found.tier_codes) <= READABLE:
            if self._whole_in_lmdb(client, item, found.tier_codes):
                self._promoting.pop(item.identifier, None)
                item.below = True
                return LMDB
            promotion.deadline = time.monotonic()  # corrupt: reported, and encoded meanwhile
            return ABSENT
        promotion.asked = None
        client.promote(item.keys)
        self._promoted()
        return PROMOTING

    def _whole_in_lmdb(self, client: TierClient, item: Item, codes: bytes) -> bool:
        """Whether the item's parts in lmdb read back verified: a corrupt one is reported (the
        tiers drop it) and never leased, since a load the workers fail would fail the request."""
        if item.verified:
            return True
        nbytes = item.layout.part_bytes
        with self._lmdb.holding():  # one read transaction; each part checked where it lies
            whole = all(
                self._lmdb.read(self.lmdb_path, key, nbytes, partial(_scratch, nbytes), True)
                is not None
                for key, code in zip(item.keys, codes, strict=True)
                if code == TierCode.LMDB
            )
        if not whole:
            if failed := self._lmdb.take_failed():
                try:
                    client.report_failed(failed)
                except KVTierError as exc:
                    log.warning("kvtier: corrupt encoder parts not reported: %s", exc)
            return False
        item.verified = True
        return True

    def close(self) -> None:
        self._lmdb.close()
