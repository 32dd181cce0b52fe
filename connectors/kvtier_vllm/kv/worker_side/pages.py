"""vLLM's KV cache as the worker copies it: each layer as [blocks, page bytes] in physical
order, a pool's layers as one strided view where vLLM allocated them together, runs of
consecutive blocks, and a page's shape as this rank holds it and as a chunk holds it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from kvtier.core.keys import Pool
from kvtier_vllm.layout.plans import KVGroup, PoolPlan
from kvtier_vllm.layout.states import state_pages
from kvtier_vllm.shared.shapes import HEADS_FIRST, TOKENS_FIRST


def pages_of(tensor: torch.Tensor) -> tuple[torch.Tensor, str] | None:
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


def plan_pages(plan: PoolPlan, cache: Any) -> tuple[torch.Tensor, str] | None:
    """A layer's cache as `pages_of` gives it; a state layer's tensors as one page per block
    (`states.state_pages`), in either order."""
    if plan.pool is not Pool.STATE:
        return pages_of(cache)
    pages = state_pages(cache)
    return None if pages is None else (pages, "")


def stacked(pages: list[torch.Tensor]) -> torch.Tensor | None:
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


def block_runs(block_ids: tuple[int, ...]) -> list[tuple[int, int, int]]:
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


def page_dims(plan: PoolPlan) -> tuple[tuple[int, ...], tuple[int, ...], int]:
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
        if group.state is not None:  # vLLM shares no state between layers
            out.append(group)
            continue
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
