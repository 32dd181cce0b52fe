"""The connector's worker side: copies between vLLM's KV blocks and arena slots.

The worker maps the arena by path. Loads run in ``start_load_kv`` before the forward; stores run
in ``wait_for_save``, after the forward (and the draft's) wrote the blocks. A load copied from a
slot that was reused meanwhile (its generation moved) is reported as a load error, so vLLM
recomputes those blocks instead of using them: per block with one KV-cache group, per request
(an asynchronous load) with several. The generation is checked once the copy landed, never when
it is queued: on a device the bytes are read later, and an arena-index hit holds no lease, so
its slot may be evicted and rewritten in between.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvtier.client import ArenaMemory
from kvtier.core.errors import KVTierError
from kvtier.core.keys import Pool
from kvtier_vllm import hidden_codec
from kvtier_vllm.config import ConnectorConfig
from kvtier_vllm.copies import CpuCopies, Fence, copies_for
from kvtier_vllm.draft import DraftWatch, Fill, find_draft_model_source
from kvtier_vllm.hidden_codec import Fp8Layout
from kvtier_vllm.layout import KVGroup, PoolPlan, UnsupportedGroupError, kv_groups, plan_pools
from kvtier_vllm.metadata import ChunkCopy, KVTierMetadata, KVTierWorkerMetadata
from kvtier_vllm.shapes import HEADS_FIRST, TOKENS_FIRST, refusal
from kvtier_vllm.stats import KVTierStats, take

log = logging.getLogger(__name__)


def _pages(tensor: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """A layer's cache as [blocks, page bytes] in physical order, and the order of a page's
    elements (`shapes.HEADS_FIRST`, `shapes.TOKENS_FIRST`, "" for either); None for a layout
    whose pages are not contiguous per block. vLLM hands a layer over as [blocks, heads,
    tokens, K‖V] (MLA: [blocks, tokens, latent]), in whatever physical order its backend
    keeps."""
    if tensor.dim() == 3:
        tensor = tensor.unsqueeze(1)
    if tensor.dim() != 4:
        return None
    heads_first = tensor.stride(1) >= tensor.stride(2) or tensor.shape[1] == 1
    page = tensor if heads_first else tensor.permute(0, 2, 1, 3)
    if not page.shape[0] or not page[0].is_contiguous():
        return None
    try:
        flat = page.view(torch.uint8).view(page.shape[0], -1)
    except RuntimeError:
        return None
    if tensor.shape[1] == 1:
        return flat, ""  # one head: the same bytes in either order
    return flat, HEADS_FIRST if heads_first else TOKENS_FIRST


def _stacked(pages: list[torch.Tensor]) -> torch.Tensor | None:
    """All layers of a pool as one [layers, blocks, page bytes] view, when they sit at one
    stride in one allocation (vLLM allocates a single buffer): a chunk's pages then move in
    one copy per run of blocks instead of one per page."""
    first = pages[0]
    if first.stride() != (first.shape[1], 1):
        return None
    base = first.data_ptr()
    stride = pages[1].data_ptr() - base if len(pages) > 1 else first.numel()
    if stride < first.numel():
        return None
    storage = first.untyped_storage().data_ptr()
    for i, page in enumerate(pages):
        if (
            page.shape != first.shape
            or page.stride() != first.stride()
            or page.untyped_storage().data_ptr() != storage
            or page.data_ptr() != base + i * stride
        ):
            return None
    return first.as_strided((len(pages), *first.shape), (stride, *first.stride()))


def _runs(block_ids: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(index in the chunk, first block id, length) of each run of consecutive block ids;
    vLLM's null block (id 0, where a sliding window needs nothing) is never copied."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1 or not block_ids[i - 1]:
            if block_ids[start]:
                runs.append((start, block_ids[start], i - start))
            start = i
    return runs


def _page_dims(plan: PoolPlan) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A page's shape as this rank holds it and as a chunk holds it, in bytes, and the axis of
    the KV heads in both."""
    count, heads = plan.shard.count, plan.shard.heads
    if plan.order == TOKENS_FIRST:
        tokens = plan.spec.layout.tokens_per_block
        rest = plan.page_bytes // (tokens * count)
        return (tokens, count, rest), (tokens, heads, rest), 1
    rest = plan.page_bytes // count
    return (count, rest), (heads, rest), 0


