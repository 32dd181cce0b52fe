"""The draft loop on real engines: serve with kvtier capturing hidden states, train an EAGLE-3
drafter with Speculators from them through kvtier's own backend (read from kvtier's tiers, no
file in between), write its weights where a serving engine's draft model points, swap them in,
and read acceptance per draft revision from kvtier's metrics.

The target has random weights, so the trained drafter need not be accepted more; what holds is
that training lowered its loss, that kvtier saw the swap as a new revision and counted
acceptance for both, and that speculative decoding kept the target's greedy outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.hidden.reader import REF_FIELD
from tests.e2e.models import (
    ModelSet,
    capture_config,
    counter,
    generate_tokens,
    running_llm,
    shared_prefix_prompts,
    vocab_size_of,
)
from tests.e2e.test_connector import embedded_yaml, kvtier_config
from tests.e2e.test_draft_swap import SWAPS, connector_acceptance, revision_info
from tests.fixtures.draft_weights import checkpoint_weights, swap_draft_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

OUTPUT_TOKENS = 12
STEPS = 8


def test_states_kvtier_captured_train_a_drafter_that_a_serving_engine_swaps_in(
    tiny_models: ModelSet, tmp_path: Path, shm_path: Path
) -> None:
    pytest.importorskip("speculators", reason="Speculators 0.9 is not installed")
    pytest.importorskip("hs_connectors", reason="hs-connectors is not installed")
    from kvtier_speculators import KVTierHiddenStates
    from tests.fixtures.draft_training import (
        CAPTURED_LAYERS,
        SPECULATIVE_TOKENS,
        Trainer,
        build_drafter,
        build_target,
        read_transfer,
    )

    target = build_target(tiny_models.target.parent, tiny_models.tokenizer)
    prompts = shared_prefix_prompts(
        4, vocab_size=vocab_size_of(target), prefix_len=64, suffix_len=40, seed=21
    )
    config = embedded_yaml(tmp_path, shm_path)
    connector = kvtier_config({"kvtier_config": str(config)})

    # 1. serve with capture: the target's greedy tokens, and a reference per request
    with running_llm(
        target, kv_transfer_config=connector, speculative_config=capture_config(CAPTURED_LAYERS)
    ) as llm:
        outputs = generate(llm, prompts)
    expected = [list(o.outputs[0].token_ids) for o in outputs]
    refs = [o.kv_transfer_params[REF_FIELD] for o in outputs]

    # 2. train a fresh drafter on the states read from kvtier's tiers, each found by its tokens
    drafter = build_drafter(target, tmp_path / "drafter")
    trainer = Trainer(drafter)
    transfer = KVTierHiddenStates(
        config, refs[0]["namespace"], token_ids=prompts.__getitem__, through_daemon=False
    )
    try:
        trained = trainer.train(read_transfer(transfer), len(prompts), STEPS)
    finally:
        transfer.close()
    assert trained.loss_after < trained.loss_before, trained
    written = [p for p in tmp_path.rglob("*.safetensors") if drafter not in p.parents]
    assert written == [], written  # no training file between capture and training

    # 3. serve with the fresh drafter, then swap in the trained one where it points
    spec = {
        "method": "eagle3",
        "model": str(drafter),
        "num_speculative_tokens": SPECULATIVE_TOKENS,
    }
    with running_llm(target, kv_transfer_config=connector, speculative_config=spec) as llm:
        before = generate_tokens(llm, prompts, max_tokens=OUTPUT_TOKENS)[0]
        (fresh,) = list(revision_info(llm))
        trainer.save(drafter)
        assert llm.reset_prefix_cache(reset_connector=True)
        swap_draft_weights(llm, checkpoint_weights(drafter))
        after, cached = generate_tokens(llm, prompts, max_tokens=OUTPUT_TOKENS)
        revisions = revision_info(llm)

        assert before == expected
        assert after == expected
        assert min(cached) >= 64, cached  # the target's chunks outlived the swap
        assert counter(llm, SWAPS, source="fingerprint") == 1
        (current,) = [r for r, v in revisions.items() if v == 1]
        assert current != fresh
        assert revisions[fresh] == 0
        for revision in (fresh, current):
            drafted, accepted = connector_acceptance(llm, revision)
            print(f"{revision}: {accepted:.0f} of {drafted:.0f} drafted tokens accepted")
            assert drafted > 0, revision


def generate(llm: Any, prompts: list[list[int]]) -> list[Any]:
    """Greedy outputs, each with its prompt's states in ``kv_transfer_params``."""
    from vllm import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
