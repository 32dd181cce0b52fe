"""A gated-delta-net hybrid (Qwen3-Next) at TP=2 in the real vLLM engine (the CPU build): each
rank stores its own part of every boundary's state, a fresh TP=2 engine hits the KV and both
ranks' states, and a TP=1 engine, whose one rank holds the whole state, never reads them.

The fixture has two linear-attention key heads and four value heads, so TP=2 splits them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.models import (
    QWEN3_NEXT_ENGINE,
    ModelSet,
    build_qwen3_next_hybrid,
    shared_prefix_prompts,
    untimed_transfers,
    vocab_size_of,
)
from tests.e2e.test_connector import TRANSFER_BYTES, cached_by_source, counter, kvtier_config
from tests.e2e.test_connector_hybrid import Run, generate
from tests.e2e.test_connector_tp import engine as tp_engine
from tests.integration.daemon_harness import Processes, write_config

pytestmark = pytest.mark.slow

STRIDE = 1056
"""Tokens between kept states: the block size vLLM raises this model's to."""
STRIDES = 2
SUFFIX = 40


def engine(
    model: Path, tp: int, connector: dict[str, Any] | None = None
) -> AbstractContextManager[Any]:
    """A bf16 engine in align mode computing one stride per step, so every boundary's state
    is kept."""
    return tp_engine(
        model,
        tp,
        connector,
        dtype="bfloat16",
        enable_prefix_caching=True,
        max_num_batched_tokens=STRIDE,
        **QWEN3_NEXT_ENGINE,
    )


def state_bytes(llm: Any, direction: str) -> float:
    return counter(llm, TRANSFER_BYTES, direction=direction, pool="state")


def test_tp2_states_hit_in_a_fresh_tp2_engine_and_never_in_a_tp1_engine(
    models_dir: Path, tiny_models: ModelSet, procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    model = build_qwen3_next_hybrid(
        models_dir, linear_key_heads=2, linear_value_heads=4, tokenizer_dir=tiny_models.tokenizer
    )
    prompts = shared_prefix_prompts(
        2,
        vocab_size=vocab_size_of(model),
        prefix_len=STRIDES * STRIDE,
        suffix_len=SUFFIX,
        num_prefixes=2,
        seed=11,
    )
    hit_tokens = STRIDES * STRIDE
    with engine(model, 2) as llm:
        assert llm.llm_engine.vllm_config.cache_config.block_size == STRIDE
        cold = generate(llm, prompts)
        alone: Run = generate(llm, prompts)  # on vLLM's own prefix cache
    assert alone.cached == [hit_tokens] * len(prompts)
    files = write_config(
        tmp_path, shm_path, {"arena": {"size_bytes": 64 << 20, "min_slot_bytes": 16 << 10}}
    )
    sidecar = kvtier_config({"mode": "sidecar", "socket_path": str(files.socket)})
    procs.start_daemon(files)
    with engine(model, 2, sidecar) as llm:
        first = generate(llm, prompts)
        stored = state_bytes(llm, "store")
    assert first.same_output(cold)
    assert stored > 0
    with engine(model, 2, sidecar) as llm:
        run = generate(llm, prompts)
        loaded = state_bytes(llm, "load")
        from_arena = cached_by_source(llm, "host")
        untimed = untimed_transfers(llm)
    assert run.cached == [hit_tokens] * len(prompts)
    assert from_arena == hit_tokens * len(prompts)
    assert loaded > 0
    assert not untimed  # each rank's state and KV loads timed with their bytes
    assert run.same_output(alone)
    # the attention KV is there for any degree, but no state a TP=1 rank can read: a miss
    with engine(model, 1, sidecar) as llm:
        tp1 = generate(llm, prompts)
        tp1_loaded = state_bytes(llm, "load")
        tp1_stored = state_bytes(llm, "store")
    assert tp1.cached == [0] * len(prompts)
    assert tp1_loaded == 0
    assert tp1_stored > 0  # kvtier served this engine: it stored states of its own
