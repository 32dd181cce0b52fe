"""Which registered layers form the target, draft and hidden pools, and what their chunks look
like.

Each KV-cache group vLLM allocates (one, or several with the hybrid allocator) has its own block
ids; its layers are split into the target and draft pools, and every (group, pool) pair is a
plan with its own pages, chunk size and namespace. An engine capturing hidden states (the
speculative method ``extract_hidden_states``) keeps them in a cache-only layer beside the
attention layers, with the same block table; that layer is the hidden pool: per token, the
target's hidden state at each auxiliary layer. Both connector sides compute the same plans
from vLLM's configuration; the worker then checks them against the tensors it was given and
refuses a plan whose pages differ, rather than guess.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.core.keys import NamespaceSpec, PageLayout, Pool
from kvtier.hidden.reader import HIDDEN_ATTENTION
from kvtier_vllm.layout.fp8 import FP8, Fp8Layout
from kvtier_vllm.layout.states import (
    SHARDS_PROVEN,
    STATE_WINDOW,
    StateShape,
    is_state_spec,
    state_shape,
)
from kvtier_vllm.shared import weights
from kvtier_vllm.shared.settings import ConnectorConfig
from kvtier_vllm.shared.shapes import (
    HEADS_FIRST,
    TOKENS_FIRST,
    Shard,
    UnsupportedGroupError,
    layout_name,
    page_order,
    refusal,
    tp_shard,
)

log = logging.getLogger(__name__)

DRAFT_PREFIX = "draft_model."
HIDDEN_PREFIX = "cache_only_layers."
"""``extract_hidden_states``' layer caching the target's hidden states."""
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One of vLLM's KV-cache groups: layers that share one block table."""

    index: int
    layer_names: tuple[str, ...]
    window: int = 0
    """Tokens before a position that its attention still reads (vLLM keeps their blocks);
    0: every earlier token (full attention)."""
    sliding_window: int = 0
    """The model's window, for the namespace; 0: full attention."""
    state: StateShape | None = None
    """State-space or linear-attention layers: their state's page; None: attention KV."""


