"""The draft pool through swaps, as the scheduler keeps it: its revision followed from kvtierd
(once per step) and from the workers' weight fingerprints, its namespace kept current among the
plans' namespaces, and the speculative tokens accepted per revision and fill."""

from __future__ import annotations

from typing import Any, Protocol

from kvtier.core.errors import KVTierError
from kvtier.core.keys import NamespaceSpec
from kvtier_vllm.drafts.swaps import AcceptanceMeter, DraftTracker, Fill
from kvtier_vllm.layout.plans import PoolPlan
from kvtier_vllm.shared.settings import ConnectorConfig
from kvtier_vllm.shared.tier_access import TierAccess


class DraftStats(Protocol):
    """What the draft pool counts (in the KV connector's stats)."""

    def spec(self, revision: str, fill: str, drafted: int, accepted: int) -> None: ...

    def revision(self, revision: str) -> None: ...

    def swap(self, source: str) -> None: ...


class DraftPool:
    def __init__(
        self,
        plan: PoolPlan,
        cfg: ConnectorConfig,
        namespaces: dict[str, bytes],
        calls: TierAccess,
    ) -> None:
        self.plan = plan
        self.namespaces = namespaces
        """The scheduler's, per plan key: the draft's entry is this pool's current namespace."""
        self.calls = calls
        """The client in use, and where a failed call is reported."""
        self.tracker = DraftTracker(
            plan.spec, self._register, cfg.draft_fill, cfg.draft_check_steps
        )
        self._acceptance = AcceptanceMeter()
        self._followed = -1
        """The step whose lookups already followed kvtier's view (-1: none)."""
        self._revision_reported = ""

    def _register(self, spec: NamespaceSpec) -> bytes:
        """Register a draft revision with kvtier; returns its namespace."""
        client = self.calls.client
        if client is None:
            raise KVTierError("kvtier is not connected")
        return client.register_pool(spec, self.plan.chunk_bytes)

    def connected(self) -> None:
        """A client was taken up: the namespace registered for the plan is the draft's."""
        self.tracker.namespace = self.namespaces.get(self.plan.key)

    def follow_once(self, step: int) -> None:
        """Follow kvtier's view at the first lookup of ``step``."""
        if self._followed != step:
            self._followed = step
            self.sync(follow=True)

    def follow_next_step(self) -> None:
        """Follow kvtier now, and again at the next step's first lookup."""
        self.sync(follow=True)
        self._followed = -1

    def sync(self, follow: bool) -> None:
        """Follow kvtier's view of the draft pool (``follow``), then use its namespace."""
        client = self.calls.client
        if client is None:
            return
        if follow:
            try:
                self.tracker.follow(client.draft_states())
            except KVTierError as exc:
                self.calls.failed("draft state", exc)
        if self.tracker.namespace is None:
            self.namespaces.pop(self.plan.key, None)
        else:
            self.namespaces[self.plan.key] = self.tracker.namespace

    def reset(self) -> None:
        """vLLM dropped its prefix cache: drop the pool until its weights are fingerprinted
        again or kvtier names the revision."""
        self.tracker.reset()
        client = self.calls.client
        if client is not None:
            try:
                self.tracker.follow(client.draft_states(refresh=True))
            except KVTierError as exc:
                self.calls.failed("draft state", exc)
            self.sync(follow=False)

    def reported(self, fingerprints: dict[Any, Any]) -> None:
        """The workers fingerprinted the draft's weights."""
        self.tracker.reported(fingerprints)
        self.sync(follow=False)

    def scheduled(
        self, stats: DraftStats, req_id: str, computed: int, fill: Fill, out: Any
    ) -> None:
        """A step of ``req_id`` is scheduled: settle its last step's acceptance and note the
        draft tokens this one verifies."""
        self.settle(stats, req_id, computed)
        drafts = getattr(out, "scheduled_spec_decode_tokens", {}).get(req_id)
        if drafts:
            self._acceptance.scheduled(req_id, computed, len(drafts), self.tracker.revision, fill)

    def settle(self, stats: DraftStats, req_id: str, computed: int) -> None:
        settled = self._acceptance.progressed(req_id, computed)
        if settled is not None:
            stats.spec(*settled)

    def report(self, stats: DraftStats) -> None:
        """The revision in use, when it changed, and the swaps followed since the last report."""
        if self.tracker.revision != self._revision_reported:
            self._revision_reported = self.tracker.revision
            stats.revision(self.tracker.revision)
        for source in self.tracker.swaps:
            stats.swap(source)
        self.tracker.swaps.clear()
