"""The size of a chunk's payload, from the page layout its namespace names.

A chunk is its pool's pages, layer after layer, block after block: per block and layer,
``tokens_per_block x num_kv_heads`` rows of each head size, one element each. kvtierd checks a
registration's ``chunk_bytes`` against this, so no client can claim a namespace with a size its
layout does not have (and so lock out the engines that register it rightly).
"""

from __future__ import annotations

from kvtier.core.keys import NamespaceSpec

ELEMENT_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "json": 1,  # the hidden pool's manifests: text, a byte a character
    # vLLM's quantised caches, held in one-byte elements (its own page sizes count them so)
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "fp8_per_token_head": 1,
    "int8_per_token_head": 1,
    "int4_per_token_head": 1,
    "nvfp4": 1,
    "nvfp4_4over6": 1,
    "nvfp4_ds_mla": 1,
}
"""Bytes of one element, by ``kv_dtype`` (a ``torch.`` prefix is dropped)."""
ROW_SCALED = "e4m3:"
"""``e4m3:<dtype>``: values stored a byte each, then a float32 scale per row (the hidden pool's
fp8 storage)."""
_SCALE_BYTES = 4


def chunk_payload_bytes(spec: NamespaceSpec) -> int:
    """The bytes of one chunk of ``spec``'s namespace; ValueError for a dtype of unknown width."""
    layout = spec.layout
    rows = layout.tokens_per_block * layout.blocks_per_chunk * layout.num_kv_heads
    rows *= len(layout.layer_names)
    if spec.kv_dtype.startswith(ROW_SCALED):
        return rows * sum(size + _SCALE_BYTES for size in layout.head_sizes)
    width = ELEMENT_BYTES.get(spec.kv_dtype.removeprefix("torch."))
    if width is None:
        raise ValueError(
            f"kv_dtype {spec.kv_dtype!r} has no known element size, so its chunk size cannot "
            f"be checked; kvtierd knows {', '.join(sorted(ELEMENT_BYTES))} and {ROW_SCALED}<any>"
        )
    return rows * sum(layout.head_sizes) * width
