"""Verified reuse: a sample of hits is served as misses, and what vLLM computes in their place is
compared with the chunks the hit would have loaded.

A checksum proves the bytes were not damaged on the way; only a recomputation proves they were
the right bytes to begin with (the right shard, layout and weights). A sampled request keeps
its hit's leases while vLLM computes the prefix; each chunk is compared by the workers after
the forward that computed it (the draft's too), where stores are copied, and its lease given
back. A chunk off by more than ``max_error`` quarantines its namespace: this engine loads
nothing from it again. A pool the tiers below the arena store coded (int8, fp8: `coded`) is held
to ``max_error`` plus the codec's own bound: its rounding is expected, never a reason to
quarantine.
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.core.errors import KVTierError
from kvtier.core.keys import Pool, namespace_of
from kvtier.core.protocol import SlotRef
from kvtier_vllm.drafts.swaps import Fill
from kvtier_vllm.kv.connector_stats import KVTierStats
from kvtier_vllm.kv.metadata import ChunkCopy, lmdb_key
from kvtier_vllm.kv.scheduler_side.loads import LoadPlan
from kvtier_vllm.layout.plans import PoolPlan
from kvtier_vllm.shared.tier_access import TierAccess

log = logging.getLogger(__name__)
MAX_CHECKS = 1024


@dataclass
class Sampled:
    """A request served as a miss: its hit's leases, chunk by chunk, per plan key."""

    plan: LoadPlan
    compared: set[tuple[str, int]] = field(default_factory=set)
    """(plan key, chunk) handed to the workers already."""

    def unchecked(self) -> list[SlotRef]:
        """Leases of the chunks not handed to the workers: to give back when it ends."""
        return [
            ref
            for key, (start, refs) in self.plan.leases.items()
            for chunk, ref in enumerate(refs, start)
            if (key, chunk) not in self.compared
        ]


@dataclass
class _Check:
    ref: SlotRef
    pool: str
    limit: float