@dataclass(frozen=True, slots=True)
class PoolPlan:
    pool: Pool
    layer_names: tuple[str, ...]
    page_bytes: int
    """Bytes of one block of one layer, as this worker holds it (its KV heads)."""
    spec: NamespaceSpec
    blocks_per_chunk: int
    key: str = ""
    """Names the plan in step metadata and on the worker: the pool, plus the group when there
    are several."""
    group: int = 0
    window: int = 0
    """See `KVGroup.window`."""
    shard: Shard = field(default_factory=Shard)
    """This worker's KV heads among a chunk's."""
    order: str = HEADS_FIRST
    """Element order inside a page (`shapes.HEADS_FIRST` or `shapes.TOKENS_FIRST`)."""
    codec: Fp8Layout | None = None
    """How a chunk stores pages in a narrower dtype than the cache (the hidden pool in fp8);
    None: their bytes as they are."""

    def first_needed(self, chunks: int, chunk_tokens: int) -> int:
        """The first chunk a hit of ``chunks`` chunks needs from this plan: 0 for full
        attention, the start of the window before the hit's end for a sliding window."""
        if not self.window:
            return 0
        return max(0, chunks * chunk_tokens - self.window) // chunk_tokens

    def keeps(self, chunk: int, end: int, every: int, chunk_tokens: int) -> bool:
        """Whether a prompt whose hit ends at chunk ``end`` stores ``chunk`` here: every chunk
        for full attention; for a sliding window, the window before ``end``, every chunk past
        it, and (``every`` > 0) the window before each multiple of ``every`` chunks. The state
        pool keeps every chunk whose state vLLM kept (a hit may end at any of them); the others'
        blocks are null, and never stored."""
        if self.pool is Pool.STATE:
            return True
        if chunk >= self.first_needed(end, chunk_tokens):
            return True
        # the nearest checkpoint after the chunk has the latest window start of any after it
        checkpoint = (chunk // every + 1) * every if every else end + 1
        return checkpoint <= end and chunk >= self.first_needed(checkpoint, chunk_tokens)

    @property
    def chunk_page_bytes(self) -> int:
        """Bytes of one block of one layer in a chunk: every KV head's."""
        if self.codec is not None:
            return self.codec.page_bytes
        return self.page_bytes // self.shard.count * self.shard.heads

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_page_bytes * len(self.layer_names) * self.blocks_per_chunk

    def layer_offset(self, layer: int, block: int) -> int:
        """Where a page sits in the chunk payload: layer after layer, block after block."""
        return (layer * self.blocks_per_chunk + block) * self.chunk_page_bytes


def _layer_index(name: str) -> int:
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else -1


def is_draft_layer(name: str, target_layers: int) -> bool:
    """``draft_model.*`` for draft models; layers numbered past the target's for EAGLE, DFlash
    and MTP heads."""
    return name.startswith(DRAFT_PREFIX) or _layer_index(name) >= target_layers


def split_layers(names: Iterable[str], target_layers: int) -> dict[Pool, tuple[str, ...]]:
    ordered = sorted(set(names), key=lambda n: (_layer_index(n), n))
    hidden = tuple(n for n in ordered if n.startswith(HIDDEN_PREFIX))
    draft = tuple(n for n in ordered if n not in hidden and is_draft_layer(n, target_layers))
    target = tuple(n for n in ordered if n not in draft and n not in hidden)
    pools = ((Pool.TARGET, target), (Pool.DRAFT, draft), (Pool.HIDDEN, hidden))
    return {pool: layers for pool, layers in pools if layers}


def _page_bytes(model_config: Any, heads: int, cache_dtype: str, block_size: int) -> int:
    # vLLM is loaded only where an engine plans its pools: this module's other users need none
    from kvtier_vllm.shared.vllm_compat import kv_cache_dtype_bytes

    itemsize = kv_cache_dtype_bytes(cache_dtype, model_config)
    # MLA keeps one latent vector per token; other attention keeps K and V side by side
    per_token = 1 if getattr(model_config, "use_mla", False) else 2
    return int(block_size * heads * per_token * model_config.get_head_size() * itemsize)


def _shard(model_config: Any, parallel_config: Any) -> Shard:
    tp = parallel_config.tensor_parallel_size
    mla = bool(getattr(model_config, "use_mla", False))
    shard = tp_shard(model_config.get_total_num_kv_heads(), tp, parallel_config.rank % tp, mla)
    held = model_config.get_num_kv_heads(parallel_config)
    if held != shard.count:  # a split other than the one tp_shard knows
        raise UnsupportedGroupError(
            f"each TP rank holds {held} KV heads, not the {shard.count} kvtier expects"
        )
    return shard


def _group_kind(spec: Any) -> tuple[int, int]:
    """(retained window, sliding window) of a group's spec; raises for layers kvtier cannot
    store by block."""
    kind = type(spec).__name__
    if kind == "UniformTypeKVCacheSpecs":  # one block table, layers of one attention type
        specs = list(spec.kv_cache_specs.values())
        spec, kind = specs[0], type(specs[0]).__name__
    if "SlidingWindow" in kind:
        window = int(spec.sliding_window)
        return window - 1 + int(getattr(spec, "extra_retained_tokens", 0)), window
    if kind in ("FullAttentionSpec", "MLAAttentionSpec", "HiddenStateCacheSpec"):
        return 0, 0
    raise UnsupportedGroupError(
        f"kvtier stores attention KV by block; a {kind} group is not supported: run "
        "this model without kvtier, or with the hybrid allocator off if its layers allow it"
    )


def kv_groups(kv_cache_config: Any, layer_names: Iterable[str] = ()) -> list[KVGroup]:
    """vLLM's KV-cache groups; without a config, one full-attention group of ``layer_names``."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return [KVGroup(0, tuple(layer_names))]
    block_sizes = {g.kv_cache_spec.block_size for g in groups}
    hashed = getattr(kv_cache_config, "hash_block_size", None)
    if len(block_sizes) > 1 or (hashed is not None and {hashed} != block_sizes):
        # chunk keys are the block hashes of whole blocks, the same in every group
        raise UnsupportedGroupError(
            f"KV-cache groups with block sizes {sorted(block_sizes)} hashed every {hashed} "
            "tokens are not supported"
        )
    out = []
    for index, group in enumerate(groups):
        if not getattr(group, "enable_kv_transfer", True):
            raise UnsupportedGroupError(f"KV-cache group {index} does not allow KV transfer")
        names = tuple(group.layer_names)
        if is_state_spec(group.kv_cache_spec):
            out.append(KVGroup(index, names, STATE_WINDOW, state=state_shape(group.kv_cache_spec)))
            continue
        window, sliding = _group_kind(group.kv_cache_spec)
        out.append(KVGroup(index, names, window, sliding))
    return out


def misplaced_draft(vllm_config: Any, groups: list[KVGroup]) -> str:
    """Why a ``draft_model`` drafter outside group 0 must not be cached, or "".

    vLLM hands such a drafter group 0's block table, so its KV lands in the target's blocks and
    outputs are wrong with or without a connector; nothing computed under it may be stored."""
    spec = vllm_config.speculative_config
    if spec is None or getattr(spec, "method", None) != "draft_model":
        return ""
    for group in groups:
        if group.index and any(n.startswith(DRAFT_PREFIX) for n in group.layer_names):
            return (
                f"the draft_model drafter's layers are in KV-cache group {group.index}, where "
                "vLLM writes its KV into the target's blocks (wrong outputs, with or without "
                "kvtier). Start vLLM with --disable-hybrid-kv-cache-manager for this "
                "deployment, or use an EAGLE or DFlash drafter."
            )
    return ""


def engine_plans(
    vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig
) -> tuple[list[PoolPlan], list[KVGroup], str]:
    """The pools this engine stores, its KV-cache groups, and why it stores none ("" when it
    does): a shape kvtier has not proven is refused at start, with a log line, for good."""
    try:
        groups = kv_groups(kv_cache_config)
        why = refusal(vllm_config) or misplaced_draft(vllm_config, groups)
        plans = [] if why else plan_pools(vllm_config, groups, cfg)
    except UnsupportedGroupError as exc:
        why = str(exc)
    if why:
        log.error("kvtier is off for this engine: %s", why)
        return [], [], why
    return plans, groups, ""


def plan_pools(
    vllm_config: Any, groups: list[KVGroup], cfg: ConnectorConfig, *, named: bool = True
) -> list[PoolPlan]:
    """Each (group, pool) pair's plan. ``named``: its namespace names the weights (read from
    the checkpoint); the worker, which never makes a key, plans without reading them."""
    plans = []
    for group in groups:
        if group.state is not None:
            plans.append(_state_plan(vllm_config, group, group.state, cfg, named))
            continue
        for plan in _plan_group(vllm_config, group.layer_names, cfg, named):
            key = str(plan.pool) if len(groups) == 1 else f"{plan.pool}.{group.index}"
            spec = plan.spec
            if group.sliding_window:
                spec = replace(spec, attention=f"sliding_window={group.sliding_window}")
            plans.append(replace(plan, spec=spec, key=key, group=group.index, window=group.window))
    return plans


def _plan_group(
    vllm_config: Any, layer_names: Iterable[str], cfg: ConnectorConfig, named: bool
) -> list[PoolPlan]:
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    spec_cfg = vllm_config.speculative_config
    block_size = cache.block_size
    target_layers = model.get_num_layers(parallel)
    revision = weights.target_revision(vllm_config, cfg.model_revision) if named else ""
    order = page_order(layout_name(cache))
    plans = []
    for pool, layers in split_layers(layer_names, target_layers).items():
        if pool is Pool.HIDDEN:
            plans.append(_hidden_plan(vllm_config, layers, cfg, revision))
            continue
        if pool is Pool.DRAFT:
            draft_model = spec_cfg.draft_model_config if spec_cfg is not None else None
            owner = draft_model or model
            cache_dtype = getattr(spec_cfg, "kv_cache_dtype", None) or cache.cache_dtype
            draft_name: str | None = str(owner.model)
            draft_revision: str | None = (
                weights.draft_revision(vllm_config, owner, cfg.model_revision) if named else ""
            )
        else:
            owner, cache_dtype = model, cache.cache_dtype
            draft_name = draft_revision = None
        shard = _shard(owner, parallel)
        page = _page_bytes(owner, shard.count, cache_dtype, block_size)
        head = owner.get_head_size()
        head_sizes = (head,) if getattr(owner, "use_mla", False) else (head, head)
        spec = NamespaceSpec(
            model=str(model.model),
            model_revision=revision,
            pool=pool,
            kv_dtype=str(cache_dtype if cache_dtype != "auto" else owner.dtype),
            layout=PageLayout(
                tokens_per_block=block_size,
                blocks_per_chunk=cfg.blocks_per_chunk,
                num_kv_heads=shard.heads,
                head_sizes=head_sizes,
                layer_names=layers,
                kv_order=order,
            ),
            tp_size=shard.tp_size,  # 1: every TP degree reads the chunk
            pp_size=parallel.pipeline_parallel_size,
            hash_algo=cache.prefix_caching_hash_algo,
            tenant=cfg.tenant,
            draft_model=draft_name,
            draft_revision=draft_revision,
        )
        plans.append(
            PoolPlan(
                pool, layers, page, spec, cfg.blocks_per_chunk, str(pool), shard=shard, order=order
            )
        )
    return plans


def _state_plan(
    vllm_config: Any, group: KVGroup, state: StateShape, cfg: ConnectorConfig, named: bool
) -> PoolPlan:
    """A state group's pool: one block's state per layer and chunk. Above TP=1 each rank's
    part of a page is its own "head" of the chunk's, and the chunk names the degree: another
    degree's ranks split the state otherwise, so never read it."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    tp = parallel.tensor_parallel_size
    if tp > 1 and not state.sharded:
        raise UnsupportedGroupError(
            f"state-space or linear-attention layers at tensor_parallel_size={tp} (a copy of "
            "the state on every rank): kvtier serves replicated states at TP=1 only so far"
        )
    if tp > 1 and state.kind not in SHARDS_PROVEN:
        raise UnsupportedGroupError(
            f"{state.kind} state layers at tensor_parallel_size={tp}: kvtier serves per-rank "
            f"state shards of {', '.join(sorted(SHARDS_PROVEN))} layers only above TP=1 so far"
        )
    shard = Shard(tp, parallel.rank % tp, 1, True, tp, tp) if tp > 1 else Shard()
    revision = weights.target_revision(vllm_config, cfg.model_revision) if named else ""
    spec = NamespaceSpec(
        model=str(model.model),
        model_revision=revision,
        pool=Pool.STATE,
        kv_dtype="uint8",
        layout=PageLayout(
            tokens_per_block=1,  # one state per block, whatever its tokens: a page of bytes
            blocks_per_chunk=cfg.blocks_per_chunk,
            num_kv_heads=shard.heads,
            head_sizes=(state.page_bytes,),
            layer_names=group.layer_names,
            kv_order=page_order(layout_name(cache)),
        ),
        tp_size=shard.tp_size,
        pp_size=parallel.pipeline_parallel_size,
        hash_algo=cache.prefix_caching_hash_algo,
        tenant=cfg.tenant,
        attention=state.describe(cache.block_size),
    )
    key = f"{Pool.STATE}.{group.index}"
    return PoolPlan(
        Pool.STATE,
        group.layer_names,
        state.page_bytes,
        spec,
        cfg.blocks_per_chunk,
        key,
        group=group.index,
        window=group.window,
        shard=shard,
    )


