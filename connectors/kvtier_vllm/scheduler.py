"""The connector's scheduler side: vLLM's scheduler hooks, per request and per step.

It holds the only TierClient (`session.Session`: the tiers themselves in embedded mode, or a
session with kvtierd), finds hits and plans their loads with `planner.HitPlanner`, and reserves
and commits what the workers store with `stores.Stores`. Every call into kvtier is guarded: if
the tiers fail (a daemon that is gone), the engine goes on as if there were no connector, and
the client finds the daemon again by itself.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable
from typing import Any

from kvtier.core.errors import KVTierError
from kvtier.core.keys import NamespaceSpec, Pool
from kvtier.core.protocol import SlotRef, TierClient
from kvtier.hidden.reader import REF_FIELD, HiddenStatesRef
from kvtier.rpc import DaemonStalledError
from kvtier_vllm.adapter import (
    eagle_block_drop,
    failure_policy_warning,
    publishes_kv_events,
    replica_of,
)
from kvtier_vllm.capture import Capture, Manifests
from kvtier_vllm.config import ConnectorConfig
from kvtier_vllm.draft import AcceptanceMeter, DraftTracker, Fill
from kvtier_vllm.events import KVEventFeed
from kvtier_vllm.layout import (
    PoolPlan,
    UnsupportedGroupError,
    kv_groups,
    misplaced_draft,
    plan_pools,
)
from kvtier_vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier_vllm.planner import Asked, HitPlanner, Leases, LoadPlan, targets_of
from kvtier_vllm.requests import RequestState
from kvtier_vllm.session import Session
from kvtier_vllm.shapes import refusal
from kvtier_vllm.stats import KVTierStats, take
from kvtier_vllm.stores import Stores
from kvtier_vllm.unreturned import Return, Unreturned
from kvtier_vllm.verify import Sampled, Verifier
from kvtier_vllm.weights import adapter_uncached

log = logging.getLogger(__name__)
_LEASE_STEPS = 2  # a load's leases outlive the step that copies it
_REPORT_EVERY_S = 0.25  # hits answered from the arena index reach kvtierd this often


class KVTierScheduler:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = self.block_size * cfg.blocks_per_chunk
        self.checkpoint = (
            max(1, cfg.window_checkpoint_tokens // self.chunk_tokens)
            if cfg.window_checkpoint_tokens
            else 0
        )
        """Chunks between the sliding windows kept for shorter prefixes (0: none)."""
        self.replica = cfg.replica_id or replica_of(vllm_config)
        self.refusal = ""
        """Why this engine's KV is never cached (set at start, for good)."""
        cfg = self._stable(cfg, vllm_config)
        self.plans: list[PoolPlan] = []
        try:
            groups = kv_groups(kv_cache_config)
            self.refusal = refusal(vllm_config) or misplaced_draft(vllm_config, groups)
            if not self.refusal:
                self.plans = plan_pools(vllm_config, groups, cfg)
        except UnsupportedGroupError as exc:
            groups, self.refusal = [], str(exc)
        if self.refusal:
            log.error("kvtier is off for this engine: %s", self.refusal)
            groups = []
        self.by_key = {plan.key: plan for plan in self.plans}
        self.targets = targets_of(self.plans)
        self.anchor = self.targets[0] if self.targets else None
        """The plan whose chunks stand for a hit: in KV events and hit sources."""
        self.drop_last = eagle_block_drop(vllm_config) and len(self.targets) == 1
        """As vLLM's own prefix cache: a hit's last chunk is recomputed, so the drafter's KV of
        its last position is written from this request's next token. (With several groups the
        sliding windows would no longer be the stored ones: there the chunk is kept.)"""
        self.draft_plan = next((p for p in self.plans if p.pool is Pool.DRAFT), None)
        hidden = next((p for p in self.plans if p.pool is Pool.HIDDEN), None)
        self.capture = Capture(hidden) if hidden is not None else None
        """Hidden states captured: each finished request gets a reference to them."""
        self.manifests = Manifests()
        self.async_loads = len(groups) > 1
        """Several groups: vLLM takes load failures only per request, after an async load."""
        draft = self.draft_plan
        self.draft = (
            DraftTracker(draft.spec, self._register_draft, cfg.draft_fill, cfg.draft_check_steps)
            if draft is not None
            else None
        )
        self.stats = KVTierStats()
        self._acceptance = AcceptanceMeter()
        self._followed = -1
        self._revision_reported = ""
        self.namespaces: dict[str, bytes] = {}
        """Per plan key; a pool without one is not stored (a draft mid-swap)."""
        self.arena_path = ""
        self.events = KVEventFeed(self.block_size, publishes_kv_events(vllm_config))
        self.leases = Leases(_LEASE_STEPS)
        self.verifier = Verifier(
            cfg.verify_sample_rate, cfg.verify_max_error, self.by_key, cfg.verify_seed
        )
        self.unreturned = Unreturned()
        """Refs a failed call did not hand back: handed back on later steps."""
        self._failing = False
        self.planner: HitPlanner | None = None
        self.stores: Stores | None = None
        """Plan loads and stores over the client in use; made when one is taken up."""
        self.session = Session(
            self.cfg,
            self.replica,
            self.plans,
            self.namespaces,
            self.shutdown,
            self.draft,
            self.events,
        )
        self._connect(wait=True)
        self._requests: dict[str, RequestState] = {}
        self._ready_loads: dict[str, LoadPlan] = {}
        self._queued = KVTierMetadata()
        """Asynchronous loads planned since the last step, for the next step's metadata."""
        self._queued_leases: list[SlotRef] = []
        self._step = 0
        self._unanswered: list[Asked] = []
        """Requests asked again next step, their lookups still with kvtierd."""
        self._failed_loads: set[str] = set()
        """Requests whose asynchronous load failed: vLLM recomputes them, without kvtier."""
        if self.plans and (warning := failure_policy_warning(vllm_config)):
            log.warning("kvtier: %s", warning)
        log.info(
            "kvtier connector: %s mode, replica %s, pools %s, arena %s",
            cfg.mode,
            self.replica,
            {p.key: p.chunk_bytes for p in self.plans},
            self.arena_path,
        )

    @property
    def client(self) -> TierClient | None:
        return self.session.client

    def _connect(self, wait: bool = False) -> bool:
        """Whether the tiers are open (see `Session.connect`); loads and stores of a client just
        taken up are planned over it."""
        if not self.session.connect(wait):
            return False
        client = self.session.client
        if self.planner is None and client is not None:
            self.arena_path = str(client.arena_path)
            if self.draft is not None and self.draft_plan is not None:
                self.draft.namespace = self.namespaces.get(self.draft_plan.key)
            self.planner = HitPlanner(
                client,
                self.plans,
                self.namespaces,
                chunk_tokens=self.chunk_tokens,
                blocks_per_chunk=self.cfg.blocks_per_chunk,
                checkpoint=self.checkpoint,
                drop_last=self.drop_last,
                wait_s=self.cfg.promote_wait_ms / 1000,
                draft=self.draft,
                leases=self.leases,
                unreturned=self.unreturned,
                on_error=self._guard,
            )
            self.stores = Stores(
                client,
                self.plans,
                self.namespaces,
                self.events,
                self.unreturned,
                self._guard,
                chunk_tokens=self.chunk_tokens,
                blocks_per_chunk=self.cfg.blocks_per_chunk,
                checkpoint=self.checkpoint,
                draft=self.draft,
            )
        return True

    @staticmethod
    def _stable(cfg: ConnectorConfig, vllm_config: Any) -> ConnectorConfig:
        algo = vllm_config.cache_config.prefix_caching_hash_algo
        if algo.startswith("xxhash") and not os.environ.get("PYTHONHASHSEED"):
            log.warning(
                "prefix_caching_hash_algo=%s seeds block hashes per process: kvtier keeps this "
                "engine's chunks to itself. Set PYTHONHASHSEED or use sha256 to share them.",
                algo,
            )
            return cfg.model_copy(
                update={"tenant": f"{cfg.tenant[:39]}-process-{uuid.uuid4().hex[:16]}"}
            )
        return cfg

    # -- the draft pool through swaps -----------------------------------------------------

    def _register_draft(self, spec: NamespaceSpec) -> bytes:
        """Register a draft revision with kvtier; returns its namespace."""
        if self.client is None or self.draft_plan is None:
            raise KVTierError("kvtier is not connected")
        return self.client.register_pool(spec, self.draft_plan.chunk_bytes)

    def _sync_draft(self, follow: bool) -> None:
        """Follow kvtier's view of the draft pool (``follow``), then use its namespace."""
        if self.draft is None or self.draft_plan is None or self.client is None:
            return
        if follow:
            self._followed = self._step
            try:
                self.draft.follow(self.client.draft_states())
            except KVTierError as exc:
                self._guard("draft state", exc)
        if self.draft.namespace is None:
            self.namespaces.pop(self.draft_plan.key, None)
        else:
            self.namespaces[self.draft_plan.key] = self.draft.namespace

    def reset_cache(self) -> None:
        """vLLM dropped its prefix cache (pause_generation(clear_cache=True), around weight
        updates): drop the draft pool until its weights are fingerprinted again or kvtier names
        the revision; the target pool is kept."""
        if self.draft is None:
            return
        self.draft.reset()
        if self.client is not None:
            try:
                self.draft.follow(self.client.draft_states(refresh=True))
            except KVTierError as exc:
                self._guard("draft state", exc)
            self._sync_draft(follow=False)

    def _count_acceptance(self, req_id: str, computed: int, state: RequestState, out: Any) -> None:
        settled = self._acceptance.progressed(req_id, computed)
        if settled is not None:
            self.stats.spec(*settled)
        drafts = getattr(out, "scheduled_spec_decode_tokens", {}).get(req_id)
        if drafts and self.draft is not None:
            self._acceptance.scheduled(
                req_id, computed, len(drafts), self.draft.revision, state.fill
            )

    def take_stats(self) -> KVTierStats | None:
        """Acceptance per draft revision and fill, fills, swaps and the revision in use."""
        if self.draft is not None:
            if self.draft.revision != self._revision_reported:
                self._revision_reported = self.draft.revision
                self.stats.revision(self.draft.revision)
            for source in self.draft.swaps:
                self.stats.swap(source)
            self.draft.swaps.clear()
        stats, self.stats = take(self.stats)
        return stats

    # -- guarded calls into kvtier --------------------------------------------------------

    def _guard(self, what: str, error: KVTierError) -> None:
        if not self._failing and not isinstance(error, DaemonStalledError):  # the client said
            log.error("kvtier %s failed; serving without it until it is back: %s", what, error)
        self._failing = True

    # -- lookups --------------------------------------------------------------------------

    def state(self, request: Any) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = RequestState(request)
        return state

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self._failed_loads or not self._connect():
            return 0, False  # a load that failed once is recomputed, not tried again
        if self.client is not None and not self.client.serving:
            return 0, False  # kvtierd does not answer in time: no call, no wait
        if adapter_uncached(request):
            return 0, False
        state = self.state(request)
        if state.sampled is not None:
            return 0, False  # vLLM computes it: the hit is compared with what it computes
        assert self.client is not None  # connected above
        if self.verifier.refuses(self.namespaces.values(), self.client.quarantined()):
            return 0, False  # a chunk of these pools was wrong: none is trusted
        state.local_hit = num_computed_tokens
        if self._followed != self._step:
            self._sync_draft(follow=True)
        self.session.touch(True)
        held = self._held_answer(state, request, num_computed_tokens)
        if held is not None:
            return held, self.async_loads  # asked again while it waits for room: no call
        if self._still_missing(state, request, num_computed_tokens):
            return 0, False
        self._drop_plan(state)
        wait_s = self.cfg.promote_wait_ms / 1000
        if self.draft is not None and self.draft.awaiting and state.asked.may_wait(wait_s):
            return None, False  # one step: the workers fingerprint the draft weights in it
        limit = self._hit_limit(request)
        first = num_computed_tokens // self.chunk_tokens
        if limit <= first:
            return 0, False
        assert self.planner is not None  # made with the client
        wait_s = self.cfg.lookup_wait_ms / 1000
        try:
            if not self.planner.answered(state.asked, request.block_hashes, first, limit, wait_s):
                self._unanswered.append(state.asked)
                return None, False  # kvtierd's answer is on its way: ask again next step
            plan = self.planner.plan(state.asked, request.block_hashes, first, limit)
        except KVTierError as exc:
            self._guard("lookup", exc)
            return 0, False
        self._failing = False
        if plan is None:
            return None, False  # chunks are on their way into the arena: ask again
        if plan.chunks == 0:
            state.missed = (num_computed_tokens, self._draft_revision())
            return 0, False
        state.missed = None
        if self.verifier.sample(self._step):
            state.sampled = Sampled(plan)
            return 0, False
        state.plan = plan
        state.plan_revision = self._draft_revision()
        state.local_tokens = num_computed_tokens
        tokens = (first + plan.chunks) * self.chunk_tokens - num_computed_tokens
        return tokens, self.async_loads

    def _draft_revision(self) -> str | None:
        return self.draft.revision if self.draft is not None else None

    def _held_answer(self, state: RequestState, request: Any, computed: int) -> int | None:
        """The tokens of the load answered last time, when nothing it rests on has changed."""
        assert self.planner is not None  # made with the client
        limit = self._hit_limit(request)
        return state.held_tokens(self.planner, computed, self._draft_revision(), limit)

    def _still_missing(self, state: RequestState, request: Any, computed: int) -> bool:
        assert self.planner is not None  # made with the client
        return state.still_missing(self.planner, computed, self._draft_revision())

    def _hit_limit(self, request: Any) -> int:
        """The most chunks a lookup may find: at least one prompt token is always computed, to
        produce the first output (with ``drop_last``, the chunk dropped from the hit ensures it)."""
        prompt = len(request.prompt_token_ids or ())
        hashed = len(request.block_hashes) // self.cfg.blocks_per_chunk
        readable = prompt if self.drop_last else prompt - 1
        return int(min(readable // self.chunk_tokens, hashed))

    def _drop_plan(self, state: RequestState) -> None:
        if state.plan is not None:
            self._release(state.plan.refs())
            state.plan = None

    def _release(self, refs: list[SlotRef]) -> None:
        if not refs or self.client is None:
            return
        try:
            self.client.release(refs)
        except KVTierError as exc:
            self.unreturned.keep(Return.RELEASE, refs)
            self._guard("release", exc)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if adapter_uncached(request):
            return  # no state: nothing of it is stored
        state = self.state(request)
        if num_external_tokens == 0 or state.plan is None:
            self._drop_plan(state)
            return
        plan, state.plan = state.plan, None
        state.hit = plan
        if not self.async_loads:
            self._ready_loads[request.request_id] = plan
            return
        # the request waits for this load; its blocks are known now, the copies go out with
        # the next step's metadata and the workers report the request done or failed
        state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        self._queued_leases.extend(self._add_load(self._queued, state, plan))
        self._queued.receiving.append(request.request_id)

    def abandon_load(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Planning a granted load failed: the blocks vLLM allocated for it are reported as
        load errors (a request waiting for an asynchronous load: failed), never left as if
        they held the prefix."""
        req_id = request.request_id
        self._ready_loads.pop(req_id, None)
        state = self._requests.get(req_id)
        local = state.local_hit if state is not None else 0
        first = local // self.block_size
        end = (local + num_external_tokens + self.block_size - 1) // self.block_size
        if self.async_loads:
            self._queued.failed_requests.append(req_id)
            return
        for ids in blocks.get_block_ids():
            self._queued.invalid_blocks.extend(b for b in ids[first:end] if b)

    def abandon_step(self, scheduler_output: Any) -> KVTierMetadata:
        """The metadata of a step whose planning failed: every load granted for it is
        reported failed, and nothing is stored."""
        meta, self._queued = self._queued, KVTierMetadata()
        failed = KVTierMetadata(
            arena_path=self.arena_path,
            invalid_blocks=meta.invalid_blocks,
            failed_requests=meta.failed_requests + meta.receiving,
            sending=meta.sending,  # their tails are not stored: their blocks may go
        )
        self._release(self._queued_leases)
        self._queued_leases = []
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._ready_loads.pop(new.req_id, None)
            state = self._requests.get(new.req_id)
            if plan is None or state is None:
                continue
            first = state.local_tokens // self.block_size
            end = (plan.first_chunk + plan.chunks) * self.cfg.blocks_per_chunk
            for ids in new.block_ids:
                failed.invalid_blocks.extend(b for b in ids[first:end] if b)
            self._release(plan.refs())
        return failed

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """External tokens by the tier that held them: "host" (arena), "disk" (lmdb) or
        "external_unspecified" (the object store)."""
        state = self._requests.get(request.request_id)
        plan = state.hit if state is not None else None
        if state is None or plan is None or num_external_tokens == 0:
            return {}
        sources = plan.sources(state.local_tokens, self.chunk_tokens)
        return sources if sum(sources.values()) == num_external_tokens else {}

    # -- per step -------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        self._step += 1
        unanswered, self._unanswered = self._unanswered, []
        if not scheduler_output.total_num_scheduled_tokens:
            # nothing runs: waiting holds up no one, and the next step schedules them all
            HitPlanner.wait_for_answers(unanswered, self.cfg.lookup_deadline_ms / 1000)
        self.session.touch(bool(self._requests))
        meta, self._queued = self._queued, KVTierMetadata()
        if self.client is not None:  # a restarted daemon may have put its arena elsewhere
            self.arena_path = str(self.client.arena_path)
        meta.arena_path = self.arena_path
        if self.client is None:
            return meta
        self.unreturned.retry(self.client)
        self._sync_draft(follow=True)
        self._followed = -1  # the next step's first lookup follows kvtier again
        if self.draft is not None:
            meta.draft_check = self.draft.check_due()
            meta.draft_fingerprints = dict(self.draft.bound)
        self._release(self.leases.step(self._queued_leases))
        self._queued_leases = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            plan = self._ready_loads.pop(new.req_id, None)
            if plan is not None:
                self.leases.newest.extend(self._add_load(meta, state, plan))
            self._add_stores(meta, state, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            self._count_acceptance(req_id, cached.num_computed_tokens[i], state, scheduler_output)
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                for group, ids in zip(state.block_ids, new_ids, strict=False):
                    group.extend(ids)
            self._add_stores(meta, state, cached.num_computed_tokens[i], scheduler_output)
        # compared after this step's forward, which computes them; the leases outlive it
        meta.checks, leases = self.verifier.hand_out()
        self.leases.newest.extend(leases)
        assert self.stores is not None  # made with the client
        self.stores.expire(self._step)
        return meta

    def _add_load(self, meta: KVTierMetadata, state: RequestState, plan: LoadPlan) -> list[SlotRef]:
        """The copies of a granted load into the request's blocks; returns its leases, to give
        back once the workers copied them."""
        plan.add_copies(
            meta,
            state.block_ids,
            self.by_key,
            skip=state.local_tokens // self.block_size,
            request=state.request.request_id if self.async_loads else "",
            chunk_tokens=self.chunk_tokens,
            blocks_per_chunk=self.cfg.blocks_per_chunk,
        )
        state.fill = plan.fill
        if plan.fill is not Fill.NONE and plan.chunks:
            self.stats.fill(plan.fill, plan.chunks)
        state.stored_chunks = max(state.stored_chunks, plan.first_chunk + plan.chunks)
        return plan.refs()

    def _add_stores(
        self, meta: KVTierMetadata, state: RequestState, computed: int, out: Any
    ) -> None:
        request = state.request
        done = computed + out.num_scheduled_tokens.get(request.request_id, 0)
        capture = self.capture
        if (
            capture is not None
            and not state.tail_stored
            and done >= request.num_prompt_tokens
            and not capture.with_outputs(request)
        ):
            state.tail_stored = True  # the prompt's states are all computed by this step
            self._store_tail(meta, request, capture.reference(request), state.block_ids)
        bpc = self.cfg.blocks_per_chunk
        blocks_known = min((len(ids) for ids in state.block_ids), default=0)
        full = min(done // self.chunk_tokens, len(request.block_hashes) // bpc, blocks_known // bpc)
        if full <= state.stored_chunks:
            return
        chunks = range(state.stored_chunks, full)
        state.stored_chunks = full
        if state.sampled is not None:
            self.verifier.computed(state.sampled, state.block_ids, chunks, bpc)
        assert self.stores is not None  # made with the client
        # a sliding window is stored where the prompt's own hit would read it, and past it
        end = self._hit_limit(request) - int(self.drop_last)
        self.stores.reserve(
            meta, request, state.block_ids, chunks, end, state.local_hit, self._step, self.stats
        )

    def take_events(self) -> list[object]:
        """vLLM asks after each step's forward: what goes to kvtierd now competes with no copy."""
        if self.client is not None:
            try:
                self.client.report_hits(_REPORT_EVERY_S)
                self.events.poll(self.client)
            except KVTierError as exc:
                self._guard("hit report", exc)
        return self.events.take()

    def update_connector_output(self, worker_meta: Any, failed_loads: Iterable[str] = ()) -> None:
        for req_id in failed_loads:
            if req_id in self._requests:
                log.warning("kvtier: the load of request %s failed; vLLM recomputes it", req_id)
                self._failed_loads.add(req_id)
        if self.client is None or not isinstance(worker_meta, KVTierWorkerMetadata):
            return
        if self.draft is not None and worker_meta.draft_fingerprints:
            self.draft.reported(worker_meta.draft_fingerprints)
            self._sync_draft(follow=False)
        assert self.stores is not None  # made with the client
        self.stores.reported(worker_meta.stored, worker_meta.failed)
        self.verifier.reported(worker_meta.checked, self.stats)
        self._report_quarantines()

    def _report_quarantines(self) -> None:
        """Tell the tiers of namespaces found wrong here: every engine then stops loading them."""
        while self.verifier.to_report and self.client is not None:
            namespace, why = self.verifier.to_report[0]
            try:
                self.client.quarantine_namespace(namespace, why)
            except KVTierError as exc:
                self._guard("quarantine", exc)
                return  # tried again with the next report
            self.verifier.to_report.pop(0)

    def request_finished(
        self, request: Any, block_ids: list[list[int]] | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """(keep the request's blocks until the workers report it sent, its
        ``kv_transfer_params``): with hidden states captured, their reference, and the tail
        the next step stores."""
        state = self._requests.get(request.request_id)
        self._forget(request)
        if state is None:
            return False, None  # never scheduled: no state was computed
        return self._captured(request, block_ids or state.block_ids)

    def _captured(
        self, request: Any, block_ids: list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        capture = self.capture
        if capture is None or capture.plan.key not in self.namespaces:
            return False, None
        ref = capture.reference(request)
        params = {REF_FIELD: ref.to_json()}
        if self.client is not None:
            try:
                self.manifests.write(self.client, ref)
            except KVTierError as exc:  # the reference stands; only listing it is lost
                self._guard("manifest", exc)
        if not capture.with_outputs(request):
            return False, params  # the prompt's tail was stored with its last token
        # vLLM asserts each request reported sent is one it keeps: the last step here
        keep = self._store_tail(self._queued, request, ref, block_ids)
        if keep:
            self._queued.sending.append(request.request_id)
        return keep, params

    def _store_tail(
        self, meta: KVTierMetadata, request: Any, ref: HiddenStatesRef, block_ids: list[list[int]]
    ) -> bool:
        """Reserve the request's hidden-state tail, copied with ``meta``'s stores; whether a
        copy was added (none: no tail, present already, no room)."""
        capture = self.capture
        namespace = self.namespaces.get(capture.plan.key) if capture is not None else None
        if capture is None or namespace is None or self.stores is None:
            return False
        tail = capture.tail(ref, namespace, block_ids[capture.plan.group])
        if tail is None:
            return False
        if not tail.blocks or not all(tail.blocks):
            log.warning(
                "kvtier: request %s's last blocks are gone: its hidden-state tail is not stored",
                request.request_id,
            )
            return False
        return self.stores.reserve_one(meta, capture.plan, tail.key, tail.blocks, self._step)

    def _forget(self, request: Any) -> None:
        self._failed_loads.discard(request.request_id)
        settled = self._acceptance.progressed(request.request_id, request.num_computed_tokens)
        if settled is not None:
            self.stats.spec(*settled)
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._drop_plan(state)
            if state.sampled is not None:
                self._release(state.sampled.unchecked())
        plan = self._ready_loads.pop(request.request_id, None)
        if plan is not None:
            self._release(plan.refs())
        self.session.touch(bool(self._requests))

    def shutdown(self) -> None:
        self.session.stop()
        self.manifests.close()
        if self.client is None:
            return
        for refs in self.leases:
            self._release(refs)
        if self.stores is not None:
            self.stores.abort_all()
        self.unreturned.retry(self.client, force=True)
        client = self.session.detach()
        self.planner = self.stores = None
        assert client is not None
        client.close()  # embedded: writes what the arena holds to lmdb
