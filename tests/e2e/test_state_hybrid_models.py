"""What serving a state-space hybrid relies on in vLLM itself, one engine per model and no
connector: prefix caching in ``align`` mode, the block size vLLM chose for it (one for every
group, an attention page holding at least a state), a repeated prompt hitting vLLM's own prefix
cache at its last block boundary with the same greedy tokens, and each state layer's dtypes and
shapes in the engine's KV-cache config.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.models import (
    build_tokenizer,
    counter_value,
    generate_tokens,
    running_llm,
    shared_prefix_prompts,
    vocab_size_of,
)
from tests.fixtures.state_models import (
    QWEN3_NEXT_ENGINE,
    build_mamba2_hybrid,
    build_qwen3_next_hybrid,
    kv_cache_config_of,
    mamba2_align_on_cpu,
    state_bytes,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


@dataclass(frozen=True)
class StateModel:
    build: Callable[[Path, Path], Path]
    dtype: str
    state_layers: tuple[str, ...]
    state_shapes: tuple[tuple[int, ...], ...]
    """Per state layer: the convolution's last inputs, then the recurrent state."""
    state_dtypes: tuple[str, ...]
    engine_patch: Callable[[], AbstractContextManager[None]] = nullcontext
    engine_args: dict[str, Any] = field(default_factory=dict)


MODELS = {
    # "M*-M*-": Mamba-2 mixers at layers 0 and 3. Conv over x, B and C (256 + 2 * 32 wide,
    # kernel 4); state per head (8) head_dim (32) x state (32), fp32
    # like the model.
    "mamba2": StateModel(
        build=lambda root, tok: build_mamba2_hybrid(root, tokenizer_dir=tok),
        dtype="float32",
        state_layers=("model.layers.0.mixer", "model.layers.3.mixer"),
        state_shapes=((3, 320), (8, 32, 32)),
        state_dtypes=("torch.float32", "torch.float32"),
        engine_patch=mamba2_align_on_cpu,
    ),
    # "LFLF": gated delta nets at layers 0 and 2. Conv over q, k (1 head x 128) and v (2 x 128);
    # state per value head (2), key dim x value dim (128 x 128), fp32 beside the bf16 conv.
    "qwen3_next": StateModel(
        build=lambda root, tok: build_qwen3_next_hybrid(root, tokenizer_dir=tok),
        dtype="bfloat16",
        state_layers=("model.layers.0.linear_attn", "model.layers.2.linear_attn"),
        state_shapes=((3, 512), (2, 128, 128)),
        state_dtypes=("torch.bfloat16", "torch.float32"),
        engine_args=QWEN3_NEXT_ENGINE,
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_repeated_prompt_hits_at_its_last_block_boundary_with_the_states_kept(
    name: str, models_dir: Path
) -> None:
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    case = MODELS[name]
    model = case.build(models_dir, build_tokenizer(models_dir))
    with (
        case.engine_patch(),
        running_llm(
            model,
            dtype=case.dtype,
            block_size=None,
            enable_prefix_caching=True,
            **case.engine_args,
        ) as llm,
    ):
        cache = llm.llm_engine.vllm_config.cache_config
        assert cache.mamba_cache_mode == "align"
        block = cache.block_size
        groups = kv_cache_config_of(llm).kv_cache_groups
        states = {n: g.kv_cache_spec for g in groups for n in g.layer_names}
        states = {n: s for n, s in states.items() if isinstance(s, MambaSpec)}
        attention = [g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, AttentionSpec)]
        assert sorted(states) == sorted(case.state_layers)
        assert attention, "a hybrid keeps attention KV beside its states"
        for layer, spec in states.items():
            assert spec.block_size == block, layer
            assert spec.shapes == case.state_shapes, layer
            assert tuple(map(str, spec.dtypes)) == case.state_dtypes, layer
            assert not spec.tp_replicated, f"{layer}: a state sharded across TP ranks"
            # vLLM raises the attention block size until an attention page holds a state
            assert all(a.page_size_bytes >= state_bytes(spec) for a in attention), layer
        assert all(a.block_size == block for a in attention)

        # two and a half blocks: the hit is the two whole blocks before the last token
        (prompt,) = shared_prefix_prompts(
            1, vocab_size=vocab_size_of(model), prefix_len=2 * block + block // 2, suffix_len=0
        )
        first, cached_first = generate_tokens(llm, [prompt], max_tokens=MAX_TOKENS)
        hits_before = counter_value(llm, "vllm:prefix_cache_hits")
        again, cached_again = generate_tokens(llm, [prompt], max_tokens=MAX_TOKENS)
        hits = counter_value(llm, "vllm:prefix_cache_hits") - hits_before

    boundary = (len(prompt) - 1) // block * block
    assert cached_first == [0]
    assert cached_again == [boundary]
    assert hits == boundary
    assert again == first