def aux_layers(vllm_config: Any) -> tuple[int, ...]:
    """The target layers whose hidden states an ``extract_hidden_states`` engine captures."""
    spec = vllm_config.speculative_config
    hf = spec.draft_model_config.hf_config
    return tuple(int(i) for i in getattr(hf, "eagle_aux_hidden_state_layer_ids", ()) or ())


def _hidden_plan(
    vllm_config: Any, layers: tuple[str, ...], cfg: ConnectorConfig, revision: str
) -> PoolPlan:
    """The captured hidden states: one cache-only layer whose page holds, per token, the hidden
    state at each auxiliary layer (as [layers, tokens, hidden] in the heads-first layouts,
    [tokens, layers, hidden] in the others). Every TP rank holds all of it,
    as with MLA's latent cache, so rank 0 alone writes it."""
    import torch

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    if len(layers) != 1:
        raise UnsupportedGroupError(f"hidden-state group of {len(layers)} layers, expected 1")
    aux = aux_layers(vllm_config)
    hidden = model.get_hidden_size()
    dtype = model.dtype if isinstance(model.dtype, torch.dtype) else torch.float32
    tp = parallel.tensor_parallel_size
    shard = Shard(len(aux), 0, len(aux), parallel.rank % tp == 0, 1)
    order = page_order(layout_name(cache))
    captured = str(dtype).removeprefix("torch.")
    codec = None
    if cfg.hidden_dtype == "fp8":
        if order == TOKENS_FIRST:
            shape = (cache.block_size, len(aux), hidden)
        else:
            shape = (len(aux), cache.block_size, hidden)
        codec = Fp8Layout(cfg.blocks_per_chunk, shape)
    spec = NamespaceSpec(
        model=str(model.model),
        model_revision=revision,
        pool=Pool.HIDDEN,
        kv_dtype=f"{FP8}:{captured}" if codec is not None else captured,
        layout=PageLayout(
            tokens_per_block=cache.block_size,
            blocks_per_chunk=cfg.blocks_per_chunk,
            num_kv_heads=len(aux),
            head_sizes=(hidden,),
            layer_names=layers,
            kv_order=order,
        ),
        hash_algo=cache.prefix_caching_hash_algo,
        tenant=cfg.tenant,
        attention=f"{HIDDEN_ATTENTION}=" + ",".join(str(i) for i in aux),
    )
    page = cache.block_size * len(aux) * hidden * dtype.itemsize
    return PoolPlan(
        Pool.HIDDEN,
        layers,
        page,
        spec,
        cfg.blocks_per_chunk,
        str(Pool.HIDDEN),
        shard=shard,
        order=order,
        codec=codec,
    )
