"""The encoder-cache connector's scheduler side: which items are loaded from the tiers, which
are stored, and the leases and reservations behind them.

An item is a hit when the arena holds every part of it, or lmdb the others (with
``lmdb_loads``; see `kvtier_vllm.encoder.item_search` for where an item is found, and when its
request waits): the parts are leased when vLLM asks (`has_cache_item`), so they stay until the
workers read them, and given back at the end of a step that did not schedule the item.

Every hit counts in the tiers' figures once: a lookup of the slower tiers counts it there, and
one the arena's index answered (sidecar) reaches kvtierd with the next hit report. The
verification sample is drawn before an item's lookup, which is flagged ``verify`` when it is
sampled: kvtierd counts what it finds as verified, not as hits."""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvtier.core.encoder import PartLayout, item_keys
from kvtier.core.errors import KVTierError
from kvtier.core.keys import NamespaceSpec, Pool, namespace_of
from kvtier.core.protocol import IndexedRef, TierClient, in_lmdb
from kvtier_vllm.encoder.item_search import MAX_ITEMS, PROMOTING, Item, ItemLocator, in_arena
from kvtier_vllm.encoder.metadata import ECReport, ECStepPlan, ItemSlots
from kvtier_vllm.encoder.settings import EncoderCacheConfig
from kvtier_vllm.encoder.steps import Settlement, StepLedger
from kvtier_vllm.shared.connection import Session

log = logging.getLogger(__name__)

REPORT_EVERY_S = 0.25
"""Hits answered from the arena's index reach kvtierd this often (as the KV connector's)."""


@dataclass(frozen=True, slots=True)
class EncoderPlan:
    """The encoder pool of one modality, as a session registers it."""

    key: str
    spec: NamespaceSpec
    chunk_bytes: int
    pool: Pool = Pool.ENCODER


@dataclass
class ECCounters:
    """What the connector saw since it started; the workers' part comes in their reports."""

    hits: int = 0
    misses: int = 0
    promotions: int = 0
    stores: int = 0
    """Items whose parts were reserved, to be written once encoded."""
    sampled: int = 0
    compared: int = 0
    mismatched: int = 0
    load_failed: int = 0
    lmdb_loads: int = 0
    """Hits leased in lmdb, the workers reading them from its map."""
    loaded_bytes: int = 0
    stored_bytes: int = 0
    load_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


