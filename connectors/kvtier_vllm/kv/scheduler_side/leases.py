"""The leases behind planned loads: taken for a request's hit and cut to the load it plans
(`LoadLeases`), then kept by step until vLLM's copies are done (`Leases`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import LookupResult, SlotRef, TierClient
from kvtier_vllm.drafts.swaps import DraftTracker, Fill, lease_draft
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan
from kvtier_vllm.kv.scheduler_side.prompt_keys import Needed, PromptKeys, plan_span
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls
from kvtier_vllm.layout.plans import PoolPlan

R = TypeVar("R")
Offered = dict[str, tuple[int, list[SlotRef | None]]]
"""Per plan key, the first chunk of its span and the leases a call took (None: not granted)."""


class Leases:
    """Leases of planned loads, by the step that took them: given back a few steps later, as a
    load's leases outlive the step that copies it. The oldest step's go back with the next call
    that releases (a lookup takes them along)."""

    def __init__(self, steps: int) -> None:
        self._steps: deque[list[SlotRef]] = deque([[] for _ in range(steps)])

    def __iter__(self) -> Iterator[list[SlotRef]]:
        return iter(self._steps)

    @property
    def newest(self) -> list[SlotRef]:
        return self._steps[-1]

    def step(self, taken: list[SlotRef]) -> list[SlotRef]:
        """A new step whose loads hold ``taken``; returns the oldest step's, due now."""
        due = self._steps.popleft()
        self._steps.append(taken)
        return due

    def take_due(self) -> list[SlotRef]:
        due, self._steps[0] = self._steps[0], []
        return due

    def give_back(self, refs: Iterable[SlotRef]) -> None:
        """Leases not used: they go back with the next call that releases."""
        self._steps[0].extend(refs)


class LoadLeases:
    """Takes the leases of a hit over the client handed in and cuts them to the load planned:
    every pool plan's chunks, and the draft's (or its fill). Each call carries the leases
    ``by_step`` holds due; a release that fails is handed back later by ``calls``."""

    def __init__(
        self,
        by_step: Leases,
        calls: TierCalls,
        *,
        chunk_tokens: int,
        in_lmdb: bool,
        windowed: bool,
        draft: DraftTracker | None,
        draft_plan: PoolPlan | None,
    ) -> None:
        self.by_step = by_step
        self.calls = calls
        self.chunk_tokens = chunk_tokens
        self.in_lmdb = in_lmdb
        """Chunks lmdb holds are leased there (the worker reads them from lmdb's map)."""
        self.windowed = windowed
        """A shorter hit moves the sliding windows' first chunks: no partial grant is used."""
        self.draft = draft
        self.draft_plan = draft_plan

    def lookup(
        self, client: TierClient, keys: list[ChunkKey], *, again: bool, verify: bool
    ) -> tuple[LookupResult, list[SlotRef | None]]:
        """Look ``keys`` up, leasing those the arena holds (and lmdb, where loads read it: a
        hit held there too takes one call); asked inside the engine's step, so a probe of the
        object store is not waited for (the answer says it is pending)."""
        return self._releasing_due(
            lambda due: client.lookup(
                keys,
                release=due,
                lease=True,
                again=again,
                verify=verify,
                probe_wait=False,
                in_lmdb=self.in_lmdb,
            )
        )

    def lease(self, client: TierClient, keys: list[ChunkKey]) -> list[SlotRef | None]:
        """Lease ``keys``, every plan's in one call."""
        return self._releasing_due(
            lambda due: client.lease(keys, release=due, in_lmdb=self.in_lmdb)
        )

    def give_back(self, offered: Offered | None) -> None:
        for _, refs in (offered or {}).values():
            self.by_step.give_back(r for r in refs if r is not None)

    def load(
        self, client: TierClient, needed: Needed, prompt: PromptKeys, got: Offered, tiers: bytes
    ) -> LoadPlan:
        """The load of the hit ``needed`` spans from every plan's leases ``got`` (from each
        span's first chunk; the ones past it go back) and ``tiers``, its chunks' tiers: cut to
        what all plans got (no chunk: nothing to load)."""
        first, chunks = needed.first, needed.end
        offered: Offered = {}
        granted = chunks
        for plan, span in needed.spans:
            start, refs = offered[plan.key] = got[plan.key]
            missing = next((i for i, r in enumerate(refs) if r is None), None)
            if missing is not None:
                # a shorter hit moves the sliding windows: with them, none
                granted = first if self.windowed else min(granted, span.start + missing)
        zero: list[str] = []
        fill = Fill.NONE
        unused: list[SlotRef] = []  # leases the hit does not use: ended in one call
        if self.draft is not None and self.draft_plan is not None:
            span = plan_span(self.draft_plan, first, chunks, self.chunk_tokens)
            draft, fill, back = lease_draft(client, self.draft, prompt.hashes_of(span))
            unused += back
            if draft is not None:
                offered[self.draft_plan.key] = (span.start, draft)
            else:  # never leave draft pages uninitialised
                zero.append(self.draft_plan.key)
        leases: dict[str, tuple[int, list[SlotRef]]] = {}
        for key, (start, refs) in offered.items():
            keep = max(0, granted - start) if granted > first else 0
            unused += [r for r in refs[keep:] if r is not None]
            leases[key] = (start, [r for r in refs[:keep] if r is not None])
        if unused:
            self.calls.release(unused)
        if granted <= first:
            return LoadPlan(first, 0, {}, [])
        return LoadPlan(first, granted - first, leases, zero, tiers[: granted - first], fill)

    def _releasing_due(self, call: Callable[[list[SlotRef]], R]) -> R:
        """``call`` given the leases the next step would release: they go back with it (or
        later, when it fails)."""
        due = self.by_step.take_due()
        try:
            return call(due)
        except KVTierError:
            self.calls.release_later(due)
            raise
