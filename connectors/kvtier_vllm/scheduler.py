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
from kvtier.core.keys import Pool
from kvtier.core.protocol import SlotRef, TierClient
from kvtier.hidden.reader import HiddenStatesRef
from kvtier.rpc import DaemonStalledError
from kvtier_vllm.abandon import AbandonedLoads
from kvtier_vllm.adapter import (
    eagle_block_drop,
    failure_policy_warning,
    publishes_kv_events,
    replica_of,
)
from kvtier_vllm.capture import Capture, Manifests
from kvtier_vllm.config import ConnectorConfig
from kvtier_vllm.draft import Fill
from kvtier_vllm.draft_pool import DraftPool
from kvtier_vllm.events import KVEventFeed
from kvtier_vllm.layout import engine_plans
from kvtier_vllm.leases import Leases
from kvtier_vllm.lmdb_loads import readable_lmdb
from kvtier_vllm.lookups import Lookups
from kvtier_vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier_vllm.planner import Asked, HitPlanner, LoadPlan
from kvtier_vllm.requests import RequestState
from kvtier_vllm.session import Session, close_client
from kvtier_vllm.spans import targets_of
from kvtier_vllm.stats import KVTierStats, take
from kvtier_vllm.stores import Stores
from kvtier_vllm.timings import StepTimings
from kvtier_vllm.unreturned import Return, Unreturned
from kvtier_vllm.verify import Verifier
from kvtier_vllm.weights import adapter_uncached

log = logging.getLogger(__name__)
_LEASE_STEPS = 2  # a load's leases outlive the step that copies it
_REPORT_EVERY_S = 0.25  # hits answered from the arena index reach kvtierd this often


class KVTierScheduler(Lookups, AbandonedLoads):
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self.timings = StepTimings(cfg.recompute_wait_share)
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
        self.manifests = Manifests()
        self.async_loads = len(groups) > 1
        """Several groups: vLLM takes load failures only per request, after an async load."""
        self.stats = KVTierStats()
        self.namespaces: dict[str, bytes] = {}
        """Per plan key; a pool without one is not stored (a draft mid-swap)."""
        self.draft_pool = (
            DraftPool(self.draft_plan, cfg, self.namespaces, lambda: self.client, self._guard)
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
            self.lmdb_path = readable_lmdb(client, self.cfg.lmdb_loads)
            coded = client.coded()
            self.verifier.codes({k: coded[ns] for k, ns in self.namespaces.items() if ns in coded})
            if self.draft_pool is not None:
                self.draft_pool.connected()
            self.planner = HitPlanner(
                client,
                self.plans,
                self.namespaces,
                chunk_tokens=self.chunk_tokens,
                blocks_per_chunk=self.cfg.blocks_per_chunk,
                checkpoint=self.checkpoint,
                drop_last=self.drop_last,
                wait_s=self.cfg.promote_wait_ms / 1000,
                recompute_wait=self.timings.recompute_wait,
                draft=self.draft,
                leases=self.leases,
                unreturned=self.unreturned,
                on_error=self._guard,
                in_lmdb=bool(self.lmdb_path),
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
        stats, self.stats = take(self.stats)
        return stats

    # -- guarded calls into kvtier --------------------------------------------------------

    def _guard(self, what: str, error: KVTierError) -> None:
        if not self._failing and not isinstance(error, DaemonStalledError):  # the client said
            log.error("kvtier %s failed; serving without it until it is back: %s", what, error)
        self._failing = True

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
        meta.lmdb_path = self.lmdb_path
        if self.client is None:
            return meta
        self.unreturned.retry(self.client)
        if self.draft_pool is not None:
            self.draft_pool.follow_next_step()
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
        self.stores.expire(self._step)
        self.timings.began(scheduler_output)
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
        ref, params = self.manifests.reference(capture, request, self.client, self._guard)
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
        tail = capture.stored_tail(request, ref, namespace, block_ids[capture.plan.group])
        if tail is None:
            return False
        return self.stores.reserve_one(meta, capture.plan, tail.key, tail.blocks, self._step)

    def _forget(self, request: Any) -> None:
        self._failed_loads.discard(request.request_id)
        if self.draft_pool is not None:
            self.draft_pool.settle(self.stats, request.request_id, request.num_computed_tokens)
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
        close_client(client)
