"""An engine capturing hidden states (vLLM's speculative method ``extract_hidden_states``, which
keeps them in a KV-cache layer of their own) is refused at start: kvtier does not store that
layer yet, and a hit would leave the hit prefix's states uncomputed, so whatever connector
captures them would read blocks vLLM never wrote. The engine serves its own outputs without
kvtier, and the reason is logged once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, counter_value, generate_tokens, running_llm
from tests.e2e.test_connector import (
    EXTERNAL_HITS,
    TRANSFER_BYTES,
    counter,
    embedded_yaml,
    kvtier_config,
)

pytestmark = pytest.mark.slow

CAPTURE = {
    "method": "extract_hidden_states",
    "num_speculative_tokens": 1,
    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}},
}


def test_an_engine_capturing_hidden_states_is_refused_and_serves_its_own_outputs(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with running_llm(tiny_models.target, speculative_config=CAPTURE) as llm:
        expected, _ = generate_tokens(llm, prompts[:2], max_tokens=MAX_TOKENS)
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    for _ in range(2):  # the second engine would hit what the first stored
        with running_llm(
            tiny_models.target, kv_transfer_config=connector, speculative_config=CAPTURE
        ) as llm:
            tokens, _ = generate_tokens(llm, prompts[:2], max_tokens=MAX_TOKENS)
            assert counter(llm, TRANSFER_BYTES, direction="store") == 0
            assert counter_value(llm, EXTERNAL_HITS) == 0
        assert tokens == expected
    refusals = [r.getMessage() for r in caplog.records if "kvtier is off" in r.getMessage()]
    assert len(refusals) == 2, refusals
    assert all("extract_hidden_states" in r for r in refusals)
