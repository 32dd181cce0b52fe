"""The namespaces the tier and daemon benchmarks store chunks under: a one-layer spec for small
chunks, and a 16-layer one whose blocks are 1 MiB for chunks of a MiB or more."""

from __future__ import annotations

from benchmarks.harness.sizes import KiB, MiB
from kvtier.core.keys import NamespaceSpec, PageLayout, Pool


def _spec(model: str, layout: PageLayout) -> NamespaceSpec:
    return NamespaceSpec(
        model=model, model_revision="r1", pool=Pool.TARGET, kv_dtype="float16", layout=layout
    )


def small_spec(model: str, chunk_bytes: int) -> NamespaceSpec:
    # one layer of 16 tokens x (64 + 64) x fp16 is 4 KiB per head
    layout = PageLayout(
        tokens_per_block=16,
        blocks_per_chunk=1,
        num_kv_heads=max(1, chunk_bytes // (4 * KiB)),
        head_sizes=(64, 64),
        layer_names=("model.layers.0.self_attn.attn",),
    )
    return _spec(model, layout)


def sixteen_layer_spec(model: str, chunk_bytes: int) -> NamespaceSpec:
    """Chunks of ``chunk_bytes`` rounded down to whole MiB blocks, at least one."""
    # 16 layers x 16 tokens x 8 heads x (128 + 128) x fp16 is 1 MiB per block
    layout = PageLayout(
        tokens_per_block=16,
        blocks_per_chunk=max(1, chunk_bytes // MiB),
        num_kv_heads=8,
        head_sizes=(128, 128),
        layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(16)),
    )
    return _spec(model, layout)


def spec_for_chunk(model: str, chunk_bytes: int) -> NamespaceSpec:
    """The 16-layer spec for chunks of a MiB or more, the one-layer spec below."""
    if chunk_bytes >= MiB:
        return sixteen_layer_spec(model, chunk_bytes)
    return small_spec(model, chunk_bytes)
