"""Which registered layers form the target and draft pools, and what their chunks look like.

Both connector sides compute the same plan from vLLM's configuration; the worker then checks it
against the tensors it was given and refuses a pool whose pages differ, rather than guess.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvtier.keys import NamespaceSpec, PageLayout, Pool
from kvtier_vllm.config import ConnectorConfig

DRAFT_PREFIX = "draft_model."
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class PoolPlan:
    pool: Pool
    layer_names: tuple[str, ...]
    page_bytes: int
    """Bytes of one block of one layer."""
    spec: NamespaceSpec
    blocks_per_chunk: int

    @property
    def chunk_bytes(self) -> int:
        return self.page_bytes * len(self.layer_names) * self.blocks_per_chunk

    def layer_offset(self, layer: int, block: int) -> int:
        """Where a page sits in the chunk payload: layer after layer, block after block."""
        return (layer * self.blocks_per_chunk + block) * self.page_bytes


def _layer_index(name: str) -> int:
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else -1


def is_draft_layer(name: str, target_layers: int) -> bool:
    """``draft_model.*`` for draft models; layers numbered past the target's for EAGLE, DFlash
    and MTP heads."""
    return name.startswith(DRAFT_PREFIX) or _layer_index(name) >= target_layers


def split_layers(names: Iterable[str], target_layers: int) -> dict[Pool, tuple[str, ...]]:
    ordered = sorted(set(names), key=lambda n: (_layer_index(n), n))
    draft = tuple(n for n in ordered if is_draft_layer(n, target_layers))
    target = tuple(n for n in ordered if n not in draft)
    return {pool: layers for pool, layers in ((Pool.TARGET, target), (Pool.DRAFT, draft)) if layers}


def _page_bytes(model_config: Any, parallel_config: Any, cache_dtype: str, block_size: int) -> int:
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    dtype = kv_cache_dtype_str_to_dtype(cache_dtype, model_config)
    heads = model_config.get_num_kv_heads(parallel_config)
    head_size = model_config.get_head_size()
    return int(block_size * heads * 2 * head_size * dtype.itemsize)


def plan_pools(
    vllm_config: Any, layer_names: Iterable[str], cfg: ConnectorConfig
) -> list[PoolPlan]:
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    spec_cfg = vllm_config.speculative_config
    block_size = cache.block_size
    target_layers = model.get_num_layers(parallel)
    revision = cfg.model_revision or model.revision or "none"
    plans = []
    for pool, layers in split_layers(layer_names, target_layers).items():
        if pool is Pool.DRAFT:
            draft_model = spec_cfg.draft_model_config if spec_cfg is not None else None
            owner = draft_model or model
            cache_dtype = getattr(spec_cfg, "kv_cache_dtype", None) or cache.cache_dtype
            draft_name: str | None = str(owner.model)
            draft_revision: str | None = owner.revision or "none"
        else:
            owner, cache_dtype = model, cache.cache_dtype
            draft_name = draft_revision = None
        page = _page_bytes(owner, parallel, cache_dtype, block_size)
        heads = owner.get_num_kv_heads(parallel)
        head = owner.get_head_size()
        spec = NamespaceSpec(
            model=str(model.model),
            model_revision=revision,
            pool=pool,
            kv_dtype=str(cache_dtype if cache_dtype != "auto" else owner.dtype),
            layout=PageLayout(
                tokens_per_block=block_size,
                blocks_per_chunk=cfg.blocks_per_chunk,
                num_kv_heads=heads,
                head_sizes=(head, head),
                layer_names=layers,
            ),
            tp_rank=parallel.rank % parallel.tensor_parallel_size,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            hash_algo=cache.prefix_caching_hash_algo,
            tenant=cfg.tenant,
            draft_model=draft_name,
            draft_revision=draft_revision,
        )
        plans.append(PoolPlan(pool, layers, page, spec, cfg.blocks_per_chunk))
    return plans
