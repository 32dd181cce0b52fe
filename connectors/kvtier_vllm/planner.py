"""Hit planning: how much of a prompt the tiers hold, and the leases that load it.

A hit is the longest prefix every target plan holds. Its chunks must all be in the arena to be
loaded (or in lmdb, with ``in_lmdb``: the worker reads those from lmdb's map): the others are
promoted in the background and the request is asked again next step, for up to ``wait_s`` (or a
share of what recomputing the hit takes, where longer); past that the hit shrinks to what the
arena holds. The draft pool's chunks come with their target's, or the draft pages are filled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey, Pool
from kvtier.core.protocol import Answer, LookupResult, SlotRef, TierClient, TierCode, in_lmdb
from kvtier_vllm.draft import DraftTracker, Fill, lease_draft
from kvtier_vllm.layout import PoolPlan
from kvtier_vllm.leases import Leases
from kvtier_vllm.metadata import ChunkCopy, KVTierMetadata, lmdb_key
from kvtier_vllm.spans import by_plan, keys_in, needed, split, targets_of
from kvtier_vllm.unreturned import Return, Unreturned

log = logging.getLogger(__name__)
R = TypeVar("R")

CPU = int(TierCode.CPU)
LMDB = int(TierCode.LMDB)
# vLLM's CacheHitSource values per tier; the object store is remote, shared storage
_HIT_SOURCES = {CPU: "host", LMDB: "disk"}
_REMOTE_SOURCE = "external_unspecified"
_WINDOW_TRIES = 4  # sliding-window checks of one lookup, each with a shorter hit
PROMOTE_WAIT_ASKS = 3
"""Asks a request may wait for its promotions however long its steps take: where a step
outlasts ``promote_wait_ms`` (a long prefill beside it), waiting only by time would give up at
the first ask after queuing them, before the daemon had room to hold them."""


@dataclass
class LoadPlan:
    first_chunk: int
    chunks: int
    leases: dict[str, tuple[int, list[SlotRef]]]
    """Per plan key, the first chunk leased and the leases, chunk after chunk."""
    zero_plans: list[str]
    tiers: bytes = b""
    """Where each chunk was when first asked for (promoted ones came from lmdb)."""
    fill: Fill = Fill.NONE
    """How the draft pages of these chunks are set."""

    def refs(self) -> list[SlotRef]:
        return [r for _, refs in self.leases.values() for r in refs]

    def sources(self, local_tokens: int, chunk_tokens: int) -> dict[str, int]:
        """Tokens of the hit past ``local_tokens`` by the tier that held them: "host" (arena),
        "disk" (lmdb) or "external_unspecified" (the object store)."""
        sources: dict[str, int] = {}
        for i, code in enumerate(self.tiers):
            start = max((self.first_chunk + i) * chunk_tokens, local_tokens)
            end = (self.first_chunk + i + 1) * chunk_tokens
            source = _HIT_SOURCES.get(code, _REMOTE_SOURCE)
            sources[source] = sources.get(source, 0) + max(0, end - start)
        return sources

    def add_copies(
        self,
        meta: KVTierMetadata,
        block_ids: list[list[int]],
        by_key: dict[str, PoolPlan],
        *,
        skip: int,
        request: str,
        chunk_tokens: int,
        blocks_per_chunk: int,
    ) -> None:
        """Add the copies of this load into a request's blocks (per group) to ``meta``, and the
        blocks to zero. ``skip``: blocks vLLM holds already; ``request``: named for an
        asynchronous load."""
        bpc = blocks_per_chunk
        for key, (start, refs) in self.leases.items():
            ids = block_ids[by_key[key].group]
            # another revision's draft chunk is a fill, never loaded as the current one
            draft = by_key[key].pool is Pool.DRAFT
            fill = "previous" if draft and self.fill is Fill.PREVIOUS else ""
            for chunk, ref in enumerate(refs, start):
                first = max(0, skip - chunk * bpc)
                blocks = tuple(ids[chunk * bpc + first : (chunk + 1) * bpc])
                args = (key, ref.slot, ref.offset, ref.generation, blocks, first, fill, request)
                meta.loads.append(ChunkCopy(*args, lmdb_key(ref), bytes(ref.key)))
        end = (self.first_chunk + self.chunks) * bpc
        for key in self.zero_plans:
            span = self.first_chunk, self.first_chunk + self.chunks
            zeroed = needed(by_key[key], *span, chunk_tokens)
            ids = block_ids[by_key[key].group]
            start = max(skip, zeroed.start * bpc)
            meta.zero.setdefault(key, []).extend(b for b in ids[start:end] if b)


@dataclass
class _Found:
    chunks: int
    tiers: dict[str, tuple[int, bytes]]
    """Per plan key, the first chunk looked up and the tier code of each found from there."""
    pending: bool
    leases: dict[str, tuple[int, list[SlotRef | None]]] | None = None
    """Per plan key, the first chunk and the leases the lookup took, when it took them."""


@dataclass
class Asked:
    """What one request's lookups learned, over the steps it is asked again."""

    since: float | None = None
    """When it was first asked again."""
    looked: bool = False
    """Whether it was looked up already: lookups asked again are not counted again."""
    plans: int = 0
    """Times a load was planned for it (`HitPlanner.plan`)."""
    verify: bool = False
    """Sampled for verification: what its lookups find is counted as verified, not hits."""
    first_tiers: dict[int, int] = field(default_factory=dict)
    """Per chunk, where it was when first asked for (promoted ones came from lmdb)."""
    behind: tuple[list[ChunkKey], Answer[LookupResult]] | None = None
    """The first lookup, asked in the background, and its keys: the plan takes its answer."""

    def may_wait(self, wait_s: float, plans: int = 0) -> bool:
        """Whether the request may still be asked again next step: for ``wait_s``, and until
        more than ``plans`` loads were planned for it; never with no wait."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        return wait_s > 0 and (now - self.since < wait_s or self.plans <= plans)


def _log_error(what: str, error: KVTierError) -> None:
    log.error("kvtier %s failed: %s", what, error)


class HitPlanner:
    """Finds a request's hit over ``client`` and plans its load: the leases of every plan's
    chunks, the draft's fill, and promotions of what is not in the arena yet.

    ``namespaces`` (per plan key) is read at each call: the draft's follows its swaps, and a
    draft pool without one is not waited for. A release that fails is kept in ``unreturned``
    and reported to ``on_error``; any other failed call raises `KVTierError`, as from `plan`."""

    def __init__(
        self,
        client: TierClient,
        plans: Sequence[PoolPlan],
        namespaces: dict[str, bytes],
        *,
        chunk_tokens: int,
        blocks_per_chunk: int,
        checkpoint: int = 0,
        drop_last: bool = False,
        wait_s: float = 0.0,
        draft: DraftTracker | None = None,
        leases: Leases | None = None,
        unreturned: Unreturned | None = None,
        on_error: Callable[[str, KVTierError], None] = _log_error,
        in_lmdb: bool = False,
        recompute_wait: Callable[[int], float] | None = None,
    ) -> None:
        self.client = client
        self.in_lmdb = in_lmdb
        """Chunks lmdb holds load from there (`TierClient.lease`), with no promotion."""
        self.loadable = bytes([CPU, LMDB] if in_lmdb else [CPU])
        self.namespaces = namespaces
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = blocks_per_chunk
        self.checkpoint = checkpoint
        """Chunks between the sliding windows kept for shorter prefixes (0: none)."""
        self.drop_last = drop_last
        """A hit's last chunk is recomputed (EAGLE-style drafters)."""
        self.wait_s = wait_s
        self.recompute_wait = recompute_wait
        """How long a hit of so many tokens may be waited for past ``wait_s`` (a share of what
        recomputing it takes: `StepTimings.recompute_wait`)."""
        self.targets = targets_of(plans)
        assert self.targets, "a hit needs a target plan"
        self.anchor = self.targets[0]
        self.windowed = any(p.window for p in self.targets)
        """A shorter hit moves the sliding windows' first chunks."""
        self.draft_plan = next((p for p in plans if p.pool is Pool.DRAFT), None)
        self.draft = draft
        self.leases = leases if leases is not None else Leases(2)
        self.unreturned = unreturned if unreturned is not None else Unreturned()
        self.on_error = on_error

    def _wait_s(self, chunks: int) -> float:
        found = self.recompute_wait(chunks * self.chunk_tokens) if self.recompute_wait else 0.0
        return max(self.wait_s, found)

    def keys(self, plan: PoolPlan, hashes: Any, chunks: Iterable[int]) -> list[ChunkKey]:
        return keys_in(self.namespaces[plan.key], hashes, chunks, self.blocks_per_chunk)

    def may_have_appeared(self, hashes: Any, first: int) -> bool:
        """Whether a hit from chunk ``first`` could be there now, where an earlier ask found
        none: the arena holds that chunk, read without a call (True where it cannot be read so:
        asking is no dearer then)."""
        found = self.client.in_arena(self.keys(self.anchor, hashes, [first]))
        return found is None or bool(found)

    def still_holds(self, plan: LoadPlan, hashes: Any, limit: int) -> bool:
        """Whether a plan made at an earlier ask still stands, read from the arena without a
        call: every chunk it leased is in the same slot, and the arena holds no chunk past its
        hit (a lookup now would find a longer one). False where the arena cannot be read so."""
        refs = [r for r in plan.refs() if not in_lmdb(r)]
        end = plan.first_chunk + plan.chunks
        past = self.keys(self.anchor, hashes, [end]) if end < limit else []
        found = self.client.in_arena([r.key for r in refs] + past)
        if found is None or len(found) != len(refs):
            return False
        return all(
            f.slot == r.slot and f.generation == r.generation
            for f, r in zip(found, refs, strict=True)
        )

    def _needed(self, plan: PoolPlan, first: int, chunks: int) -> range:
        return needed(plan, first, chunks, self.chunk_tokens)

    def _first_keys(self, hashes: Any, first: int, limit: int) -> list[ChunkKey]:
        """The keys a request's first lookup asks for: every target plan's, anchor first."""
        spans = [(plan, self._needed(plan, first, limit)) for plan in self.targets]
        return [k for plan, span in spans for k in self.keys(plan, hashes, span)]

    def answered(
        self, asked: Asked, hashes: Any, first: int, limit: int, wait_s: float | None
    ) -> bool:
        """Whether `plan` may run now, having waited at most ``wait_s`` (None: as long as the
        call may take). A first lookup whose first chunk the arena's index does not hold (most
        likely a miss) is asked in the background: until it is answered, ask again later."""
        if asked.behind is None:
            if asked.looked:
                return True
            keys = self._first_keys(hashes, first, limit)
            held = self.client.in_arena(keys[:1])
            if not keys or held is None or held:
                return True  # the index answers, or a lookup here is no dearer than a check
            asked.behind = keys, self.client.lookup_behind(keys, verify=asked.verify)
            asked.looked = True
        return asked.behind[1].wait(wait_s)

    @staticmethod
    def wait_for_answers(asked: Iterable[Asked], timeout_s: float) -> None:
        """Wait for the lookups these requests asked in the background, each at most
        ``timeout_s``: all were sent before, so the engine waits once for them all, not once
        per ask."""
        for one in asked:
            if one.behind is not None:
                one.behind[1].wait(timeout_s)

    def plan(self, asked: Asked, hashes: Any, first: int, limit: int) -> LoadPlan | None:
        """The load of the hit from chunk ``first`` (vLLM holds the ones before) up to
        ``limit``, with its leases taken; an empty plan (no chunk) for no hit, or None: ask
        again next step, chunks are on their way into the arena."""
        asked.plans += 1
        try:
            found = self._find(asked, hashes, first, limit)
        finally:
            asked.looked = True
        chunks = found.chunks
        if self.drop_last and chunks > first:
            chunks -= 1
        anchor_start, anchor_codes = found.tiers[self.anchor.key]
        for chunk, code in enumerate(anchor_codes, anchor_start):
            asked.first_tiers.setdefault(chunk, code)
        # per plan, the chunks of the hit to bring up first
        loadable = self.loadable
        below = {
            plan.key: [
                c for c, code in enumerate(codes[: chunks - start], start) if code not in loadable
            ]
            for plan in self.targets
            for start, codes in (found.tiers[plan.key],)
        }
        if any(below.values()) or found.pending:
            self._give_back(found.leases)
            # a probe still running may find the rest of the prompt
            worth = (limit if found.pending else chunks) - first
            if asked.may_wait(self._wait_s(worth), PROMOTE_WAIT_ASKS):
                self._promote(hashes, below)
                return None
            if self.windowed and any(below.values()):
                return LoadPlan(first, 0, {}, [])  # a shorter hit would need other windows
            chunks = min([chunks, *(c[0] for c in below.values() if c)])
            found.leases = None
        draft = self.draft_plan
        if chunks <= first or (
            draft is not None
            and draft.key in self.namespaces
            and self._draft_on_its_way(draft, asked, hashes, range(first, chunks))
        ):
            self._give_back(found.leases)
            return None if chunks > first else LoadPlan(first, 0, {}, [])
        return self._lease(asked, hashes, first, chunks, found.leases)

    def _find(self, asked: Asked, hashes: Any, first: int, limit: int) -> _Found:
        """The longest hit every target plan holds, in chunks: per plan, the first chunk it
        needs (from ``first``: vLLM holds the ones before) and the tier of each chunk from there.

        Full-attention plans need every chunk of the hit. A sliding-window plan needs only the
        window before the hit's end, which moves when the hit gets shorter: its check repeats,
        a few times at most. The first lookup also leases what the arena holds (or reads it from
        the arena's index, with no call), so that a whole hit from the arena takes one step;
        one asked in the background (see `answered`) leased nothing."""
        client = self.client
        spans = [(plan, self._needed(plan, first, limit)) for plan in self.targets]
        keys = self._first_keys(hashes, first, limit)
        behind, asked.behind = asked.behind, None
        early: dict[str, tuple[int, list[SlotRef | None]]] | None = None
        if behind is not None and behind[0] == keys and behind[1].done():
            result = behind[1].result()
        else:
            result, leased = self._releasing_due(
                lambda due: client.lookup(
                    keys, release=due, lease=True, again=asked.looked, verify=asked.verify
                )
            )
            early = by_plan(spans, leased)
        found = {
            plan.key: (span.start, codes)
            for (plan, span), codes in zip(spans, split(result.tier_codes, spans), strict=True)
        }
        if len(spans) == 1 or result.hits == len(keys):
            chunks = spans[0][1].start + result.hits if len(spans) == 1 else limit
            return _Found(chunks, found, result.pending, early)
        self._give_back(early)
        chunks, pending = limit, result.pending
        found = {}
        for _ in range(_WINDOW_TRIES):
            settled = True
            for plan in self.targets:
                span = self._needed(plan, first, chunks)
                if plan.window or plan.key not in found:
                    # the first lookup counted these keys: the window checks are asked again
                    result = client.lookup(self.keys(plan, hashes, span), again=True)
                    pending |= result.pending
                    found[plan.key] = (span.start, result.tier_codes)
                have = span.start + len(found[plan.key][1])
                if have < chunks:
                    if plan.window and self.checkpoint:
                        # windows are kept before each checkpoint: the last one below
                        have = min(have, (chunks - 1) // self.checkpoint * self.checkpoint)
                    chunks = have
                    settled = settled and not plan.window
            if settled:
                return _Found(chunks, found, pending)
        return _Found(first, found, pending)

    def _releasing_due(self, call: Callable[[list[SlotRef]], R]) -> R:
        """``call`` given the leases the next step would release: they go back with it (or
        later, when it fails)."""
        due = self.leases.take_due()
        try:
            return call(due)
        except KVTierError:
            self.unreturned.keep(Return.RELEASE, due)
            raise

    def _give_back(self, leases: dict[str, tuple[int, list[SlotRef | None]]] | None) -> None:
        for _, refs in (leases or {}).values():
            self.leases.give_back(r for r in refs if r is not None)

    def _promote(self, hashes: Any, below: dict[str, list[int]]) -> None:
        """Bring a hit's chunks up into the arena, the draft's with their target's."""
        client = self.client
        span: set[int] = set()
        for plan in self.targets:
            chunks = below.get(plan.key, [])
            if chunks:
                client.promote(self.keys(plan, hashes, chunks))
                span.update(chunks)
        if not span or self.draft_plan is None:
            return
        namespaces = [self.namespaces.get(self.draft_plan.key)]
        namespaces += self.draft.fill_sources() if self.draft is not None else []
        for namespace in namespaces:
            if namespace is not None:
                client.promote(keys_in(namespace, hashes, sorted(span), self.blocks_per_chunk))

    def _lease(
        self,
        asked: Asked,
        hashes: Any,
        first: int,
        chunks: int,
        early: dict[str, tuple[int, list[SlotRef | None]]] | None,
    ) -> LoadPlan | None:
        """Lease every plan's chunks of the hit (``early``: those the lookup leased, when they
        cover the hit; the ones past it go back); the hit shrinks to what all of them got."""
        client = self.client
        spans = [(plan, self._needed(plan, first, chunks)) for plan in self.targets]
        if early is None or any(
            early[plan.key][0] != span.start or len(early[plan.key][1]) < len(span)
            for plan, span in spans
        ):
            self._give_back(early)
            keys = [k for plan, span in spans for k in self.keys(plan, hashes, span)]
            # every plan's chunks in one call
            early = by_plan(
                spans,
                self._releasing_due(
                    lambda due: client.lease(keys, release=due, in_lmdb=self.in_lmdb)
                ),
            )
        offered: dict[str, tuple[int, list[SlotRef | None]]] = {}
        granted = chunks
        for plan, span in spans:
            start, refs = early[plan.key]
            offered[plan.key] = (start, refs)
            missing = next((i for i, r in enumerate(refs) if r is None), None)
            if missing is not None:
                # a shorter hit moves the sliding windows: with them, none
                granted = first if self.windowed else min(granted, span.start + missing)
        zero: list[str] = []
        fill = Fill.NONE
        if self.draft is not None and self.draft_plan is not None:
            span = self._needed(self.draft_plan, first, chunks)
            chunk_hashes = [hashes[(c + 1) * self.blocks_per_chunk - 1] for c in span]
            draft, fill, back = lease_draft(client, self.draft, chunk_hashes)
            self.release(back)
            if draft is not None:
                offered[self.draft_plan.key] = (span.start, draft)
            else:  # never leave draft pages uninitialised
                zero.append(self.draft_plan.key)
        leases: dict[str, tuple[int, list[SlotRef]]] = {}
        for key, (start, refs) in offered.items():
            keep = max(0, granted - start)
            self.release([r for r in refs[keep:] if r is not None])
            leases[key] = (start, [r for r in refs[:keep] if r is not None])
        if granted <= first:
            self.release([r for _, refs in leases.values() for r in refs])
            wait_s = self._wait_s(chunks - first)
            return None if asked.may_wait(wait_s) else LoadPlan(first, 0, {}, [])
        tiers = bytes(asked.first_tiers.get(c, CPU) for c in range(first, granted))
        return LoadPlan(first, granted - first, leases, zero, tiers, fill)

    def _draft_on_its_way(self, draft: PoolPlan, asked: Asked, hashes: Any, hit: range) -> bool:
        """Whether draft chunks of the hit are still coming up into the arena (then ask again,
        within the wait): loading them now would find them mid-promotion and zero them."""
        client = self.client
        keys = self.keys(draft, hashes, self._needed(draft, hit.start, hit.stop))
        found = client.lookup(keys, again=asked.since is not None, verify=asked.verify)
        below = [k for k, c in zip(keys, found.tier_codes, strict=False) if c != CPU]
        if not below and not found.pending:
            return False
        if not asked.may_wait(self._wait_s(len(hit))):
            return False
        if below:
            client.promote(below)
        return True

    def release(self, refs: list[SlotRef]) -> None:
        if not refs:
            return
        try:
            self.client.release(refs)
        except KVTierError as exc:
            self.unreturned.keep(Return.RELEASE, refs)
            self.on_error("release", exc)
