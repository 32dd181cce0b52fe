"""The connector's scheduler side: lookups, load plans, store reservations, commits.

It holds the only TierClient: the tiers themselves in embedded mode, or a session with kvtierd.
Every call into kvtier is guarded: if the tiers fail (a daemon that is gone), the engine goes on
as if there were no connector, and the client finds the daemon again by itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.client import InProcessClient, SlotRef, TierClient
from kvtier.config import DemoteMode, load_config
from kvtier.errors import KVTierError, PoolLayoutError
from kvtier.keys import ChunkKey, NamespaceSpec, Pool, make_key
from kvtier.manager import TIER_CODES, TierManager
from kvtier.rpc import DaemonStalledError, GrpcTierClient
from kvtier_vllm.adapter import eagle_block_drop, failure_policy_warning, replica_of
from kvtier_vllm.config import ConnectorConfig, Mode
from kvtier_vllm.draft import AcceptanceMeter, DraftTracker, Fill, lease_draft
from kvtier_vllm.events import KVEventFeed
from kvtier_vllm.layout import (
    PoolPlan,
    UnsupportedGroupError,
    kv_groups,
    misplaced_draft,
    plan_pools,
)
from kvtier_vllm.metadata import ChunkCopy, KVTierMetadata, KVTierWorkerMetadata
from kvtier_vllm.shapes import refusal
from kvtier_vllm.stats import KVTierStats
from kvtier_vllm.unreturned import Return, Unreturned
from kvtier_vllm.weights import adapter_uncached

log = logging.getLogger(__name__)
Items = TypeVar("Items", bytes, list[Any])

_CPU = TIER_CODES["cpu"]
# vLLM's CacheHitSource values per tier; the object store is remote, shared storage
_HIT_SOURCES = {TIER_CODES["cpu"]: "host", TIER_CODES["lmdb"]: "disk"}
_REMOTE_SOURCE = "external_unspecified"
_LEASE_STEPS = 2  # a load's leases outlive the step that copies it
_STORE_STEPS = 8  # a reservation no worker confirmed by then is given back
_RECONNECT_S = 5
_REPORT_EVERY_S = 0.25  # hits answered from the arena index reach kvtierd this often
_WRITE_TXN_BYTES = 16 << 20  # per lmdb transaction: a request arriving mid-write waits for one
_WINDOW_TRIES = 4  # sliding-window checks of one lookup, each with a shorter hit


def open_client(cfg: ConnectorConfig, replica: str, chunk_bytes: int = 0) -> TierClient:
    if cfg.mode is Mode.SIDECAR:
        socket = cfg.socket_path or load_config(cfg.kvtier_config).server.socket_path
        return GrpcTierClient(socket, replica, deadlines=cfg.deadlines())
    config = load_config(cfg.kvtier_config)
    update: dict[str, Any] = {}
    if cfg.write_through:
        update["demote_mode"] = DemoteMode.WRITE_THROUGH
    elif chunk_bytes:
        # the connector's idle writer decides when chunks reach lmdb (see _IdleWriter); the
        # manager's reserve counts only the extents a pool holds, so it would write while
        # the engine is busy whenever a pool grows
        batch = max(1, _WRITE_TXN_BYTES // chunk_bytes)
        update["writeback_batch_chunks"] = min(config.manager.writeback_batch_chunks, batch)
        update["clean_reserve"] = 0.0
    if update:
        manager = config.manager.model_copy(update=update)
        config = config.model_copy(update={"manager": manager})
    return InProcessClient(TierManager(config), replica)


def _split(items: Items, spans: list[tuple[PoolPlan, range]]) -> list[Items]:
    """``items`` of consecutive spans, span by span."""
    out = []
    offset = 0
    for _, span in spans:
        out.append(items[offset : offset + len(span)])
        offset += len(span)
    return out


class _IdleWriter:
    """Embedded mode: writes committed arena chunks to lmdb while the engine has no request, or
    while more than ``backlog`` chunks are held only in the arena. Writing next to a forward
    would take CPU time from it; what is left at shutdown is written by `TierManager.close`."""

    def __init__(self, manager: TierManager, idle_s: float, backlog: int) -> None:
        self._manager = manager
        self._idle_s = idle_s
        self._backlog = backlog
        self._active = False
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-idle-writer", daemon=True)
        self._thread.start()

    def touch(self, active: bool) -> None:
        """The engine did something; ``active``: it holds requests."""
        self._active = active
        self._last = time.monotonic()

    def _due(self) -> bool:
        pending = self._manager.cpu.writeback_pending()
        if pending > self._backlog:
            return True
        idle = not self._active and time.monotonic() - self._last >= self._idle_s
        return pending > 0 and idle

    def _run(self) -> None:
        while not self._stop.wait(self._idle_s / 2):
            try:
                while self._due() and not self._stop.is_set():
                    # one transaction per call: flush checks its deadline after each
                    self._manager.flush(timeout=0)
            except Exception:  # never let the writer die silently
                log.exception("kvtier: writing arena chunks to lmdb failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class _LoadPlan:
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


@dataclass
class _Found:
    chunks: int
    tiers: dict[str, tuple[int, bytes]]
    """Per plan key, the first chunk looked up and the tier code of each found from there."""
    pending: bool
    leases: dict[str, tuple[int, list[SlotRef | None]]] | None = None
    """Per plan key, the first chunk and the leases the lookup took, when it took them."""


@dataclass
class _PendingStore:
    """A reserved slot the workers are writing: committed once ``waiting`` parts arrived."""

    ref: SlotRef
    step: int
    waiting: int


@dataclass
class _RequestState:
    request: Any
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV-cache group, the request's blocks by position (0: vLLM's null block)."""
    stored_chunks: int = 0
    waiting_since: float | None = None
    first_tiers: dict[int, int] = field(default_factory=dict)
    """Per chunk, where it was when first asked for (promoted ones came from lmdb)."""
    plan: _LoadPlan | None = None
    hit: _LoadPlan | None = None
    """The load granted, for its hit sources."""
    local_tokens: int = 0
    local_hit: int = 0
    """Tokens vLLM's own prefix cache held when the request was first scheduled."""
    fill: Fill = Fill.NONE


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
        # full-attention plans first: a shorter hit they find never moves their own start
        self.targets = sorted(
            (p for p in self.plans if p.pool is Pool.TARGET), key=lambda p: bool(p.window)
        )
        self.anchor = self.targets[0] if self.targets else None
        self.drop_last = eagle_block_drop(vllm_config) and len(self.targets) == 1
        """As vLLM's own prefix cache: a hit's last chunk is recomputed, so the drafter's KV of
        its last position is written from this request's next token. (With several groups the
        sliding windows would no longer be the stored ones: there the chunk is kept.)"""
        """The plan whose chunks stand for a hit: in KV events and hit sources."""
        self.draft_plan = next((p for p in self.plans if p.pool is Pool.DRAFT), None)
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
        self.client: TierClient | None = None
        self._writer: _IdleWriter | None = None
        self._at_exit: Any = None
        self.namespaces: dict[str, bytes] = {}
        """Per plan key; a pool without one is not stored (a draft mid-swap)."""
        self.arena_path = ""
        self._next_connect = 0.0
        self._opening: threading.Thread | None = None
        self._opened: tuple[TierClient, dict[str, bytes], int] | None = None
        self.events = KVEventFeed(self.block_size)
        self._connect(wait=True)
        self._requests: dict[str, _RequestState] = {}
        self._ready_loads: dict[str, _LoadPlan] = {}
        self._queued = KVTierMetadata()
        """Asynchronous loads planned since the last step, for the next step's metadata."""
        self._queued_leases: list[SlotRef] = []
        self._lease_gc: deque[list[SlotRef]] = deque([[] for _ in range(_LEASE_STEPS)])
        self._stores: dict[tuple[int, int], _PendingStore] = {}
        self._step = 0
        self._failing = False
        self._failed_loads: set[str] = set()
        """Requests whose asynchronous load failed: vLLM recomputes them, without kvtier."""
        self.unreturned = Unreturned()
        """Refs a failed call did not hand back: handed back on later steps."""
        if self.plans and (warning := failure_policy_warning(vllm_config)):
            log.warning("kvtier: %s", warning)
        log.info(
            "kvtier connector: %s mode, replica %s, pools %s, arena %s",
            cfg.mode,
            self.replica,
            {p.key: p.chunk_bytes for p in self.plans},
            self.arena_path,
        )

    def _connect(self, wait: bool = False) -> bool:
        """Open the tiers; on failure serve as if unconnected and try again later. Only the
        first try (``wait``, at start) is made here: later ones run on a thread of their own,
        taken up by the call after they succeed, since registering may take longer than a
        step may wait."""
        if self.client is not None:
            return True
        if self._opening is not None:
            if self._opening.is_alive():
                return False
            self._opening = None
        if self._opened is not None:
            client, namespaces, chunk_bytes = self._opened
            self._opened = None
            self._adopt(client, namespaces, chunk_bytes)
            return True
        now = time.monotonic()
        if now < self._next_connect or not self.plans:
            return False
        self._next_connect = now + _RECONNECT_S
        if not wait:
            self._opening = threading.Thread(target=self._open, name="kvtier-connect", daemon=True)
            self._opening.start()
            return False
        self._open()
        return self._connect()

    def _open(self) -> None:
        """Open a client and register every pool; the result waits in ``_opened``."""
        client: TierClient | None = None
        namespaces: dict[str, bytes] = {}
        try:
            chunk_bytes = max(plan.chunk_bytes for plan in self.plans)
            client = open_client(self.cfg, self.replica, chunk_bytes)
            for plan in self.plans:
                try:
                    spec = plan.spec
                    if plan.pool is Pool.DRAFT and self.draft is not None:
                        spec = self.draft.current_spec()  # the revision swapped to, if any
                    namespaces[plan.key] = client.register_pool(spec, plan.chunk_bytes)
                except PoolLayoutError as exc:
                    if plan.pool is Pool.TARGET:
                        raise
                    # without a draft pool, draft pages of hits are filled instead of loaded
                    log.error("kvtier: no %s pool: %s", plan.pool, exc)
            self.events.follow(client)
        except KVTierError as exc:  # never take the engine down
            if client is not None:
                client.close()
            log.error(
                "kvtier unavailable, serving without it (retry in %d s): %s", _RECONNECT_S, exc
            )
            return
        self._opened = (client, namespaces, chunk_bytes)

    def _adopt(self, client: TierClient, namespaces: dict[str, bytes], chunk_bytes: int) -> None:
        self.namespaces.update(namespaces)
        self.arena_path = str(client.arena_path)
        self.client = client
        if self.draft is not None and self.draft_plan is not None:
            self.draft.namespace = self.namespaces.get(self.draft_plan.key)
        if isinstance(client, InProcessClient):
            self._keep_on_exit(client, chunk_bytes)

    def _keep_on_exit(self, client: InProcessClient, chunk_bytes: int) -> None:
        """The arena ends with this process: write it to lmdb when idle, and at exit if nobody
        shut the connector down."""
        if not self.cfg.write_through:
            # half the arena at most stays dirty: stores always find clean or free slots
            most = min(self.cfg.writeback_backlog_mib << 20, client.manager.cpu.memory.size // 2)
            backlog = most // chunk_bytes
            idle_s = self.cfg.writeback_idle_ms / 1000
            self._writer = _IdleWriter(client.manager, idle_s, backlog)
        ref = weakref.ref(self)

        def at_exit() -> None:
            scheduler = ref()
            if scheduler is not None:
                scheduler.shutdown()

        self._at_exit = at_exit
        atexit.register(at_exit)

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

    def _wait(self, state: _RequestState) -> bool:
        """Whether a request may still be asked again next step (up to promote_wait_ms)."""
        now = time.monotonic()
        if state.waiting_since is None:
            state.waiting_since = now
        return now - state.waiting_since < self.cfg.promote_wait_ms / 1000

    def _count_acceptance(self, req_id: str, computed: int, state: _RequestState, out: Any) -> None:
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
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KVTierStats()
        return stats

    # -- guarded calls into kvtier --------------------------------------------------------

    def _guard(self, what: str, error: KVTierError) -> None:
        if not self._failing and not isinstance(error, DaemonStalledError):  # the client said
            log.error("kvtier %s failed; serving without it until it is back: %s", what, error)
        self._failing = True

    def _keys(self, plan: PoolPlan, hashes: Any, chunks: Iterable[int]) -> list[ChunkKey]:
        return self._keys_in(self.namespaces[plan.key], hashes, chunks)

    def _keys_in(self, namespace: bytes, hashes: Any, chunks: Iterable[int]) -> list[ChunkKey]:
        bpc = self.cfg.blocks_per_chunk
        return [make_key(namespace, hashes[(c + 1) * bpc - 1]) for c in chunks]

    # -- lookups --------------------------------------------------------------------------

    def state(self, request: Any) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
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
        state.local_hit = num_computed_tokens
        if self._followed != self._step:
            self._sync_draft(follow=True)
        if self._writer is not None:
            self._writer.touch(True)
        self._drop_plan(state)
        if self.draft is not None and self.draft.awaiting and self._wait(state):
            return None, False  # one step: the workers fingerprint the draft weights in it
        limit = self._hit_limit(request)
        first = num_computed_tokens // self.chunk_tokens
        if limit <= first:
            return 0, False
        try:
            plan = self._plan(state, request, first, limit)
        except KVTierError as exc:
            self._guard("lookup", exc)
            return 0, False
        self._failing = False
        if plan is None:
            return None, False  # chunks are on their way into the arena: ask again
        if plan.chunks == 0:
            return 0, False
        state.plan = plan
        state.local_tokens = num_computed_tokens
        tokens = (first + plan.chunks) * self.chunk_tokens - num_computed_tokens
        return tokens, self.async_loads

    def _hit_limit(self, request: Any) -> int:
        """The most chunks a lookup may find: at least one prompt token is always computed, to
        produce the first output (with ``drop_last``, the chunk dropped from the hit ensures it)."""
        prompt = len(request.prompt_token_ids or ())
        hashed = len(request.block_hashes) // self.cfg.blocks_per_chunk
        readable = prompt if self.drop_last else prompt - 1
        return int(min(readable // self.chunk_tokens, hashed))

    def _find(self, hashes: Any, first: int, limit: int) -> _Found:
        """The longest hit every target plan holds, in chunks: per plan, the first chunk it
        needs (from ``first``: vLLM holds the ones before) and the tier of each chunk from there.

        Full-attention plans need every chunk of the hit. A sliding-window plan needs only the
        window before the hit's end, which moves when the hit gets shorter: its check repeats,
        a few times at most. The first lookup also leases what the arena holds (or reads it from
        the arena's index, with no call), so that a whole hit from the arena takes one step."""
        client = self.client
        assert client is not None
        spans = [(plan, self._needed(plan, first, limit)) for plan in self.targets]
        keys = [k for plan, span in spans for k in self._keys(plan, hashes, span)]
        # leases this step's build_connector_meta would release go back with this lookup
        due, self._lease_gc[0] = self._lease_gc[0], []
        try:
            result, leased = client.release_then_lookup_and_load(due, keys)
        except KVTierError:
            self.unreturned.keep(Return.RELEASE, due)
            raise
        found = {
            plan.key: (span.start, codes)
            for (plan, span), codes in zip(spans, _split(result.tier_codes, spans), strict=True)
        }
        early = {
            plan.key: (span.start, refs)
            for (plan, span), refs in zip(spans, _split(leased, spans), strict=True)
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
                    result = client.lookup(self._keys(plan, hashes, span))
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

    def _give_back(self, leases: dict[str, tuple[int, list[SlotRef | None]]] | None) -> None:
        """Leases not used: they go back with the next call that releases."""
        for _, refs in (leases or {}).values():
            self._lease_gc[0].extend(r for r in refs if r is not None)

    def _plan(self, state: _RequestState, request: Any, first: int, limit: int) -> _LoadPlan | None:
        hashes = request.block_hashes
        found = self._find(hashes, first, limit)
        chunks = found.chunks
        if self.drop_last and chunks > first:
            chunks -= 1
        assert self.anchor is not None
        anchor_start, anchor_codes = found.tiers[self.anchor.key]
        for chunk, code in enumerate(anchor_codes, anchor_start):
            state.first_tiers.setdefault(chunk, code)
        # per plan, the chunks of the hit not in the arena
        below = {
            plan.key: [c for c, code in enumerate(codes[: chunks - start], start) if code != _CPU]
            for plan in self.targets
            for start, codes in (found.tiers[plan.key],)
        }
        if any(below.values()) or found.pending:
            self._give_back(found.leases)
            if self._wait(state):
                self._promote(hashes, below)
                return None
            if len(self.targets) > 1 and any(below.values()):
                return _LoadPlan(first, 0, {}, [])  # a shorter hit would need other windows
            chunks = min([chunks, *(c[0] for c in below.values() if c)])
            found.leases = None
        draft = self.draft_plan
        if chunks <= first or (
            draft is not None
            and draft.key in self.namespaces
            and self._draft_on_its_way(draft, state, hashes, range(first, chunks))
        ):
            self._give_back(found.leases)
            return None if chunks > first else _LoadPlan(first, 0, {}, [])
        return self._lease(state, hashes, first, chunks, found.leases)

    def _needed(self, plan: PoolPlan, first: int, chunks: int) -> range:
        return range(max(first, plan.first_needed(chunks, self.chunk_tokens)), chunks)

    def _promote(self, hashes: Any, below: dict[str, list[int]]) -> None:
        """Bring a hit's chunks up into the arena, the draft's with their target's."""
        client = self.client
        assert client is not None
        span: set[int] = set()
        for plan in self.targets:
            chunks = below.get(plan.key, [])
            if chunks:
                client.promote(self._keys(plan, hashes, chunks))
                span.update(chunks)
        if not span or self.draft_plan is None:
            return
        namespaces = [self.namespaces.get(self.draft_plan.key)]
        namespaces += self.draft.fill_sources() if self.draft is not None else []
        for namespace in namespaces:
            if namespace is not None:
                client.promote(self._keys_in(namespace, hashes, sorted(span)))

    def _lease(
        self,
        state: _RequestState,
        hashes: Any,
        first: int,
        chunks: int,
        early: dict[str, tuple[int, list[SlotRef | None]]] | None,
    ) -> _LoadPlan | None:
        """Lease every plan's chunks of the hit (``early``: those the lookup leased, when they
        cover the hit; the ones past it go back); the hit shrinks to what all of them got."""
        client = self.client
        assert client is not None
        spans = [(plan, self._needed(plan, first, chunks)) for plan in self.targets]
        if early is None or any(
            early[plan.key][0] != span.start or len(early[plan.key][1]) < len(span)
            for plan, span in spans
        ):
            self._give_back(early)
            keys = [k for plan, span in spans for k in self._keys(plan, hashes, span)]
            due, self._lease_gc[0] = self._lease_gc[0], []
            try:
                leased = client.release_then_load(due, keys)  # every plan's chunks in one call
            except KVTierError:
                self.unreturned.keep(Return.RELEASE, due)
                raise
            early = {
                plan.key: (span.start, refs)
                for (plan, span), refs in zip(spans, _split(leased, spans), strict=True)
            }
        offered: dict[str, tuple[int, list[SlotRef | None]]] = {}
        granted = chunks
        for plan, span in spans:
            start, refs = early[plan.key]
            offered[plan.key] = (start, refs)
            missing = next((i for i, r in enumerate(refs) if r is None), None)
            if missing is not None:
                # a shorter hit moves the sliding windows: with several plans, none
                granted = first if len(self.targets) > 1 else min(granted, span.start + missing)
        zero: list[str] = []
        fill = Fill.NONE
        if self.draft is not None and self.draft_plan is not None:
            span = self._needed(self.draft_plan, first, chunks)
            chunk_hashes = [hashes[(c + 1) * self.cfg.blocks_per_chunk - 1] for c in span]
            draft, fill, back = lease_draft(client, self.draft, chunk_hashes)
            self._release(back)
            if draft is not None:
                offered[self.draft_plan.key] = (span.start, draft)
            else:  # never leave draft pages uninitialised
                zero.append(self.draft_plan.key)
        leases: dict[str, tuple[int, list[SlotRef]]] = {}
        for key, (start, refs) in offered.items():
            keep = max(0, granted - start)
            self._release([r for r in refs[keep:] if r is not None])
            leases[key] = (start, [r for r in refs[:keep] if r is not None])
        if granted <= first:
            self._release([r for _, refs in leases.values() for r in refs])
            return None if self._wait(state) else _LoadPlan(first, 0, {}, [])
        tiers = bytes(state.first_tiers.get(c, _CPU) for c in range(first, granted))
        return _LoadPlan(first, granted - first, leases, zero, tiers, fill)

    def _draft_on_its_way(
        self, draft: PoolPlan, state: _RequestState, hashes: Any, hit: range
    ) -> bool:
        """Whether draft chunks of the hit are still coming up into the arena (then ask again,
        within the wait): loading them now would find them mid-promotion and zero them."""
        client = self.client
        assert client is not None
        keys = self._keys(draft, hashes, self._needed(draft, hit.start, hit.stop))
        found = client.lookup(keys)
        below = [k for k, c in zip(keys, found.tier_codes, strict=False) if c != _CPU]
        if not below and not found.pending:
            return False
        if not self._wait(state):
            return False
        if below:
            client.promote(below)
        return True

    def _drop_plan(self, state: _RequestState) -> None:
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
        sources: dict[str, int] = {}
        for i, code in enumerate(plan.tiers):
            start = max((plan.first_chunk + i) * self.chunk_tokens, state.local_tokens)
            end = (plan.first_chunk + i + 1) * self.chunk_tokens
            source = _HIT_SOURCES.get(code, _REMOTE_SOURCE)
            sources[source] = sources.get(source, 0) + max(0, end - start)
        return sources if sum(sources.values()) == num_external_tokens else {}

    # -- per step -------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        self._step += 1
        if self._writer is not None:
            self._writer.touch(bool(self._requests))
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
        self._release(self._lease_gc.popleft())
        self._lease_gc.append(self._queued_leases)
        self._queued_leases = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            plan = self._ready_loads.pop(new.req_id, None)
            if plan is not None:
                self._lease_gc[-1].extend(self._add_load(meta, state, plan))
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
        self._expire_stores()
        return meta

    def _add_load(
        self, meta: KVTierMetadata, state: _RequestState, plan: _LoadPlan
    ) -> list[SlotRef]:
        """The copies of a granted load into the request's blocks; returns its leases, to give
        back once the workers copied them."""
        bpc = self.cfg.blocks_per_chunk
        skip = state.local_tokens // self.block_size
        request = state.request.request_id if self.async_loads else ""
        by_key = self.by_key
        for key, (start, refs) in plan.leases.items():
            ids = state.block_ids[by_key[key].group]
            # another revision's draft chunk is a fill, never loaded as the current one
            draft = by_key[key].pool is Pool.DRAFT
            fill = "previous" if draft and plan.fill is Fill.PREVIOUS else ""
            for chunk, ref in enumerate(refs, start):
                first = max(0, skip - chunk * bpc)
                blocks = tuple(ids[chunk * bpc + first : (chunk + 1) * bpc])
                meta.loads.append(
                    ChunkCopy(
                        key, ref.slot, ref.offset, ref.generation, blocks, first, fill, request
                    )
                )
        end = (plan.first_chunk + plan.chunks) * bpc
        for key in plan.zero_plans:
            zeroed = self._needed(by_key[key], plan.first_chunk, plan.first_chunk + plan.chunks)
            ids = state.block_ids[by_key[key].group]
            start = max(skip, zeroed.start * bpc)
            meta.zero.setdefault(key, []).extend(b for b in ids[start:end] if b)
        state.fill = plan.fill
        if plan.fill is not Fill.NONE and plan.chunks:
            self.stats.fill(plan.fill, plan.chunks)
        state.stored_chunks = max(state.stored_chunks, plan.first_chunk + plan.chunks)
        return plan.refs()

    def _add_stores(
        self, meta: KVTierMetadata, state: _RequestState, computed: int, out: Any
    ) -> None:
        request = state.request
        done = computed + out.num_scheduled_tokens.get(request.request_id, 0)
        bpc = self.cfg.blocks_per_chunk
        blocks_known = min((len(ids) for ids in state.block_ids), default=0)
        full = min(done // self.chunk_tokens, len(request.block_hashes) // bpc, blocks_known // bpc)
        if full <= state.stored_chunks:
            return
        chunks = range(state.stored_chunks, full)
        state.stored_chunks = full
        client = self.client
        assert client is not None
        # a sliding window is stored where the prompt's own hit would read it, and past it
        end = self._hit_limit(request) - int(self.drop_last)
        for plan in self.plans:
            if plan.key not in self.namespaces:
                continue
            span = [c for c in chunks if plan.keeps(c, end, self.checkpoint, self.chunk_tokens)]
            if len(span) < len(chunks):
                self.stats.window_skipped(
                    str(plan.pool), (len(chunks) - len(span)) * plan.chunk_bytes
                )
            if plan.pool is Pool.DRAFT and self.draft is not None:
                if not self.draft.active:
                    continue  # the draft's weights may be in flux: its KV is no revision's
                if self.draft.local_cache_stale:
                    # vLLM's own cache may hold an older revision's draft KV: never store it
                    local = -(-state.local_hit // self.chunk_tokens)
                    span = [c for c in span if c >= local]
            ids = state.block_ids[plan.group]
            # blocks vLLM already let go of (null) cannot be stored
            span_blocks = {c: tuple(ids[c * bpc : (c + 1) * bpc]) for c in span}
            storable = [c for c in span if all(span_blocks[c])]
            try:
                refs = client.reserve(self._keys(plan, request.block_hashes, storable))
            except KVTierError as exc:
                self._guard("reserve", exc)
                return
            for chunk, ref in zip(storable, refs, strict=True):
                if ref is None:
                    continue  # present already, or no room right now
                if plan is self.anchor:
                    self._announce((ref.slot, ref.generation), ref.key, request, chunk)
                meta.stores.append(
                    ChunkCopy(plan.key, ref.slot, ref.offset, ref.generation, span_blocks[chunk])
                )
                handle = (ref.slot, ref.generation)
                self._stores[handle] = _PendingStore(ref, self._step, plan.shard.writers)

    def _announce(self, handle: tuple[int, int], key: ChunkKey, request: Any, chunk: int) -> None:
        """The anchor plan's chunks stand for their blocks in KV events, once stored."""
        bpc = self.cfg.blocks_per_chunk
        hashes = request.block_hashes[chunk * bpc : (chunk + 1) * bpc]
        parent = request.block_hashes[chunk * bpc - 1] if chunk else None
        tokens = request.all_token_ids[chunk * self.chunk_tokens : (chunk + 1) * self.chunk_tokens]
        self.events.store_planned(handle, key, list(hashes), parent, list(tokens))

    def take_events(self) -> list[object]:
        """vLLM asks after each step's forward: what goes to kvtierd now competes with no copy."""
        if self.client is not None:
            try:
                self.client.report_hits(_REPORT_EVERY_S)
                self.events.poll(self.client)
            except KVTierError as exc:
                self._guard("hit report", exc)
        return self.events.take()

    def _expire_stores(self) -> None:
        stale = [h for h, s in self._stores.items() if self._step - s.step > _STORE_STEPS]
        if stale:
            for handle in stale:
                self.events.store_dropped(handle)
            self._abort([self._stores.pop(h).ref for h in stale])

    def _abort(self, refs: list[SlotRef]) -> None:
        if not refs or self.client is None:
            return
        try:
            self.client.abort(refs)
        except KVTierError as exc:
            self.unreturned.keep(Return.ABORT, refs)
            self._guard("abort", exc)

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
        # a part any rank failed to write spoils the chunk, whatever the others wrote
        failed = [self._stores.pop(h).ref for h in worker_meta.failed if h in self._stores]
        for handle in worker_meta.failed:
            self.events.store_dropped(handle)
        done = []
        for handle in worker_meta.stored:
            pending = self._stores.get(handle)
            if pending is None:
                continue
            pending.waiting -= 1
            if pending.waiting <= 0:  # every rank that writes a part has written it
                done.append(self._stores.pop(handle).ref)
                self.events.store_done(handle)
        try:
            if done:
                self.client.commit(done)
        except KVTierError as exc:
            self.unreturned.keep(Return.COMMIT, done)
            self._guard("commit", exc)
        self._abort(failed) if failed else None

    def request_finished(self, request: Any) -> None:
        self._failed_loads.discard(request.request_id)
        settled = self._acceptance.progressed(request.request_id, request.num_computed_tokens)
        if settled is not None:
            self.stats.spec(*settled)
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._drop_plan(state)
        plan = self._ready_loads.pop(request.request_id, None)
        if plan is not None:
            self._release(plan.refs())
        if self._writer is not None:
            self._writer.touch(bool(self._requests))

    def shutdown(self) -> None:
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._opened is not None:  # opened after the last step: never used
            self._opened[0].close()
            self._opened = None
        if self.client is None:
            return
        for refs in self._lease_gc:
            self._release(refs)
        self._abort([pending.ref for pending in self._stores.values()])
        self.unreturned.retry(self.client, force=True)
        client, self.client = self.client, None
        client.close()  # embedded: writes what the arena holds to lmdb
