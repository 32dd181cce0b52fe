"""State-space and linear-attention layers (vLLM's MambaSpec groups): what one block's state is,
and when kvtier may store it.

Such a layer keeps no KV per token but one state per request, which vLLM's prefix caching keeps
only at block boundaries (cache mode ``align``): the block at index ``i`` of the group's block
table holds the state after ``(i + 1) * block_size`` tokens, once a step ended there. kvtier
stores that block's bytes as the chunk's part of the state pool; a hit ending at a chunk reads
that chunk's state alone, beside every chunk's attention KV. vLLM raises the block size until an
attention page holds a state page (hundreds of tokens), so a chunk of such an engine is one block:
one state stride.

A state page is each state tensor's part of one block, one after another, unpadded: vLLM lays a
layer's states out so in its per-block page (conv state, then the recurrent state), pads the
page to the attention page's size, and hands a connector the unpadded bytes of each block.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from kvtier_vllm.shared.settings import ConnectorConfig
from kvtier_vllm.shared.shapes import UnsupportedGroupError

log = logging.getLogger(__name__)

STATE_WINDOW = 1
"""As a group's retained window (`plans.KVGroup.window`): a hit ending at a chunk reads the
state at that chunk's last token alone."""


@dataclass(frozen=True, slots=True)
class StateShape:
    """One state layer's page: its tensors' shapes and dtypes, as vLLM keeps them on a rank."""

    kind: str
    """vLLM's name for the layers' kind (e.g. GDN_ATTN for gated delta nets, MAMBA2)."""
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    sharded: bool
    """Whether each TP rank holds a different part of the state (``tp_replicated=False``)."""

    @property
    def page_bytes(self) -> int:
        """One block's state, every tensor's part, unpadded."""
        return sum(nbytes for _, nbytes, _ in self.parts())

    def parts(self) -> tuple[tuple[int, int, str], ...]:
        """Each tensor's place in a page: (first byte, bytes, dtype), in the page's order."""
        out, start = [], 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            nbytes = math.prod(shape) * _itemsize(dtype)
            out.append((start, nbytes, dtype))
            start += nbytes
        return tuple(out)

    def describe(self, stride: int) -> str:
        """The kind, the tokens between states, shapes and dtypes, for the namespace's
        ``attention``: states of another shape, dtype or stride never share chunks. (The
        namespace's dtype is bytes: a page mixes dtypes.)"""
        parts = ",".join(
            "x".join(str(d) for d in shape) + f":{dtype}"
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )
        return f"state={self.kind}@{stride}:{parts}"


def _itemsize(dtype: str) -> int:
    import torch

    return int(getattr(torch, dtype).itemsize)


SHARDS_PROVEN = frozenset({"GDN_ATTN"})
"""State kinds whose per-rank shards kvtier has served above TP=1 with vLLM alone's outputs (a
Qwen3-Next's gated delta nets at TP=2). Others are refused there: the CPU build cannot run a
Mamba-2 hybrid at TP>1 with prefix caching, so their shards are unproven."""


def is_state_spec(spec: Any) -> bool:
    return type(spec).__name__ == "MambaSpec"


def state_shape(spec: Any) -> StateShape:
    """The page of a MambaSpec group; raises where vLLM keeps no state per block boundary."""
    mode = str(getattr(spec, "mamba_cache_mode", "none"))
    if mode != "align":
        raise UnsupportedGroupError(
            f"state-space or linear-attention layers with mamba_cache_mode={mode}: vLLM keeps "
            "their state at block boundaries only in 'align' mode (prefix caching on), so "
            "kvtier has no state to store per chunk; start vLLM with --enable-prefix-caching "
            "and mamba_cache_mode 'align'"
        )
    if int(getattr(spec, "num_speculative_blocks", 0)):
        raise UnsupportedGroupError(
            "state-space layers with speculative decoding: vLLM moves their state blocks "
            "between steps, which kvtier has not proven it reads at the right boundary"
        )
    kind = getattr(spec, "mamba_type", "")
    return StateShape(
        kind=str(getattr(kind, "name", kind)),
        shapes=tuple(tuple(int(d) for d in shape) for shape in spec.shapes),
        dtypes=tuple(str(dtype).removeprefix("torch.") for dtype in spec.dtypes),
        sharded=not bool(getattr(spec, "tp_replicated", False)),
    )


def has_state_group(kv_cache_config: Any) -> bool:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return any(is_state_spec(group.kv_cache_spec) for group in groups)


def state_chunking(
    cfg: ConnectorConfig, kv_cache_config: Any, *, announce: bool
) -> ConnectorConfig:
    """``cfg`` with one block per chunk for an engine with state layers: a state is kept only at
    a block's end, and vLLM's blocks are a whole state stride already, so a larger chunk would
    only round hits further down. ``announce``: log it (once, from the scheduler side)."""
    if cfg.blocks_per_chunk == 1 or not has_state_group(kv_cache_config):
        return cfg
    if announce:
        log.warning(
            "kvtier: blocks_per_chunk=%d ignored for this engine: it has state-space or "
            "linear-attention layers, whose state exists only at a block's end; a chunk is "
            "one block (one state stride)",
            cfg.blocks_per_chunk,
        )
    return cfg.model_copy(update={"blocks_per_chunk": 1})


def state_pages(cache: Any) -> Any:
    """A state layer's cache as [blocks, state bytes]: vLLM hands it to a connector as bytes,
    [blocks, 1, 1, state bytes] at the padded page's stride; None for any other shape."""
    import torch

    if not isinstance(cache, torch.Tensor) or cache.dim() < 2 or not cache[0].is_contiguous():
        return None
    try:
        return cache.view(torch.uint8).flatten(1)
    except RuntimeError:
        return None
