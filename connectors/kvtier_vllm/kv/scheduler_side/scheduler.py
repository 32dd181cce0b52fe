"""The connector's scheduler side: vLLM's scheduler hooks, per request and per step.

`KVTierScheduler` keeps each request's `requests.RequestState` and composes the parts that do
the work over the only TierClient, which `session.Session` opens (the tiers themselves in
embedded mode, or a session with kvtierd) and opens again after a failure: each request's
`hit_decision.HitDecision` answers vLLM's asks (over the `hit_setup.HitSetup` they share, its
leases taken and cut by `leases.LoadLeases`), `pending_loads.PendingLoads`
keeps the loads vLLM granted until a step's metadata carries them (or reports them failed),
and `stores.Stores` reserves and commits what the workers store. `tier_calls.TierCalls` holds
whether the calls into the tiers are failing, for every part that calls them (the draft pool and
the hidden-state manifests too), and hands back what they took: while they fail, the engine goes
on as if kvtier had missed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvtier.core.costs import CostSnapshot
from kvtier.core.errors import KVTierError
from kvtier.core.keys import Pool
from kvtier.core.protocol import TierClient
from kvtier.hidden.reader import HiddenStatesRef
from kvtier_vllm.drafts.pool import DraftPool
from kvtier_vllm.hidden_capture.tails import Capture, Manifests
from kvtier_vllm.kv.connector_stats import KVTierStats, take_report
from kvtier_vllm.kv.lmdb_staging import readable_lmdb
from kvtier_vllm.kv.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier_vllm.kv.scheduler_side.events import KVEventFeed
from kvtier_vllm.kv.scheduler_side.hit_decision import HitDecision, hit_limit
from kvtier_vllm.kv.scheduler_side.hit_setup import HitSetup
from kvtier_vllm.kv.scheduler_side.leases import Leases
from kvtier_vllm.kv.scheduler_side.load_decisions import LoadDecisions
from kvtier_vllm.kv.scheduler_side.load_modes import LoadModes, expected_load_s
from kvtier_vllm.kv.scheduler_side.pending_loads import PendingLoads
from kvtier_vllm.kv.scheduler_side.prompt_keys import stable_tenant, targets_of
from kvtier_vllm.kv.scheduler_side.requests import RequestState
from kvtier_vllm.kv.scheduler_side.stores import Stores
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls
from kvtier_vllm.kv.scheduler_side.timings import StepTimings
from kvtier_vllm.kv.scheduler_side.verify import Verifier
from kvtier_vllm.layout.plans import engine_plans
from kvtier_vllm.shared.connection import Session, close_client
from kvtier_vllm.shared.settings import ConnectorConfig
from kvtier_vllm.shared.vllm_compat import (
    eagle_block_drop,
    failure_policy_warning,
    publishes_kv_events,
    replica_of,
)
from kvtier_vllm.shared.weights import adapter_uncached

log = logging.getLogger(__name__)
_LEASE_STEPS = 2  # a load's leases outlive the step that copies it
_REPORT_EVERY_S = 0.25  # hits answered from the arena index reach kvtierd this often


class KVTierScheduler:
    """vLLM's scheduler-side hooks: per request, its `RequestState` and its hit decision;
    per step, the metadata of the loads granted and the stores reserved for the workers."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self.timings = StepTimings(cfg.recompute_wait_share)
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = self.block_size * cfg.blocks_per_chunk
        checkpoint = cfg.window_checkpoint_tokens
        self.checkpoint = max(1, checkpoint // self.chunk_tokens) if checkpoint else 0
        """Chunks between the sliding windows kept for shorter prefixes (0: none)."""
        self.replica = cfg.replica_id or replica_of(vllm_config)
        self.refusal = ""
        """Why this engine's KV is never cached (set at start, for good)."""
        cfg = stable_tenant(cfg, vllm_config)
        self.plans, groups, self.refusal = engine_plans(vllm_config, kv_cache_config, cfg)
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
        self.stats = KVTierStats()
        several = len(groups) > 1
        self.modes = LoadModes(cfg.load_mode, self.timings, self._costs, several_groups=several)
        self.namespaces: dict[str, bytes] = {}
        """Per plan key; a pool without one is not stored (a draft mid-swap)."""
        self.calls = TierCalls(None)
        self.manifests = Manifests(self.calls)
        """Captured states' manifests, written beside them."""
        self.draft_pool = (
            DraftPool(self.draft_plan, cfg, self.namespaces, self.calls)
            if self.draft_plan is not None
            else None
        )
        self.draft = self.draft_pool.tracker if self.draft_pool is not None else None
        self.arena_path = ""
        self.lmdb_path = ""
        """Where the workers read loads leased in lmdb ("": none is leased there)."""
        self.events = KVEventFeed(self.block_size, publishes_kv_events(vllm_config))
        self.leases = Leases(_LEASE_STEPS)
        self.verifier = Verifier(
            cfg.verify_sample_rate, cfg.verify_max_error, self.by_key, cfg.verify_seed
        )
        self.pending = PendingLoads(
            self.calls,
            self.by_key,
            block_size=self.block_size,
            blocks_per_chunk=cfg.blocks_per_chunk,
            block_errors=not several,
        )
        backlog = self.pending.backlog
        self.decisions = LoadDecisions(
            cfg.load_policy, self._costs, backlog.seconds_ahead, self.modes.wait_s
        )
        self.hits: HitSetup | None = None
        self.stores: Stores | None = None
        """Find hits and plan stores over the client in use; made when one is taken up."""
        self.session = Session(
            self.cfg,
            self.replica,
            self.plans,
            self.namespaces,
            self.shutdown,
            self.draft,
            self.events,
        )
        self._requests: dict[str, RequestState] = {}
        self._step = 0
        self._connect(wait=True)
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

    def _costs(self) -> CostSnapshot | None:
        return self.client.costs() if self.client is not None else None

    def _connect(self, wait: bool = False) -> bool:
        """Whether the tiers are open (see `Session.connect`); loads and stores of a client just
        taken up are planned over it."""
        if not self.session.connect(wait):
            return False
        client = self.session.client
        if self.hits is None and client is not None:
            self.calls.client = client
            self.arena_path = str(client.arena_path)
            self.lmdb_path = readable_lmdb(client, self.cfg.lmdb_loads)
            coded = client.coded()
            self.verifier.codes({k: coded[ns] for k, ns in self.namespaces.items() if ns in coded})
            if self.draft_pool is not None:
                self.draft_pool.connected()
            self.hits = HitSetup(
                client,
                self.plans,
                self.namespaces,
                chunk_tokens=self.chunk_tokens,
                blocks_per_chunk=self.cfg.blocks_per_chunk,
                checkpoint=self.checkpoint,
                drop_last=self.drop_last,
                wait_s=self.cfg.promote_wait_ms / 1000,
                lookup_wait_s=self.cfg.lookup_wait_ms / 1000,
                recompute_wait=self.timings.recompute_wait,
                chooser=self.decisions,
                draft=self.draft,
                draft_pool=self.draft_pool,
                leases=self.leases,
                calls=self.calls,
                lmdb_path=self.lmdb_path,
                verifier=self.verifier,
                session=self.session,
            )
            self.stores = Stores(
                client,
                self.plans,
                self.namespaces,
                self.events,
                self.calls,
                chunk_tokens=self.chunk_tokens,
                blocks_per_chunk=self.cfg.blocks_per_chunk,
                checkpoint=self.checkpoint,
                draft=self.draft,
            )
        return True

    def reset_cache(self) -> None:
        """vLLM dropped its prefix cache (pause_generation(clear_cache=True), around weight
        updates): drop the draft pool until its weights are fingerprinted again or kvtier names
        the revision; the target pool is kept."""
        if self.draft_pool is not None:
            self.draft_pool.reset()

    def take_stats(self) -> KVTierStats | None:
        """Acceptance per draft revision and fill, fills, swaps and the revision in use."""
        if self.draft_pool is not None:
            self.draft_pool.report(self.stats)
        self.decisions.report(self.stats)
        self.modes.report(self.stats)
        stats, self.stats = take_report(self.stats)
        return stats

    # -- per request ----------------------------------------------------------------------

    def state(self, request: Any) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = RequestState(request)
            self._requests[request.request_id] = state
        return state

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        known = self._requests.get(request.request_id)
        if (known is not None and known.load_failed) or not self._connect():
            return 0, False  # a load that failed once is recomputed, not tried again
        if self.client is not None and not self.client.serving:
            return 0, False  # kvtierd does not answer in time: no call, no wait
        if adapter_uncached(request):
            return 0, False
        assert self.hits is not None  # made with the client
        state = self.state(request)
        if state.decision is None:
            state.decision = HitDecision(self.hits, request)
        tokens = state.decision.ask(num_computed_tokens, self._step, self.stats)
        plan = state.decision.plan
        state.load_async = bool(tokens) and plan is not None and self.modes.asynchronous(plan)
        return tokens, state.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if adapter_uncached(request):
            return  # no state: nothing of it is stored
        state = self.state(request)
        plan = state.decision.take_plan() if state.decision is not None else None
        if plan is None:
            return
        if num_external_tokens == 0:
            self.calls.release(plan.refs())
            return
        # only an asynchronous load queues behind the others (`LoadBacklog`)
        expected = expected_load_s(plan, self._costs()) if state.load_async else None
        self.pending.grant(state, plan, blocks, self.stats, expected)
        self.modes.granted(plan, state.load_async)

    def abandon_load(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """`update_state_after_alloc` failed: see `PendingLoads.abandon_load`."""
        state = self._requests.get(request.request_id)
        self.pending.abandon_load(request.request_id, state, blocks, num_external_tokens)

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """External tokens by the tier that held them: "host" (arena), "disk" (lmdb) or
        "external_unspecified" (the object store)."""
        state = self._requests.get(request.request_id)
        plan = state.hit if state is not None else None
        if state is None or plan is None or num_external_tokens == 0:
            return {}
        sources = plan.sources(self.chunk_tokens)
        return sources if sum(sources.values()) == num_external_tokens else {}

    # -- per step -------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        self._step += 1
        self.modes.next_step()
        if self.hits is not None:
            # nothing runs: waiting holds up no one, and the next step schedules them all
            idle = not scheduler_output.total_num_scheduled_tokens
            self.hits.next_step(self.cfg.lookup_deadline_ms / 1000 if idle else None)
        self.session.touch(bool(self._requests))
        meta = self.pending.take_queued()
        meta.idle = not scheduler_output.total_num_scheduled_tokens
        if self.client is not None:  # a restarted daemon may have put its arena elsewhere
            self.arena_path = str(self.client.arena_path)
            meta.arena_inode = self.client.arena_inode
        meta.arena_path = self.arena_path
        meta.lmdb_path = self.lmdb_path
        if self.client is None:
            return meta
        self.calls.hand_back()
        if self.draft_pool is not None:
            self.draft_pool.follow_next_step()
        if self.draft is not None:
            meta.draft_check = self.draft.check_due()
            meta.draft_fingerprints = dict(self.draft.bound)
        self.calls.release(self.leases.step(self.pending.take_queued_leases()))
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            plan = self.pending.take_ready(new.req_id)
            if plan is not None:
                self.leases.newest.extend(self.pending.add_copies(meta, state, plan, self.stats))
            self._add_stores(meta, state, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            if self.draft_pool is not None:
                computed = cached.num_computed_tokens[i]
                self.draft_pool.scheduled(
                    self.stats, req_id, computed, state.fill, scheduler_output
                )
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
        # nothing runs: stores asked for earlier may be waited for, holding up no one
        self.stores.reserve(meta, self._step, self.cfg.store_deadline_ms / 1000 * meta.idle)
        self.stores.expire(self._step)
        self.timings.began(scheduler_output)
        meta.sending.extend(self.stores.asks.released())  # last: a failed step abandons them
        return meta

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
        sampled = state.decision.sampled if state.decision is not None else None
        if sampled is not None:
            self.verifier.computed(sampled, state.block_ids, chunks, bpc)
        assert self.stores is not None  # made with the client
        # a sliding window is stored where the prompt's own hit would read it, and past it
        end = hit_limit(request, self.chunk_tokens, bpc, self.drop_last) - int(self.drop_last)
        self.stores.want(request, state.block_ids, chunks, end, state.local_hit, self.stats)

    def abandon_step(self, scheduler_output: Any) -> KVTierMetadata:
        """`build_connector_meta` failed: `PendingLoads.abandon_step`, `StoreAsks.abandon`."""
        meta = self.pending.abandon_step(scheduler_output, self._requests, self.arena_path)
        meta.sending += self.stores.asks.abandon() if self.stores is not None else []
        return meta

    def take_events(self) -> list[object]:
        """vLLM asks after each step's forward: what goes to kvtierd now competes with no copy."""
        if self.client is not None:
            try:
                self.client.report_hits(_REPORT_EVERY_S)
                self.events.poll(self.client)
            except KVTierError as exc:
                self.calls.failed("hit report", exc)
        return self.events.take()

    def update_connector_output(
        self,
        worker_meta: Any,
        failed_loads: Iterable[str] = (),
        failed_blocks: Iterable[int] = (),
        finished_loads: Iterable[str] = (),
    ) -> None:
        try:
            self._take_output(worker_meta, failed_loads, failed_blocks, finished_loads)
        finally:
            if not self._requests:  # nothing left to run: what it stored is visible when idle
                self.calls.settle(self.cfg.store_deadline_ms / 1000)

    def _take_output(
        self,
        worker_meta: Any,
        failed_loads: Iterable[str],
        failed_blocks: Iterable[int],
        finished_loads: Iterable[str],
    ) -> None:
        self.pending.reported(self._requests, finished_loads, failed_loads, self.stats)
        if invalid := set(failed_blocks):
            # one group: a load fails per block, and vLLM recomputes from the first failed one
            for req_id, state in self._requests.items():
                if state.hit is not None and any(
                    not invalid.isdisjoint(b) for b in state.block_ids
                ):
                    log.warning("kvtier: part of request %s's load failed; recomputed", req_id)
                    state.load_failed = True
        if self.client is None:
            return
        ours = isinstance(worker_meta, KVTierWorkerMetadata)
        self.timings.ended(worker_meta.timings if ours else None)
        if (timings := self.timings.take()) is not None:
            self.client.report_timings(timings)
        if not ours:
            return
        if self.draft_pool is not None and worker_meta.draft_fingerprints:
            self.draft_pool.reported(worker_meta.draft_fingerprints)
        assert self.stores is not None  # made with the client
        if worker_meta.failed_chunks:
            self.client.report_failed(worker_meta.failed_chunks)
        self.stores.reported(worker_meta.stored, worker_meta.failed)
        self.verifier.reported(worker_meta.checked, self.stats)
        self.verifier.report_quarantines(self.calls)

    def request_finished(
        self, request: Any, block_ids: list[list[int]] | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """(keep its blocks until reported sent: stores asked for, or its hidden-state tail,
        still to copy from them; its ``kv_transfer_params``: hidden states' reference)."""
        state = self._requests.get(request.request_id)
        self._forget(request)
        if state is None:
            return False, None  # never scheduled: no state was computed
        kept = self.stores is not None and self.stores.asks.keep(request.request_id)
        tail, params = self._captured(request, block_ids or state.block_ids)
        if tail and not kept:  # reported sent after the tail's copy, the next step's
            self.pending.queued.sending.append(request.request_id)
        return kept or tail, params

    def _captured(
        self, request: Any, block_ids: list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """(its hidden-state tail is copied from its blocks next step, its reference)"""
        capture = self.capture
        if capture is None or capture.plan.key not in self.namespaces:
            return False, None
        ref, params = self.manifests.reference(capture, request)
        if not capture.with_outputs(request):
            return False, params  # the prompt's tail was stored with its last token
        return self._store_tail(self.pending.queued, request, ref, block_ids), params

    def _store_tail(
        self, meta: KVTierMetadata, request: Any, ref: HiddenStatesRef, block_ids: list[list[int]]
    ) -> bool:
        """Reserve the request's hidden-state tail, copied with ``meta``'s stores; whether a
        copy was added (none: no tail, present already, no room)."""
        capture = self.capture
        namespace = self.namespaces.get(capture.plan.key) if capture is not None else None
        if capture is None or namespace is None or self.stores is None:
            return False
        tail = capture.stored_tail(request, ref, namespace, block_ids[capture.plan.group])
        if tail is None:
            return False
        return self.stores.reserve_one(meta, capture.plan, tail.key, tail.blocks, self._step)

    def _forget(self, request: Any) -> None:
        if self.draft_pool is not None:
            self.draft_pool.settle(self.stats, request.request_id, request.num_computed_tokens)
        state = self._requests.pop(request.request_id, None)
        decision = state.decision if state is not None else None
        if decision is not None:
            self.calls.release(decision.drop_plan())
            if decision.sampled is not None:
                self.calls.release(decision.sampled.unchecked())
        self.pending.forget(request.request_id)
        self.session.touch(bool(self._requests))

    def shutdown(self) -> None:
        self.session.stop()
        self.manifests.close()
        if self.client is None:
            return
        for refs in self.leases:
            self.calls.release(refs)
        if self.stores is not None:
            self.stores.abort_all()
        self.calls.hand_back(force=True)
        client = self.session.detach()
        self.calls.client = None
        if self.hits is not None:
            self.hits.close()
        self.hits = None
        self.stores = None
        assert client is not None
        close_client(client)
