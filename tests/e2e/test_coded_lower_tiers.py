"""Coded tiers below the arena in a real engine (the CPU build): one engine stores its prompts'
KV into lmdb coded (int8, fp8); a fresh engine, whose arena starts empty, finds them in lmdb
and, with every hit sampled, compares each decoded chunk with what vLLM computes in its place.
Every chunk is off (it came through the codec), none by more than verify_max_error plus the
codec's bound, and no namespace is quarantined for the codec's own rounding."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.kvcodec import Codec, error_bound
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, counter_value, generate_tokens, running_llm
from tests.e2e.test_connector import (
    EVERY_HIT,
    EXTERNAL_HITS,
    embedded_yaml,
    kvtier_config,
    verified,
)
from tests.fixtures.engines import scheduler_of

VERIFY_MAX_ERROR = 0.05  # the connector's default


@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8])
def test_decoded_hits_are_verified_against_the_codecs_bound_and_never_quarantined(
    codec: Codec,
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
) -> None:
    expected = baseline[: len(prompts)]
    config = str(embedded_yaml(tmp_path, shm_path, lmdb={"codec": codec.value}))
    with running_llm(
        tiny_models.target, kv_transfer_config=kvtier_config({"kvtier_config": config})
    ) as llm:
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
        assert counter_value(llm, EXTERNAL_HITS) == 0
    verifying = kvtier_config({"kvtier_config": config, **EVERY_HIT})
    with running_llm(tiny_models.target, kv_transfer_config=verifying) as llm:
        tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        matched, mismatched = verified(llm)
        verifier = scheduler_of(llm).verifier
        bound = verifier.coded["target"]
        head = verifier.by_key["target"].spec.layout.head_sizes[0]
        assert set(verifier.coded) == {"target"}
        assert verifier.quarantined == {}
        errors = sorted(e for _, e in verifier.errors)
    assert tokens == expected  # every hit was computed instead
    assert matched >= 20  # the 640-token shared prefixes: 20 chunks held in lmdb
    assert mismatched == 0
    # every chunk came through the codec: off, and within what it may be off by
    assert errors[0] > 1e-3, errors[:3]
    assert bound == error_bound(codec, head)
    assert errors[-1] <= VERIFY_MAX_ERROR + bound
    median = errors[len(errors) // 2]
    print(
        f"fp8 chunks' relative errors: min {errors[0]:.3g} median {median:.3g} max {errors[-1]:.3g}"
    )
