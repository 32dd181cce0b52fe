"""The parallel shapes kvtier serves, and where each worker's KV sits in a chunk.

A chunk holds the whole model's KV for its tokens: every layer and every KV head, block after
block, with each page in the backend's own element order. A worker writes and reads only its
part, the layers of its pipeline stage and the heads of its tensor-parallel rank, at offsets
that depend on the model alone, so engines of any TP degree read the same chunks. A chunk is
committed once every worker that writes a part has written it.

Anything else vLLM can run that kvtier has not proven is refused at start (`refusal`): the
engine then serves without kvtier, and the reason is logged once. Pipeline parallelism is among
them: a stage's chunk part would be its layers at their offset in the model, committed once every
rank of every stage reported, but vLLM hands the scheduler the first stage's layer names only
(`generate_scheduler_kv_cache_config`), so the scheduler cannot name the whole model's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UnsupportedGroupError(ValueError):
    """A KV-cache group kvtier cannot store (chunked-local layers, state layers outside vLLM's
    align mode), or weights it cannot name."""


HEADS_FIRST = "HNC"
"""Pages as [heads, tokens, K‖V]: a rank's heads are one run of each page."""
TOKENS_FIRST = "NHC"
"""Pages as [tokens, heads, K‖V]: a rank's heads are one run per token."""

_PAGE_ORDERS = {
    "LBHNC": HEADS_FIRST,
    "BLHNC": HEADS_FIRST,
    "LBNHC": TOKENS_FIRST,
    "BLNHC": TOKENS_FIRST,
}
"""vLLM's physical layouts whose pages are contiguous per block, by the order inside one."""


@dataclass(frozen=True, slots=True)
class Shard:
    """Which KV heads of a chunk one tensor-parallel rank holds."""

    heads: int = 1
    """KV heads in a chunk."""
    first: int = 0
    """The first of them this rank holds."""
    count: int = 1
    """How many this rank holds."""
    writes: bool = True
    """Whether this rank writes its part: of ranks holding the same heads, only the first."""
    writers: int = 1
    """Ranks that write a part of each chunk; it is committed once all of them reported."""
    tp_size: int = 1
    """In the namespace: 1 for chunks every TP degree reads, the degree for per-degree ones."""

    def __post_init__(self) -> None:
        if not (self.first >= 0 and self.count > 0 and self.first + self.count <= self.heads):
            raise ValueError(f"heads {self.first}..+{self.count} outside a chunk of {self.heads}")


def tp_shard(total_kv_heads: int, tp_size: int, tp_rank: int, mla: bool = False) -> Shard:
    """The heads of rank ``tp_rank`` among ``tp_size``, as vLLM splits them.

    vLLM gives each rank ``total // tp`` heads in order; with fewer heads than ranks, each head
    is held by ``tp // total`` consecutive ranks (rank r holds head ``r // replicas``). MLA's
    latent cache is the same on every rank: rank 0 alone writes it.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
    if mla:
        return Shard(1, 0, 1, tp_rank == 0, 1)
    if total_kv_heads % tp_size == 0:
        per = total_kv_heads // tp_size
        return Shard(total_kv_heads, tp_rank * per, per, True, tp_size)
    if tp_size % total_kv_heads == 0:
        replicas = tp_size // total_kv_heads
        return Shard(
            total_kv_heads, tp_rank // replicas, 1, tp_rank % replicas == 0, total_kv_heads
        )
    # no split vLLM makes; should one appear, its chunks stay among engines of this degree
    per = max(1, total_kv_heads // tp_size)
    return Shard(per * tp_size, tp_rank * per, per, True, tp_size, tp_size)


def page_order(layout_name: str) -> str:
    """The element order inside one page for a vLLM KV-cache layout name; "" if kvtier cannot
    copy pages of that layout (a block's bytes not contiguous)."""
    return _PAGE_ORDERS.get(layout_name, "")


def layout_name(cache_config: Any) -> str:
    """The KV-cache layout vLLM resolved for this engine; LBHNC (the CPU backend's) where it has
    not been resolved, which the worker then checks against its tensors."""
    name = getattr(cache_config, "kv_cache_layout", None)
    if name is None:
        return "LBHNC"
    return str(getattr(name, "name", name))


def refusal(vllm_config: Any) -> str:
    """Why kvtier must not cache this engine's KV, naming the setting; "" when it may."""
    parallel = vllm_config.parallel_config
    pp = int(getattr(parallel, "pipeline_parallel_size", 1))
    if pp > 1:
        return (
            f"pipeline_parallel_size={pp}: kvtier is untested with pipeline parallelism, "
            "whose stages each hold some of the layers; run with pipeline_parallel_size=1"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel, name, 1))
        if size > 1:
            return (
                f"{name}={size}: each rank holds only some tokens of a block, which kvtier's "
                "chunks do not describe"
            )
    layout = layout_name(vllm_config.cache_config)
    if not page_order(layout):
        return (
            f"KV-cache layout {layout}: a block's pages are not contiguous; kvtier copies "
            f"the layouts {sorted(_PAGE_ORDERS)}"
        )
    return ""
