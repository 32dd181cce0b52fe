"""The connector's worker side: copies between vLLM's KV blocks and arena slots.

The worker maps the arena by path. Synchronous loads run in ``start_load_kv`` before the
forward, asynchronous ones on the loading thread (`background_loads`); stores in
``wait_for_save``, after the forward (and the draft's) wrote the blocks. A load from a slot
reused meanwhile (its generation moved) is a load error, so vLLM recomputes those blocks: per
block with one KV-cache group, per request (an asynchronous load) with several. The generation
is checked once the copy landed, never when queued: a device reads the bytes later, and an
arena-index hit holds no lease. lmdb's chunks: `kvtier_vllm.kv.lmdb_staging`.
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvtier.client import ArenaMemory
from kvtier.core.costs import LMDB, EngineTimings
from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey, Pool
from kvtier.core.protocol import FailedChunk, Failure, TierCode
from kvtier_vllm.drafts.swaps import DraftWatch, Fill, find_draft_model_source
from kvtier_vllm.kv.connector_stats import KVTierStats, take_report
from kvtier_vllm.kv.lmdb_staging import LmdbStaging
from kvtier_vllm.kv.metadata import ChunkCopy, KVTierMetadata, KVTierWorkerMetadata
from kvtier_vllm.kv.worker_side.background_loads import BackgroundLoads, IssuedLoads, LoadBatch
from kvtier_vllm.kv.worker_side.chunk_views import ChunkViews
from kvtier_vllm.kv.worker_side.load_times import LandingFence, RequestLoads, until_landed
from kvtier_vllm.kv.worker_side.pages import own_caches, plan_pages, stacked
from kvtier_vllm.kv.worker_side.sends import PendingSends
from kvtier_vllm.layout.plans import kv_groups, plan_pools
from kvtier_vllm.shared.copies import CpuCopies, Fence, copies_for
from kvtier_vllm.shared.settings import ConnectorConfig
from kvtier_vllm.shared.shapes import UnsupportedGroupError, refusal

log = logging.getLogger(__name__)


class KVTierWorker:
    def __init__(self, vllm_config: Any, cfg: ConnectorConfig, kv_cache_config: Any = None) -> None:
        self.vllm_config = vllm_config
        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        self.views = ChunkViews()
        self.plans = self.views.plans
        self.pages = self.views.pages
        self.dtypes = self.views.dtypes
        self.stacks = self.views.stacks
        self._arena_bytes: torch.Tensor | None = None
        self._arena_inode = 0
        self._announced = ""
        self._stored: list[tuple[int, int]] = []
        self._compared: list[tuple[int, int, float]] = []
        self._timings = EngineTimings()
        """Loads by tier since the last report, timed here: kvtierd's cost estimates."""
        self.clock = time.perf_counter  # when loads were queued and seen landed
        self._landing: list[tuple[Fence, list[tuple[int, int]]]] = []
        """Stores issued on a device stream, reported once their event completed."""
        self.copies: CpuCopies = copies_for(torch.device("cpu"))
        self._failed: list[tuple[int, int]] = []
        self._load_errors: set[int] = set()
        self._loads: list[IssuedLoads] = []
        """Synchronous loads issued, checked when vLLM asks for load errors."""
        self._receiving: list[LoadBatch] = []
        """Asynchronous loads submitted, until reported finished."""
        self.background = BackgroundLoads()
        self.sends = PendingSends()
        self.stats = KVTierStats()
        self._draft_watch: DraftWatch | None = None
        self._draft_ok = True
        self._fingerprints: dict[int, str] = {}
        self.staging = LmdbStaging()
        self.background_staging = LmdbStaging()
        """The loading thread's reads of lmdb (a reader of its own)."""
        self._moved: list[FailedChunk] = []
        """Arena loads whose slot's generation moved under the copy, to report."""

    @property
    def _arena(self) -> ArenaMemory | None:
        """The arena mapped here: the views check their slots' generations against it."""
        return self.views.arena

    @_arena.setter
    def _arena(self, arena: ArenaMemory | None) -> None:
        self.views.arena = arena

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            groups = own_caches(kv_groups(self.kv_cache_config, kv_caches), kv_caches)
            # the scheduler names the chunks: a worker reads no weights to name them again
            plans = (
                []
                if refusal(self.vllm_config)
                else plan_pools(self.vllm_config, groups, self.cfg, named=False)
            )
        except UnsupportedGroupError:
            return  # the scheduler side says why, and plans nothing
        for plan in plans:
            held = [plan_pages(plan, kv_caches[name]) for name in plan.layer_names]
            pages = [p for p, _ in filter(None, held)]
            orders = {order for _, order in filter(None, held)} - {""}
            actual = {p.shape[1] for p in pages}
            if len(pages) < len(held) or orders - {plan.order} or actual != {plan.page_bytes}:
                log.error(
                    "kvtier: %s pool pages are %s bytes in order %s, expected %d in %s; not "
                    "offloading this pool",
                    plan.key,
                    sorted(actual),
                    sorted(orders) if len(pages) == len(held) else "not contiguous per block",
                    plan.page_bytes,
                    plan.order,
                )
                continue
            self.plans[plan.key] = plan
            self.pages[plan.key] = pages
            state = next((g.state for g in groups if g.index == plan.group), None)
            cache = kv_caches[plan.layer_names[0]]
            self.views.compares(plan, cache.dtype, state if plan.pool is Pool.STATE else None)
            if pages[0].device != self.copies.device:
                self.copies = copies_for(pages[0].device)
            stack = stacked(pages)
            if stack is not None:
                self.stacks[plan.key] = stack
        if any(plan.pool is Pool.DRAFT for plan in self.plans.values()):
            # the model runner calls this: the draft model is found from it, to fingerprint
            source = find_draft_model_source()
            if source is None:
                log.warning("kvtier: draft model not found; draft swaps need kvtier's draft-swap")
            rank = self.vllm_config.parallel_config.rank
            self._draft_watch = DraftWatch(source, rank, self.cfg.draft_check_transfers)

    def _slots(self, arena_path: str, expected: int = 0) -> torch.Tensor | None:
        """The arena as bytes, mapped again when a new file takes the path (a restarted daemon);
        None while it is not the file the step's slots were given in (``expected``, 0: any)."""
        try:
            inode = os.stat(arena_path).st_ino
        except OSError:
            return None
        if expected and inode != expected:
            return None
        if self._arena is None or self._arena_inode != inode:
            self.shutdown()
            try:
                self._arena = ArenaMemory.attach(Path(arena_path))
            except KVTierError as exc:
                log.error("kvtier: cannot map the arena at %s: %s", arena_path, exc)
                return None
            self._arena_inode = inode
            view = self._arena.view(0, self._arena.size)
            self._arena_bytes = torch.frombuffer(view, dtype=torch.uint8)
            self.copies.attach(self._arena_bytes)
        return self._arena_bytes

    def _copy(self, job: ChunkCopy, slots: torch.Tensor, into_arena: bool) -> bool:
        plan = self.plans.get(job.plan)
        if plan is not None and plan.codec is not None:
            # coded chunks move a step's at once: `ChunkViews.encode_stores`, `.decode_loads`
            return False
        pairs = self.views.pairs(job, slots, per_layer=False)
        if pairs is None:
            return False
        for arena, pages in pairs:
            if into_arena:
                self.copies.copy(arena, pages)
            else:
                self.copies.copy(pages, arena)
        return True

    def _check_draft(self, meta: KVTierMetadata) -> str:
        """Whether the draft weights are still those the scheduler planned for; the
        fingerprint taken, if one was."""
        watch = self._draft_watch
        self._draft_ok = True
        if watch is None:
            return ""
        moves = any(self._is_draft(j) for j in meta.loads) or any(
            self._is_draft(j) for j in meta.stores
        )
        self._draft_ok, taken = watch.check(meta.draft_check, moves, meta.draft_fingerprints)
        if taken:
            self._fingerprints[watch.rank] = taken
            self.stats.stale(watch.stale_after(self._draft_ok))
        return taken

    def _is_draft(self, job: ChunkCopy) -> bool:
        plan = self.plans.get(job.plan)
        return plan is not None and plan.pool is Pool.DRAFT

    def _zero(self, key: str, blocks: list[int]) -> None:
        stack = self.stacks.get(key)
        if stack is not None:
            stack[:, blocks] = 0
            return
        for pages in self.pages.get(key, []):
            pages[blocks] = 0

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        if meta.arena_path != self._announced:
            # map it on the first step that names it: populating the mapping of a large arena
            # takes a while, and would otherwise delay the first copy
            self._announced = meta.arena_path
            self._slots(meta.arena_path, meta.arena_inode)
        self._load_errors.update(meta.invalid_blocks)
        self._fail_requests(set(meta.failed_requests))
        self.background.idle = meta.idle
        checked = self._check_draft(meta)
        if not meta.loads and not meta.zero and not meta.receiving:
            return
        slots = self._slots(meta.arena_path, meta.arena_inode)
        for key, blocks in meta.zero.items():
            self._zero(key, blocks)
        sync = [job for job in meta.loads if not job.request]
        if sync:
            self.copies.begin_loads()
            loads = self._issue_loads(
                sync, meta.lmdb_path, slots, self.staging, checked, self._draft_ok
            )
            self.copies.end_loads()
            loads.fence()  # seen landed now if they did (on the host); else when waited on
            self._loads.append(loads)
            self._landed_or_failed(loads, set(), block_errors=True)
        if meta.receiving:
            batch = LoadBatch(set(meta.receiving), block_errors=meta.block_errors)
            jobs = [job for job in meta.loads if job.request]
            self.copies.begin_loads()  # after what the engine's stream did so far, on a device
            args = (jobs, meta.lmdb_path, slots, self.background_staging, checked, self._draft_ok)
            self.background.submit(batch, partial(self._issue_loads, *args), self.copies.fence)
            self._receiving.append(batch)

    def _issue_loads(
        self,
        jobs: list[ChunkCopy],
        lmdb_path: str,
        slots: torch.Tensor | None,
        staging: LmdbStaging,
        checked: str,
        draft_ok: bool,
    ) -> IssuedLoads:
        """Queue the copies of ``jobs`` into vLLM's pages (chunks leased in lmdb verified in its
        map first); what failed is only noted, for the engine's thread to report."""
        loads = IssuedLoads(Fence(), arena := self._arena, [])
        if slots is None or arena is None:
            loads.failed = [(job, 0.0) for job in jobs]
            return loads
        loads.read_ahead_s = staging.read_ahead(lmdb_path, [job for job in jobs if job.key])
        coded: list[ChunkCopy] = []
        with staging.holding(self.copies):  # each chunk copied before the next read
            for job in jobs:
                plan = self.plans.get(job.plan)
                source = slots
                staged_s = 0.0  # reading a chunk from lmdb's map is part of its load
                started = time.perf_counter()
                if job.key and plan is not None:
                    chunk = staging.stage(lmdb_path, job, plan.chunk_bytes, self.copies)
                    if chunk is None:
                        loads.failed.append((job, time.perf_counter() - started))
                        continue
                    source, staged_s = chunk, time.perf_counter() - started
                if plan is not None and plan.codec is not None:
                    if not job.key:
                        coded.append(job)
                        continue
                    ok = self.views.decode_loads([job], source)[0]
                    (loads.copies if ok else loads.failed).append((job, staged_s))
                    continue
                if self._is_draft(job) and not job.fill:
                    if not draft_ok:  # planned for other weights: a defined fill instead
                        self._zero(job.plan, list(job.block_ids))
                        loads.zero_filled += 1
                        continue
                    if not checked and self._draft_watch is not None:
                        loads.unverified += 1
                started = time.perf_counter()
                ok = self._copy(job, source, into_arena=False)
                (loads.copies if ok else loads.failed).append(
                    (job, staged_s + time.perf_counter() - started)
                )
        if coded:
            started = time.perf_counter()
            decoded = self.views.decode_loads(coded, slots)
            each = (time.perf_counter() - started) / len(coded)
            for job, ok in zip(coded, decoded, strict=True):
                (loads.copies if ok else loads.failed).append((job, each))
        # only queued so far: each slot's generation is checked once its bytes landed
        loads.fence = LandingFence(self.copies, self.clock)
        return loads

    def _landed_or_failed(self, loads: IssuedLoads, failed: set[str], block_errors: bool) -> None:
        """Count and report, once, what issuing ``loads`` noted."""
        for job, seconds in loads.failed:
            self._fail_loads([job], failed, block_errors)
            self._count("load", job, seconds, False)
        if loads.zero_filled:
            self.stats.fill(Fill.ZEROS, loads.zero_filled)
        if loads.unverified and self._draft_watch is not None:
            self._draft_watch.unverified += loads.unverified

    def _check_landed(self, loads: IssuedLoads, failed: set[str], block_errors: bool) -> None:
        """Loads whose fence passed: a slot still at the generation the scheduler looked up
        held that chunk's bytes while they were read (its generation moves before it is
        rewritten); any other slot is a load error."""
        arena = loads.arena
        timed = RequestLoads({LMDB: loads.read_ahead_s})
        for job, seconds in until_landed(loads.fence, loads.copies, self.views.nbytes):
            ok = bool(job.key) or (  # read from lmdb, verified: no slot to check
                arena is not None
                and arena is self._arena
                and arena.is_current(job.slot, job.generation)
            )
            if not ok:
                self._fail_loads([job], failed, block_errors)
                if arena is not None and arena is self._arena and job.chunk:  # reused under it
                    moved = FailedChunk(ChunkKey(job.chunk), TierCode.CPU, Failure.GENERATION)
                    self._moved.append(moved)
            nbytes = self._count("load", job, seconds, ok)
            if ok:
                timed.add(job, nbytes, seconds)
        timed.report(self._timings)

    def fail_step(self, meta: KVTierMetadata, loads: bool) -> None:
        """A hook failed part way: this step's loads (``loads``) or stores are failures, so
        vLLM recomputes those blocks and no slot is committed from half a copy."""
        if not loads:
            self._failed.extend((job.slot, job.generation) for job in meta.stores)
            self.sends.after(Fence(), meta.sending)
            return
        self._load_errors.update(meta.invalid_blocks)
        failed = set(meta.receiving) | set(meta.failed_requests)
        self._fail_loads(meta.loads, failed, block_errors=False)
        self._fail_requests(failed)

    def _fail_requests(self, requests: set[str]) -> None:
        """Asynchronous loads that will not come: reported finished and failed at once."""
        if requests:
            batch = LoadBatch(requests, set(requests), issued=IssuedLoads(Fence(), None, []))
            batch.done.set()
            self._receiving.append(batch)

    def unchecked_errors(self) -> set[int]:
        """Every block loaded since vLLM last asked: what it must recompute when the check
        itself failed."""
        errors = self._load_errors | {
            b for i in self._loads for j, _ in i.copies for b in j.block_ids
        }
        self._loads, self._load_errors = [], set()
        return errors - {0}

    def fail_receiving(self) -> tuple[set[str], set[str]]:
        """Every asynchronous load in flight, failed (when checking them failed), once no copy
        of theirs is still landing: vLLM may hand their blocks to other requests at once."""
        self.background.wait_landed(self._receiving)
        requests = {r for batch in self._receiving for r in batch.requests}
        self._receiving = []
        return set(), requests

    def _fail_loads(self, jobs: list[ChunkCopy], failed: set[str], block_errors: bool) -> None:
        """Blocks vLLM must recompute: per request for asynchronous loads (unless
        ``block_errors``), else per block."""
        for job in jobs:
            if job.request and not block_errors:
                failed.add(job.request)
            else:
                self._load_errors.update(b for b in job.block_ids if b)

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous loads landed, and those among them that failed."""
        self.background.wait_if_idle(self._receiving)
        done: set[str] = set()
        failed: set[str] = set()
        waiting = []
        for batch in self._receiving:
            loads = batch.issued
            if loads is None or not batch.done.is_set() or not loads.fence():
                waiting.append(batch)
                continue
            self._landed_or_failed(loads, batch.failed, batch.block_errors)
            self._check_landed(loads, batch.failed, batch.block_errors)
            done |= batch.requests - batch.failed
            failed |= batch.failed
        self._receiving = waiting
        return done, failed

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        if meta.checks:
            self._compare_checks(meta)
        if not meta.stores:
            self.sends.after(Fence(), meta.sending)
            return
        slots = self._slots(meta.arena_path, meta.arena_inode)
        if slots is None:
            self._failed.extend((job.slot, job.generation) for job in meta.stores)
            self.sends.after(Fence(), meta.sending)
            return
        self.copies.begin_stores()
        issued: list[tuple[int, int]] = []
        coded: list[ChunkCopy] = []
        for job in meta.stores:
            plan = self.plans.get(job.plan)
            if plan is not None and not plan.shard.writes:
                continue  # another rank holding the same heads writes them
            if self._is_draft(job) and not self._draft_ok:
                self._failed.append((job.slot, job.generation))  # other weights' KV: not stored
                continue
            if plan is not None and plan.codec is not None:
                coded.append(job)
                continue
            started = time.perf_counter()
            ok = self._copy(job, slots, into_arena=True)
            (issued if ok else self._failed).append((job.slot, job.generation))
            self._count("store", job, time.perf_counter() - started, ok)
        if coded:
            started = time.perf_counter()
            written = self.views.encode_stores(coded, slots)
            each = (time.perf_counter() - started) / len(coded)
            for job, ok in zip(coded, written, strict=True):
                (issued if ok else self._failed).append((job.slot, job.generation))
                self._count("store", job, each, ok)
        fence = self.copies.end_stores()
        self._landing.append((fence, issued))
        self.sends.after(fence, meta.sending)

    def finished_sends(self) -> set[str]:
        return self.sends.sent()

    def all_sends(self) -> set[str]:
        """Every request waiting for its stores, as sent: when checking them failed."""
        return self.sends.release_all()

    def _compare_checks(self, meta: KVTierMetadata) -> None:
        slots = self._slots(meta.arena_path, meta.arena_inode)
        for job in meta.checks:
            plan = self.plans.get(job.plan)
            if plan is not None and not plan.shard.writes:
                continue  # another rank holding the same heads compares them
            error = -1.0
            source = slots
            if job.key and plan is not None:
                source = self.staging.stage(meta.lmdb_path, job, plan.chunk_bytes)
            # other weights' draft KV than the chunk's: no comparison says anything
            if source is not None and (self._draft_ok or not self._is_draft(job)):
                error = self.views.compare(job, source)
            self._compared.append((job.slot, job.generation, error))

    def _count(self, direction: str, job: ChunkCopy, seconds: float, ok: bool) -> int:
        plan = self.plans.get(job.plan)
        if plan is None:
            return 0
        nbytes = self.views.nbytes(job)
        self.stats.record(direction, str(plan.pool), nbytes, seconds, ok)
        return nbytes

    def take_stats(self) -> KVTierStats | None:
        stats, self.stats = take_report(self.stats)
        return stats

    def block_ids_with_load_errors(self) -> set[int]:
        """Blocks of synchronous loads that vLLM must recompute. It asks after the forward, which
        on a device already waits on the loads' fence: the host waits for it too, then checks."""
        for loads in self._loads:
            loads.fence.wait()
            self._check_landed(loads, set(), block_errors=True)
        self._loads = []
        errors, self._load_errors = self._load_errors, set()
        return errors

    def worker_meta(self) -> KVTierWorkerMetadata | None:
        waiting = []
        for done, issued in self._landing:  # a slot is committed only once its bytes landed
            if done():
                self._stored.extend(issued)
            else:
                waiting.append((done, issued))
        self._landing = waiting
        corrupt = self.staging.take_failed() + self.background_staging.take_failed()
        corrupt, self._moved = corrupt + self._moved, []
        reports = (self._stored, self._failed, self._fingerprints, self._compared, self._timings)
        if not any(reports) and not corrupt:
            return None
        meta = KVTierWorkerMetadata(
            self._stored, self._failed, self._fingerprints, self._compared, self._timings, corrupt
        )
        self._stored, self._failed, self._fingerprints, self._compared = [], [], {}, []
        self._timings = EngineTimings()
        return meta

    def shutdown(self) -> None:
        self.background.close()  # no copy may still read the mapping closed here
        self.staging.close()
        self.background_staging.close()
        self.copies.detach()
        self._arena_bytes = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