class Verifier:
    """Chooses the requests to verify, hands their chunks to the workers once computed, and
    judges the workers' comparisons."""

    def __init__(
        self, rate: float, max_error: float, by_key: dict[str, PoolPlan], seed: int | None = None
    ) -> None:
        self.rate = rate
        self.max_error = max_error
        self.by_key = by_key
        self._random = random.Random(seed)
        self._sampled_step = -1
        self._next: list[tuple[ChunkCopy, SlotRef]] = []
        self._checks: dict[tuple[int, int], _Check] = {}
        self.quarantined: dict[bytes, str] = {}
        """Namespaces this engine found wrong, with why: it loads nothing from them."""
        self.to_report: list[tuple[bytes, str]] = []
        """Quarantines for the tiers to hear of, so that every engine stops loading them."""
        self._confirmed: set[bytes] = set()
        """Ours the tiers listed: gone from their list, an admin lifted them."""
        self.errors: deque[tuple[str, float]] = deque(maxlen=MAX_CHECKS)
        """(pool, relative error) of the latest comparisons."""
        self.coded: dict[str, float] = {}
        """Plan keys whose pools the tiers store coded, with the codec's bound: see `limit`."""

    def codes(self, bounds: dict[str, float]) -> None:
        """The plan keys whose pools the tiers below the arena store coded, with the largest
        error the codec makes."""
        self.coded = dict(bounds)
        for key, bound in sorted(self.coded.items()):
            log.info(
                "kvtier: pool %s is stored coded below the arena; a verified chunk of it "
                "matches within %.3g (verify_max_error %g + the codec's bound %.3g)",
                key,
                self.limit(key),
                self.max_error,
                bound,
            )

    def limit(self, key: str) -> float:
        """The largest error a chunk of plan ``key`` may show and still match."""
        return self.max_error + self.coded.get(key, 0.0)

    def sample(self, step: int) -> bool:
        """Whether a request with a hit, asked in ``step``, is verified instead of served."""
        if self.rate <= 0 or (self.rate < 1 and self._sampled_step == step):
            return False
        if self.rate < 1 and self._random.random() >= self.rate:
            return False
        self._sampled_step = step
        return True

    def refuses(self, namespaces: Iterable[bytes], tiers: frozenset[bytes] = frozenset()) -> bool:
        """Whether any of ``namespaces`` is quarantined, here or by the tiers (``tiers``, their
        list, which also says when an admin lifted one of ours)."""
        for namespace in [ns for ns in self._confirmed if ns not in tiers]:
            self._confirmed.discard(namespace)
            self.quarantined.pop(namespace, None)
            log.warning("kvtier: quarantine of namespace %s lifted", namespace.hex())
        self._confirmed.update(ns for ns in tiers if ns in self.quarantined)
        return any(ns in self.quarantined or ns in tiers for ns in namespaces)

    def computed(
        self,
        sampled: Sampled,
        block_ids: list[list[int]],
        chunks: range,
        blocks_per_chunk: int,
    ) -> None:
        """vLLM computes ``chunks`` of a sampled request in this step: compare them after its
        forward. A draft chunk of another revision (a fill) is not compared."""
        bpc = blocks_per_chunk
        fill = sampled.plan.fill is not Fill.NONE
        for key, (start, refs) in sampled.plan.leases.items():
            plan = self.by_key[key]
            if (fill and plan.pool is Pool.DRAFT) or plan.codec is not None:
                continue  # a coded chunk (fp8 hidden states) differs from its pages by design
            ids = block_ids[plan.group]
            for chunk, ref in enumerate(refs, start):
                if chunk not in chunks or (key, chunk) in sampled.compared:
                    continue
                blocks = tuple(ids[chunk * bpc : (chunk + 1) * bpc])
                if len(blocks) < bpc or not all(blocks):
                    continue  # a block vLLM let go of already: nothing to compare with
                sampled.compared.add((key, chunk))
                job = ChunkCopy(
                    key, ref.slot, ref.offset, ref.generation, blocks, key=lmdb_key(ref)
                )
                self._next.append((job, ref))

    def hand_out(self) -> tuple[list[ChunkCopy], list[SlotRef]]:
        """The comparisons of the chunks this step computes, and their leases (to give back
        once the workers compared them)."""
        jobs, self._next = self._next, []
        for job, ref in jobs:
            pool = str(self.by_key[job.plan].pool)
            self._checks[(job.slot, job.generation)] = _Check(ref, pool, self.limit(job.plan))
        while len(self._checks) > MAX_CHECKS:  # reports that never came (a failed step)
            self._checks.pop(next(iter(self._checks)))
        return [job for job, _ in jobs], [ref for _, ref in jobs]

    def reported(self, checked: Iterable[tuple[int, int, float]], stats: KVTierStats) -> None:
        """The workers' comparisons (one per rank holding a part): a chunk matches when every
        part does."""
        worst: dict[tuple[int, int], float] = {}
        for slot, generation, error in checked:
            handle = (slot, generation)
            if handle in self._checks:
                error = math.inf if math.isnan(error) else error  # NaN KV: no `max`, no match
                unknown = error < 0 or worst.get(handle, 0.0) < 0
                worst[handle] = -1.0 if unknown else max(worst.get(handle, 0.0), error)
        for handle, error in worst.items():
            check = self._checks.pop(handle)
            if error < 0:
                stats.verified(check.pool, "unchecked", None)
                continue
            matched = error <= check.limit
            self.errors.append((check.pool, error))
            stats.verified(check.pool, "match" if matched else "mismatch", error)
            if not matched:
                self._quarantine(check, error)

    def report_quarantines(self, calls: TierAccess) -> None:
        """Tell the tiers of namespaces found wrong here: every engine then stops loading them.
        One that fails is told with the next report."""
        while self.to_report and calls.client is not None:
            namespace, why = self.to_report[0]
            try:
                calls.client.quarantine_namespace(namespace, why)
            except KVTierError as exc:
                calls.failed("quarantine", exc)
                return
            self.to_report.pop(0)

    def _quarantine(self, check: _Check, error: float) -> None:
        namespace = namespace_of(check.ref.key)
        if namespace in self.quarantined:
            return
        why = (
            f"a {check.pool} chunk differs from the recomputed KV by {error:.3g} "
            f"(it may differ by {check.limit:.3g}: verify_max_error {self.max_error:g}"
            f"{', plus the codec below the arena' if check.limit > self.max_error else ''})"
        )
        self.quarantined[namespace] = why
        self.to_report.append((namespace, why))
        log.error(
            "kvtier: namespace %s quarantined: %s; this engine loads nothing from it again",
            namespace.hex(),
            why,
        )
