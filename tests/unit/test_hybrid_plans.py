"""KV-cache groups as vLLM describes them (its own spec classes, no engine): which groups kvtier
plans, where a sliding window's needed chunks start, and what it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kvtier_vllm.layout.plans import KVGroup, PoolPlan, kv_groups, misplaced_draft, plan_pools
from kvtier_vllm.shared.settings import ConnectorConfig
from kvtier_vllm.shared.shapes import UnsupportedGroupError
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvtier.core.keys import Pool
from tests.support import target_spec

BLOCK = 32
WINDOW = 200


def attention(kind: type, **extra: int) -> object:
    return kind(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, **extra)


def config(*groups: tuple[tuple[str, ...], object], hashed: int | None = None) -> KVCacheConfig:
    specs = [KVCacheGroupSpec(list(names), spec) for names, spec in groups]
    return KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=specs, hash_block_size=hashed
    )


def layers(*indices: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.self_attn.attn" for i in indices)


def test_a_gemma_like_model_gives_a_window_group_and_a_full_group() -> None:
    sliding = attention(SlidingWindowSpec, sliding_window=WINDOW, extra_retained_tokens=3)
    groups = kv_groups(
        config((layers(0, 2), sliding), (layers(1, 3), attention(FullAttentionSpec)))
    )
    assert [(g.index, g.layer_names, g.window, g.sliding_window) for g in groups] == [
        (0, layers(0, 2), WINDOW - 1 + 3, WINDOW),  # what vLLM keeps: the window, plus retained
        (1, layers(1, 3), 0, 0),
    ]


def test_without_a_config_every_layer_is_one_full_group() -> None:
    assert kv_groups(None, layers(0, 1)) == kv_groups(
        config((layers(0, 1), attention(FullAttentionSpec)))
    )


@pytest.mark.parametrize("hit_tokens", [96, WINDOW, 640, 4000])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 4])
def test_the_window_starts_at_the_chunk_holding_the_first_block_vllm_keeps(
    hit_tokens: int, blocks_per_chunk: int
) -> None:
    chunk_tokens = BLOCK * blocks_per_chunk
    chunks = hit_tokens // chunk_tokens
    tokens = chunks * chunk_tokens
    plan = PoolPlan(
        Pool.TARGET, layers(0), 4096, target_spec(), blocks_per_chunk, window=WINDOW - 1
    )
    first = plan.first_needed(chunks, chunk_tokens)
    # vLLM's sliding-window manager skips max(0, T - window + 1) tokens' whole blocks
    kept = max(0, tokens - WINDOW + 1) // BLOCK
    assert first == kept // blocks_per_chunk
    assert first * blocks_per_chunk <= kept  # every block vLLM keeps is loaded
    assert (first + 1) * blocks_per_chunk > kept  # and no chunk wholly before them
    assert PoolPlan(Pool.TARGET, layers(0), 4096, target_spec(), 1).first_needed(chunks, 32) == 0


def test_state_groups_without_align_mode_and_mixed_block_sizes_are_refused() -> None:
    mamba = MambaSpec(block_size=BLOCK, shapes=((4,),), dtypes=(torch.float32,))
    # vLLM keeps no state per block boundary but in align mode: nothing to store per chunk
    with pytest.raises(UnsupportedGroupError, match="mamba_cache_mode=none"):
        kv_groups(config((layers(0), mamba), (layers(1), attention(FullAttentionSpec))))
    bigger = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.float32)
    with pytest.raises(UnsupportedGroupError, match="block sizes"):
        kv_groups(config((layers(0), attention(FullAttentionSpec)), (layers(1), bigger)))
    with pytest.raises(UnsupportedGroupError, match="hashed every 16"):
        kv_groups(config((layers(0), attention(FullAttentionSpec)), hashed=16))


def test_an_align_mode_state_group_reads_the_state_at_the_hit_end_and_keeps_every_one() -> None:
    shapes, dtypes = ((3, 512), (2, 128, 128)), (torch.bfloat16, torch.float32)
    mamba = MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align")
    state, full = kv_groups(config((layers(0), mamba), (layers(1), attention(FullAttentionSpec))))
    assert full.state is None
    assert full.window == 0
    assert state.state is not None
    # a page is each state's part of a block, unpadded: bf16 conv state, fp32 recurrent state
    assert state.state.page_bytes == 3 * 512 * 2 + 2 * 128 * 128 * 4
    assert state.state.sharded  # vLLM's default: each TP rank holds its heads' state
    plan = PoolPlan(Pool.STATE, layers(0), state.state.page_bytes, target_spec(), 1, window=1)
    for chunks in (1, 2, 7):
        assert plan.first_needed(chunks, BLOCK) == chunks - 1  # the state at the hit's end
    assert all(plan.keeps(c, 7, 0, BLOCK) for c in range(7))  # a hit may end at any of them


def tp_engine(rank: int, tp: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(model="m"),
        cache_config=SimpleNamespace(
            block_size=BLOCK, kv_cache_layout=None, prefix_caching_hash_algo="sha256"
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, rank=rank, pipeline_parallel_size=1
        ),
    )


def state_group(replicated: bool, kind: str = "GDN_ATTN") -> list[KVGroup]:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=((4,),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        tp_replicated=replicated,
        mamba_type=MambaAttentionBackendEnum[kind],
    )
    return kv_groups(config((layers(0), mamba), (layers(1), attention(FullAttentionSpec))))[:1]


def test_a_replicated_state_above_tp1_is_refused_with_the_degree() -> None:
    with pytest.raises(UnsupportedGroupError, match="tensor_parallel_size=2 \\(a copy"):
        plan_pools(tp_engine(0), state_group(True), ConnectorConfig(), named=False)


def test_a_state_kind_whose_shards_are_unproven_is_refused_above_tp1() -> None:
    with pytest.raises(
        UnsupportedGroupError, match="MAMBA2 state layers at tensor_parallel_size=2"
    ):
        plan_pools(tp_engine(0), state_group(False, "MAMBA2"), ConnectorConfig(), named=False)
    (plan,) = plan_pools(
        tp_engine(0, tp=1), state_group(False, "MAMBA2"), ConnectorConfig(), named=False
    )
    assert plan.spec.tp_size == 1


def test_a_sharded_state_at_tp2_is_each_ranks_part_of_a_per_degree_chunk() -> None:
    (first,) = plan_pools(tp_engine(0), state_group(False), ConnectorConfig(), named=False)
    (second,) = plan_pools(tp_engine(1), state_group(False), ConnectorConfig(), named=False)
    # both ranks write their 16 bytes of a 32-byte page; the chunk is committed once both have
    assert (first.shard.first, second.shard.first) == (0, 1)
    assert first.shard.writes
    assert second.shard.writes
    assert first.shard.writers == 2
    assert first.page_bytes == 16
    assert first.chunk_page_bytes == 32
    # the degree is in the namespace: a TP=1 engine's state chunks are others
    assert first.spec.tp_size == 2
    assert first.spec == second.spec


def test_a_draft_model_outside_group_zero_is_refused_with_what_to_do() -> None:
    sliding = attention(SlidingWindowSpec, sliding_window=WINDOW)
    draft_layers = ("draft_model.model.layers.0.self_attn.attn",)
    misplaced = kv_groups(
        config((layers(0, 2), sliding), (layers(1, 3) + draft_layers, attention(FullAttentionSpec)))
    )
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(method="draft_model"))
    reason = misplaced_draft(vllm_config, misplaced)
    assert "group 1" in reason
    assert "--disable-hybrid-kv-cache-manager" in reason
    assert "EAGLE" in reason
    # EAGLE heads are placed by vLLM itself; a draft in group 0 gets its own block table
    assert (
        misplaced_draft(
            SimpleNamespace(speculative_config=SimpleNamespace(method="eagle")), misplaced
        )
        == ""
    )
    in_group_zero = kv_groups(config((layers(0, 1) + draft_layers, attention(FullAttentionSpec))))
    assert misplaced_draft(vllm_config, in_group_zero) == ""
    assert misplaced_draft(SimpleNamespace(speculative_config=None), misplaced) == ""


def test_a_sliding_window_is_kept_before_the_prompt_end_and_each_checkpoint() -> None:
    plan = PoolPlan(Pool.TARGET, layers(0), 4096, target_spec(), 1, window=WINDOW - 1)
    full = PoolPlan(Pool.TARGET, layers(1), 4096, target_spec(), 1)
    end = (940 - 1) // BLOCK  # a 940-token prompt hits 29 chunks

    def kept(every: int) -> list[int]:
        return [c for c in range(end + 3) if plan.keeps(c, end, every, BLOCK)]

    window = list(range(window_start(end), end + 3))  # and the chunks past the prompt
    assert kept(0) == window
    # every 16 chunks (512 tokens): also the window before chunk 16
    assert kept(16) == list(range(window_start(16), 16)) + window
    assert all(full.keeps(c, end, 16, BLOCK) for c in range(end + 3))


def window_start(chunks: int) -> int:
    """vLLM's first kept block after ``chunks`` one-block chunks: T - window + 1 on."""
    return max(0, chunks * BLOCK - WINDOW + 1) // BLOCK