class EncoderCacheScheduler:
    def __init__(
        self,
        cfg: EncoderCacheConfig,
        specs: dict[str, NamespaceSpec],
        replica: str,
        *,
        producer: bool,
        consumer: bool,
    ) -> None:
        self.cfg = cfg
        self.producer = producer
        self.consumer = consumer
        self.plans = {
            modality: EncoderPlan(f"encoder:{modality}", spec, PartLayout.of(spec).part_bytes)
            for modality, spec in specs.items()
        }
        self.namespaces: dict[str, bytes] = {}
        self.session = Session(cfg, replica, list(self.plans.values()), self.namespaces, self.close)
        self.counters = ECCounters()
        self.locator = ItemLocator(cfg, self._draw, self._promoted)
        self._random = random.Random(cfg.verify_seed)
        self._items: OrderedDict[str, Item] = OrderedDict()
        self._leased: dict[str, ItemSlots] = {}
        """Hits answered this step, their parts leased."""
        self._sampled: dict[str, ItemSlots] = {}
        """Hits served as misses this step, to compare with what the encoder computes."""
        self._loads: dict[str, ItemSlots] = {}
        self._stores: dict[str, Item] = {}
        self._steps = StepLedger()
        self._readers: dict[str, set[str]] = {}
        """Requests of each item loaded and not yet reported."""
        self._unavailable: set[str] = set()
        self.quarantined: dict[bytes, str] = {}
        self.session.connect(wait=True)

    # -- the tiers ---------------------------------------------------------------------------

    def client(self) -> TierClient | None:
        if not self.session.connect():
            return None
        client = self.session.client
        if client is not None:
            self.locator.connected(client)
        return client if client is not None and client.serving else None

    def _item(self, identifier: str, modality: str, rows: int) -> Item | None:
        item = self._items.get(identifier)
        if item is not None and item.rows == rows:
            self._items.move_to_end(identifier)
            return item
        plan = self.plans.get(modality)
        namespace = self.namespaces.get(plan.key) if plan is not None else None
        if plan is None or namespace is None or namespace in self.quarantined:
            return None
        layout = PartLayout.of(plan.spec)
        item = Item(identifier, rows, item_keys(namespace, identifier, rows, layout), layout)
        self._items[identifier] = item
        if len(self._items) > MAX_ITEMS:
            self._items.popitem(last=False)
        return item

    def _promoted(self) -> None:
        self.counters.promotions += 1

    def _draw(self, item: Item) -> bool:
        """Whether the item's next hit is sampled, drawn once before its first lookup."""
        if item.verify is None:
            item.verify = self._sample()
        return item.verify

    # -- vLLM's scheduler hooks --------------------------------------------------------------

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        """False while an item of ``request`` is promoted into the arena (vLLM asks again next
        step); True otherwise."""
        if not self.consumer:
            return True
        client = self.client()
        if client is None:
            return True
        ready = True
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # its KV is there: vLLM runs no encoder for it
            item = self._item_of(request, index)
            if item is not None and self.locator.where(client, item) == PROMOTING:
                ready = False
        return ready

    def _item_of(self, request: Any, index: int) -> Item | None:
        feature = request.mm_features[index]
        if tagged(feature):
            return None
        rows = request.get_num_encoder_embeds(index)
        return self._item(feature.identifier, feature.modality, rows)

    def has_cache_item(self, identifier: str) -> bool:
        """True only with every part leased: they stay until the workers read them."""
        if identifier in self._leased:
            return True
        if identifier in self._sampled:
            return False  # asked again in the step that samples it: still encoded
        item = self._items.get(identifier)
        client = self.client()
        if not self.consumer or item is None or client is None:
            return False
        arena = in_arena(client, item)
        if arena is False and not item.below:
            return False
        sampled = self._draw(item)
        try:
            if arena and not item.counted:
                self._count_indexed_hit(client, item, sampled)
            refs = client.lease(item.keys, in_lmdb=item.below)
        except KVTierError as exc:
            log.warning("kvtier: encoder cache lease failed, the encoder runs: %s", exc)
            return False
        granted = [ref for ref in refs if ref is not None]
        if len(granted) < len(refs):
            item.below = False  # looked up again next time
            if granted:
                client.release(granted)
            return False
        item.verify, item.counted = None, False
        slots = ItemSlots(identifier, item.rows, item.layout, tuple(granted))
        if sampled:
            self._sampled[identifier] = slots
            self.counters.sampled += 1
            return False
        self._leased[identifier] = slots
        self.counters.hits += 1
        self.counters.lmdb_loads += any(map(in_lmdb, granted))
        return True

    @staticmethod
    def _count_indexed_hit(client: TierClient, item: Item, sampled: bool) -> None:
        """Count a hit the arena's index answered, as the KV connector's lookups do: no call
        now, the next hit report tells kvtierd. Where the index no longer holds it all, the
        lookup is a call, and the leases it took are given back (the lease below is the one
        held)."""
        _, refs = client.lookup(item.keys, lease=True, verify=sampled, probe_wait=False)
        held = [ref for ref in refs if ref is not None and not isinstance(ref, IndexedRef)]
        if held:
            client.release(held)

    def _sample(self) -> bool:
        rate = self.cfg.verify_sample_rate
        return rate > 0 and self._random.random() < rate

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        identifier = request.mm_features[index].identifier
        leased = self._leased.pop(identifier, None)
        if leased is not None:
            self._loads[identifier] = leased
        elif identifier not in self._loads and identifier not in self._sampled and self.consumer:
            self.counters.misses += 1  # the encoder runs for it
        if identifier in self._loads:
            self._readers.setdefault(identifier, set()).add(request.request_id)
        elif self.producer and identifier not in self._sampled:
            item = self._item_of(request, index)
            if item is not None:
                self._stores[identifier] = item

    def build_plan(self) -> ECStepPlan:
        """This step's plan for the workers; what vLLM asked about and did not schedule is
        given back."""
        client = self.session.client
        unused = [ref for slots in self._leased.values() for ref in slots.refs]
        self._leased.clear()
        plan = ECStepPlan(
            arena_path=str(client.arena_path) if client is not None else "",
            lmdb_path=self.locator.lmdb_path,
        )
        plan.loads = list(self._loads.values())
        self._loads.clear()
        plan.checks = list(self._sampled.values())
        self._sampled.clear()
        stores = list(self._stores.values())
        self._stores.clear()
        if client is not None:
            if unused:
                self._quietly(client.release, unused)
            if stores:
                plan.stores = self._reserve(client, stores)
        self._steps.record(plan)
        if client is not None:
            self._apply(client, self._steps.expire())
            self._quietly(client.report_hits, REPORT_EVERY_S)
        return plan

    def _reserve(self, client: TierClient, items: list[Item]) -> list[ItemSlots]:
        """Slots for every part of each item; an item the arena holds already, or has no
        room for whole, is not stored."""
        try:
            refs = client.reserve([key for item in items for key in item.keys])
        except KVTierError as exc:
            log.warning("kvtier: encoder outputs not stored this step: %s", exc)
            return []
        out, partial, start = [], [], 0
        for item in items:
            got = refs[start : start + len(item.keys)]
            start += len(item.keys)
            granted = [ref for ref in got if ref is not None]
            if len(granted) == len(got):
                out.append(ItemSlots(item.identifier, item.rows, item.layout, tuple(granted)))
                self.counters.stores += 1
            else:
                partial += granted
        if partial:
            self._quietly(client.abort, partial)
        return out

    def settle(self, report: ECReport | None) -> None:
        """A step's report: commit what was stored, give back what was read, judge samples."""
        if report is None:
            return
        self.counters.loaded_bytes += report.loaded_bytes
        self.counters.stored_bytes += report.stored_bytes
        self.counters.load_seconds += report.load_seconds
        self.counters.load_failed += len(report.load_failed)
        client = self.session.client
        if report.failed_chunks and client is not None:
            self._quietly(client.report_failed, report.failed_chunks)
        for identifier in report.load_failed:
            self._unavailable |= self._readers.get(identifier, set())
        settled = self._steps.settle(report)
        for slots, error in settled.checked:
            self.counters.compared += 1
            self._judge(slots, error)
        if client is not None:
            self._apply(client, settled)

    def _apply(self, client: TierClient, settled: Settlement) -> None:
        for identifier in settled.read:
            self._readers.pop(identifier, None)
        if settled.commit:
            self._quietly(client.commit, settled.commit)
        if settled.abort:
            self._quietly(client.abort, settled.abort)
        if settled.release:
            self._quietly(client.release, settled.release)

    def take_unavailable(self) -> set[str]:
        """Requests an output could not be read for (vLLM fails them: their encoder input is
        zeros)."""
        out, self._unavailable = self._unavailable, set()
        return out

    def _judge(self, slots: ItemSlots, error: float) -> None:
        if error <= self.cfg.verify_max_error:
            return
        self.counters.mismatched += 1
        namespace = namespace_of(slots.refs[0].key)
        most = self.cfg.verify_max_error
        why = f"encoder output {slots.identifier} off by {error:.3g} (max {most})"
        log.error("kvtier: quarantining encoder namespace %s: %s", namespace.hex(), why)
        self.quarantined[namespace] = why
        client = self.session.client
        if client is not None:
            self._quietly(lambda: client.quarantine_namespace(namespace, why))

    @staticmethod
    def _quietly(call: Any, *args: Any) -> None:
        try:
            call(*args)
        except KVTierError as exc:
            log.warning("kvtier: encoder cache call failed: %s", exc)

    def close(self) -> None:
        self.session.stop()
        client = self.session.detach()
        if client is not None:
            held = [ref for slots in self._leased.values() for ref in slots.refs]
            if held:
                self._quietly(client.release, held)
            self._apply(client, self._steps.drain())
            client.close()
        self.locator.close()


def tagged(feature: Any) -> bool:
    """Whether vLLM tagged the item's identifier with a LoRA adapter (``enable_tower_connector_
    lora``): the output depends on adapter weights named only by the adapter's name, so it is
    not cached (as the KV connector does for LoRA requests)."""
    mm_hash = getattr(feature, "mm_hash", None)
    return mm_hash is not None and feature.identifier != mm_hash