def own_caches(groups: list[KVGroup], kv_caches: dict[str, torch.Tensor]) -> list[KVGroup]:
    """Each group's layers less those reading another layer's cache: with cross-layer KV
    sharing, vLLM adds such layers to their target's group on the worker side only. Their KV
    is the target's, stored once (and the scheduler side plans without them)."""
    out = []
    for group in groups:
        seen: set[tuple[int, tuple[int, ...]]] = set()
        names = []
        for name in group.layer_names:
            tensor = kv_caches[name]
            cache = (tensor.data_ptr(), tuple(tensor.shape))
            if cache not in seen:
                seen.add(cache)
                names.append(name)
        out.append(replace(group, layer_names=tuple(names)))
    return out


@dataclass(slots=True)
class _Issued:
    """Loads queued out of the arena, checked once their fence passed."""

    fence: Fence
    arena: ArenaMemory | None
    """The mapping they were read from; a remapped arena fails them."""
    copies: list[tuple[ChunkCopy, float]]
    """Each load, with the seconds its copy took to issue."""


class KVTierWorker:
    def __init__(self, vllm_config: Any, cfg: ConnectorConfig, kv_cache_config: Any = None) -> None:
        self.vllm_config = vllm_config
        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        self.plans: dict[str, PoolPlan] = {}
        self.pages: dict[str, list[torch.Tensor]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        """Each plan's KV dtype, to compare chunks in."""
        self.stacks: dict[str, torch.Tensor] = {}
        self._arena: ArenaMemory | None = None
        self._arena_bytes: torch.Tensor | None = None
        self._arena_inode = 0
        self._announced = ""
        self._stored: list[tuple[int, int]] = []
        self._compared: list[tuple[int, int, float]] = []
        self._landing: list[tuple[Fence, list[tuple[int, int]]]] = []
        """Stores issued on a device stream, reported once their event completed."""
        self.copies: CpuCopies = copies_for(torch.device("cpu"))
        self._failed: list[tuple[int, int]] = []
        self._load_errors: set[int] = set()
        self._loads: list[_Issued] = []
        """Synchronous loads issued, checked when vLLM asks for load errors."""
        self._receiving: list[tuple[_Issued, set[str], set[str]]] = []
        """Asynchronous loads issued: (loads, requests, failed requests)."""
        self._sending: list[tuple[Fence, set[str]]] = []
        """Finished requests whose blocks wait for stores issued behind a fence."""
        self._finished_ids: set[str] = set()
        """Requests vLLM said finished, not yet reported sent (it takes only those)."""
        self.stats = KVTierStats()
        self._draft_watch: DraftWatch | None = None
        self._draft_ok = True
        self._fingerprints: dict[int, str] = {}

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
            held = [_pages(kv_caches[name]) for name in plan.layer_names]
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
            self.dtypes[plan.key] = kv_caches[plan.layer_names[0]].dtype
            if pages[0].device != self.copies.device:
                self.copies = copies_for(pages[0].device)
            stack = _stacked(pages)
            if stack is not None:
                self.stacks[plan.key] = stack
        if any(plan.pool is Pool.DRAFT for plan in self.plans.values()):
            # the model runner calls this: the draft model is found from it, to fingerprint
            source = find_draft_model_source()
            if source is None:
                log.warning("kvtier: draft model not found; draft swaps need kvtier's draft-swap")
            rank = self.vllm_config.parallel_config.rank
            self._draft_watch = DraftWatch(source, rank, self.cfg.draft_check_transfers)

    def _slots(self, arena_path: str) -> torch.Tensor | None:
        """The arena as bytes; mapped again when the file at the path is a new one (a restarted
        daemon), so nothing is ever copied into an arena nobody reads."""
        try:
            inode = os.stat(arena_path).st_ino
        except OSError:
            return None
        if self._arena is None or self._arena_inode != inode:
            self.shutdown()
            try:
                self._arena = ArenaMemory.attach(Path(arena_path))
            except KVTierError as exc:
                log.error("kvtier: cannot map the arena at %s: %s", arena_path, exc)
                return None
            self._arena_inode = inode
            self._arena_bytes = torch.frombuffer(
                self._arena.view(0, self._arena.size), dtype=torch.uint8
            )
            self.copies.attach(self._arena_bytes)
        return self._arena_bytes

    def _copy(self, job: ChunkCopy, slots: torch.Tensor, into_arena: bool) -> bool:
        plan = self.plans.get(job.plan)
        if plan is not None and plan.codec is not None:
            return False  # coded chunks move a step's at once: `_encode_stores`, `_decode_loads`
        pairs = self._pairs(job, slots, per_layer=False)
        if pairs is None:
            return False
        for arena, pages in pairs:
            if into_arena:
                self.copies.copy(arena, pages)
            else:
                self.copies.copy(pages, arena)
        return True

    def _coded(
        self, jobs: list[ChunkCopy], slots: torch.Tensor
    ) -> Iterator[tuple[str, PoolPlan, Fp8Layout, list[int]]]:
        """Per coded pool among ``jobs``: its key, plan, codec and the jobs (by index) whose
        slots are the ones planned for."""
        for key in sorted({job.plan for job in jobs}):
            plan = self.plans[key]
            assert plan.codec is not None
            mine = [i for i, job in enumerate(jobs) if job.plan == key]
            live = [i for i in mine if self._slot_current(jobs[i], plan, slots)]
            if live:
                yield key, plan, plan.codec, live

    def _decode_loads(self, jobs: list[ChunkCopy], slots: torch.Tensor) -> list[bool]:
        """A step's loads of coded chunks (`PoolPlan.codec`): each chunk's rows gathered from
        its slot, then one decode per pool into the pages. Whether each was loaded."""
        loaded = [False] * len(jobs)
        for key, plan, codec, live in self._coded(jobs, slots):
            parts = []
            for i in live:
                job = jobs[i]
                values, scales = codec.split(slots[job.offset : job.offset + plan.chunk_bytes])
                at = slice(job.first_block, job.first_block + len(job.block_ids))
                parts.append((values[at], scales[at]))
                loaded[i] = True
            pages = self.pages[key][0]  # the hidden pool has one layer
            states = hidden_codec.decode(
                torch.cat([v for v, _ in parts]).to(pages.device),
                torch.cat([c for _, c in parts]).to(pages.device),
                codec.page_shape,
                self.dtypes[key],
            )
            ids = torch.tensor([b for i in live for b in jobs[i].block_ids], device=pages.device)
            pages[ids] = states.reshape(len(ids), -1).view(torch.uint8)
        return loaded

    def _encode_stores(self, jobs: list[ChunkCopy], slots: torch.Tensor) -> list[bool]:
        """A step's stores of coded chunks, encoded in one pass per pool (one gather, one
        encode: per chunk, the ops would cost more than their work), then each chunk's rows
        copied into its slot. Whether each was written."""
        written = [False] * len(jobs)
        for key, plan, codec, live in self._coded(jobs, slots):
            pages = self.pages[key][0]
            ids = torch.tensor([b for i in live for b in jobs[i].block_ids], device=pages.device)
            states = pages[ids].view(self.dtypes[key]).view(len(ids), *codec.page_shape)
            coded, scale = (t.cpu() for t in hidden_codec.encode(states))
            row = 0
            for i in live:
                job, n = jobs[i], len(jobs[i].block_ids)
                values, scales = codec.split(slots[job.offset : job.offset + plan.chunk_bytes])
                at = slice(job.first_block, job.first_block + n)
                values[at], scales[at] = coded[row : row + n], scale[row : row + n]
                row += n
                written[i] = True
        return written

    def _slot_current(self, job: ChunkCopy, plan: PoolPlan, slots: torch.Tensor) -> bool:
        """Whether the job's slot is the one planned for, in the arena mapped here."""
        if not 0 <= job.offset <= slots.numel() - plan.chunk_bytes:
            return False  # a slot outside the mapping: an arena other than the one planned for
        mapped = self._arena
        # planned in another arena (a restarted daemon's, whose epoch differs) or reused
        # since: writing it would overwrite a chunk someone else holds
        return (
            mapped is not None
            and 0 <= job.slot < len(mapped.generation)
            and mapped.is_current(job.slot, job.generation)
        )

    def _pairs(
        self, job: ChunkCopy, slots: torch.Tensor, per_layer: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(arena, pages) views of the job's chunk, all layers at once where they sit at one
        stride (unless ``per_layer``); None where the slot is not the one planned for."""
        plan = self.plans.get(job.plan)
        if plan is None or not self._slot_current(job, plan, slots):
            return None
        layers, bpc = len(plan.layer_names), plan.blocks_per_chunk
        # the slot as [layers, blocks of the chunk, page], as `PoolPlan.layer_offset` lays the
        # payload out; this rank's part of a page is its heads
        chunk = slots[job.offset : job.offset + plan.chunk_bytes]
        ours, whole, heads = _page_dims(plan)
        chunk = chunk.view(layers, bpc, *whole)
        stack = None if per_layer else self.stacks.get(job.plan)
        pairs = []
        for index, block, n in _runs(job.block_ids):
            part = chunk[:, job.first_block + index : job.first_block + index + n]
            part = part.narrow(2 + heads, plan.shard.first, plan.shard.count)
            if stack is not None:
                pairs.append((part, stack[:, block : block + n].view(layers, n, *ours)))
            else:
                pairs.extend(
                    (part[i], p[block : block + n].view(n, *ours))
                    for i, p in enumerate(self.pages[job.plan])
                )
        return pairs

    def _compare(self, job: ChunkCopy, slots: torch.Tensor) -> float:
        """The chunk's largest relative error over its layers (the norm of the difference over
        the norm of vLLM's own KV); negative where the slot is not the one planned for."""
        pairs = self._pairs(job, slots, per_layer=True)
        dtype = self.dtypes.get(job.plan)
        if pairs is None or dtype is None:
            return -1.0
        layers = len(self.pages[job.plan])
        diff, norm = [0.0] * layers, [0.0] * layers
        for i, (arena, pages) in enumerate(pairs):
            kept = arena.to(pages.device).contiguous().view(dtype).float()
            computed = pages.contiguous().view(dtype).float()
            diff[i % layers] += float(torch.sum((kept - computed) ** 2))
            norm[i % layers] += float(torch.sum(computed**2))
        return max(
            (d / n) ** 0.5 if n else (0.0 if d == 0 else float("inf"))
            for d, n in zip(diff, norm, strict=True)
        )

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
            self._slots(meta.arena_path)
        self._load_errors.update(meta.invalid_blocks)
        self._fail_requests(set(meta.failed_requests))
        checked = self._check_draft(meta)
        if not meta.loads and not meta.zero and not meta.receiving:
            return
        failed: set[str] = set()
        issued: list[tuple[ChunkCopy, float]] = []
        slots = self._slots(meta.arena_path)
        if slots is None or self._arena is None:
            self._fail_loads(meta.loads, failed)
        else:
            self.copies.begin_loads()
            coded: list[ChunkCopy] = []
            for job in meta.loads:
                plan = self.plans.get(job.plan)
                if plan is not None and plan.codec is not None:
                    coded.append(job)
                    continue
                if self._is_draft(job) and not job.fill:
                    if not self._draft_ok:  # planned for other weights: a defined fill instead
                        self._zero(job.plan, list(job.block_ids))
                        self.stats.fill(Fill.ZEROS, 1)
                        continue
                    if not checked and self._draft_watch is not None:
                        self._draft_watch.unverified += 1
                started = time.perf_counter()
                if self._copy(job, slots, into_arena=False):
                    issued.append((job, time.perf_counter() - started))
                else:
                    self._fail_loads([job], failed)
                    self._record("load", job, started, False)
            if coded:
                started = time.perf_counter()
                decoded = self._decode_loads(coded, slots)
                each = (time.perf_counter() - started) / len(coded)
                for job, ok in zip(coded, decoded, strict=True):
                    if ok:
                        issued.append((job, each))
                    else:
                        self._fail_loads([job], failed)
                        self._count("load", job, each, False)
            self.copies.end_loads()
        for key, blocks in meta.zero.items():
            self._zero(key, blocks)
        # only queued so far: each slot's generation is checked once its bytes landed
        if not issued and not meta.receiving:
            return
        fence = self.copies.fence()
        sync = [c for c in issued if not c[0].request]
        if sync:
            self._loads.append(_Issued(fence, self._arena, sync))
        if meta.receiving:
            asynchronous = [c for c in issued if c[0].request]
            loads = _Issued(fence, self._arena, asynchronous)
            self._receiving.append((loads, set(meta.receiving), failed))

    def _check_landed(self, loads: _Issued, failed: set[str]) -> None:
        """Loads whose fence passed: a slot still at the generation the scheduler looked up
        held that chunk's bytes while they were read (its generation moves before it is
        rewritten); any other slot is a load error."""
        arena = loads.arena
        for job, seconds in loads.copies:
            ok = (
                arena is not None
                and arena is self._arena
                and arena.is_current(job.slot, job.generation)
            )
            if not ok:
                self._fail_loads([job], failed)
            self._count("load", job, seconds, ok)

    def fail_step(self, meta: KVTierMetadata, loads: bool) -> None:
        """A hook failed part way: this step's loads (``loads``) or stores are failures, so
        vLLM recomputes those blocks and no slot is committed from half a copy."""
        if not loads:
            self._failed.extend((job.slot, job.generation) for job in meta.stores)
            self._send_after(Fence(), meta.sending)
            return
        self._load_errors.update(meta.invalid_blocks)
        failed = set(meta.receiving) | set(meta.failed_requests)
        self._fail_loads(meta.loads, failed)
        self._fail_requests(failed)

    def _fail_requests(self, requests: set[str]) -> None:
        """Asynchronous loads that will not come: reported finished and failed at once."""
        if requests:
            self._receiving.append((_Issued(Fence(), None, []), requests, requests))

    def unchecked_errors(self) -> set[int]:
        """Every block loaded since vLLM last asked: what it must recompute when the check
        itself failed."""
        errors = self._load_errors | {
            b for i in self._loads for j, _ in i.copies for b in j.block_ids
        }
        self._loads, self._load_errors = [], set()
        return errors - {0}

    def fail_receiving(self) -> tuple[set[str], set[str]]:
        """Every asynchronous load in flight, failed: when checking them failed."""
        requests = {r for _, reqs, _ in self._receiving for r in reqs}
        self._receiving = []
        return set(), requests

    def _fail_loads(self, jobs: list[ChunkCopy], failed: set[str]) -> None:
        """Blocks vLLM must recompute: per request for asynchronous loads, else per block."""
        for job in jobs:
            if job.request:
                failed.add(job.request)
            else:
                self._load_errors.update(b for b in job.block_ids if b)

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous loads landed, and those among them that failed."""
        done: set[str] = set()
        failed: set[str] = set()
        waiting = []
        for loads, requests, bad in self._receiving:
            if loads.fence():
                self._check_landed(loads, bad)
                done |= requests - bad
                failed |= bad
            else:
                waiting.append((loads, requests, bad))
        self._receiving = waiting
        return done, failed

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        if meta.checks:
            self._compare_checks(meta)
        if not meta.stores:
            self._send_after(Fence(), meta.sending)
            return
        slots = self._slots(meta.arena_path)
        if slots is None:
            self._failed.extend((job.slot, job.generation) for job in meta.stores)
            self._send_after(Fence(), meta.sending)
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
            self._record("store", job, started, ok)
        if coded:
            started = time.perf_counter()
            written = self._encode_stores(coded, slots)
            each = (time.perf_counter() - started) / len(coded)
            for job, ok in zip(coded, written, strict=True):
                (issued if ok else self._failed).append((job.slot, job.generation))
                self._count("store", job, each, ok)
        fence = self.copies.end_stores()
        self._landing.append((fence, issued))
        self._send_after(fence, meta.sending)

    def _send_after(self, fence: Fence, requests: list[str]) -> None:
        # once each: vLLM frees a request's blocks at its first report, and fails on a second
        fresh = set(requests).difference(*(reqs for _, reqs in self._sending))
        if fresh:
            self._sending.append((fence, fresh))

    def finished_sends(self, finished: set[str]) -> set[str]:
        """Finished requests whose last stores landed: their blocks may go."""
        self._finished_ids |= finished
        sent: set[str] = set()
        waiting = []
        for fence, requests in self._sending:
            ready = requests & self._finished_ids
            if ready and fence():
                sent |= ready
                requests -= ready
            if requests:
                waiting.append((fence, requests))
        self._sending = waiting
        self._finished_ids -= sent
        self._finished_ids &= {r for _, reqs in waiting for r in reqs} | finished
        return sent

    def all_sends(self) -> set[str]:
        """Every request waiting for its stores, as sent: when checking them failed (a store
        that did not land is never committed, so its blocks may go)."""
        sent = {r for _, reqs in self._sending for r in reqs}
        self._sending = []
        return sent

    def _compare_checks(self, meta: KVTierMetadata) -> None:
        slots = self._slots(meta.arena_path)
        for job in meta.checks:
            plan = self.plans.get(job.plan)
            if plan is not None and not plan.shard.writes:
                continue  # another rank holding the same heads compares them
            error = -1.0
            # other weights' draft KV than the chunk's: no comparison says anything
            if slots is not None and (self._draft_ok or not self._is_draft(job)):
                error = self._compare(job, slots)
            self._compared.append((job.slot, job.generation, error))

    def _record(self, direction: str, job: ChunkCopy, started: float, ok: bool) -> None:
        self._count(direction, job, time.perf_counter() - started, ok)

    def _count(self, direction: str, job: ChunkCopy, seconds: float, ok: bool) -> None:
        plan = self.plans.get(job.plan)
        if plan is None:
            return
        blocks = sum(1 for b in job.block_ids if b)
        page = plan.page_bytes if plan.codec is None else plan.codec.page_bytes
        nbytes = page * len(plan.layer_names) * blocks  # this rank's part
        self.stats.record(direction, str(plan.pool), nbytes, seconds, ok)

    def take_stats(self) -> KVTierStats | None:
        stats, self.stats = take(self.stats)
        return stats

    def block_ids_with_load_errors(self) -> set[int]:
        """Blocks of synchronous loads that vLLM must recompute. It asks after the forward, which
        on a device already waits on the loads' fence: the host waits for it too, then checks."""
        for loads in self._loads:
            loads.fence.wait()
            self._check_landed(loads, set())
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
        if not self._stored and not self._failed and not self._fingerprints and not self._compared:
            return None
        meta = KVTierWorkerMetadata(self._stored, self._failed, self._fingerprints, self._compared)
        self._stored, self._failed, self._fingerprints, self._compared = [], [], {}, []
        return meta

    def shutdown(self) -> None:
        self.copies.detach()
        self._arena_bytes = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
