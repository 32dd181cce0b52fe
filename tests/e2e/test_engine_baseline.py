"""The engine harness against vLLM's own ExampleConnector, which saves and loads on the CPU.

Greedy tokens must not depend on where the KV came from: computed, loaded from another engine's
files, or computed in a separate engine-core process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import set_engine_env
from tests.e2e.models import (
    BLOCK_SIZE,
    ModelSet,
    counter_value,
    generate_tokens,
    running_llm,
    shared_prefix_prompts,
    vocab_size_of,
)

MAX_TOKENS = 12
PREFIX_LEN = 640
NUM_PREFIXES = 2


def example_connector(storage: Path) -> dict[str, object]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def example_hit(prompt_len: int) -> int:
    """ExampleConnector serves whole blocks of the prompt, keeping its last token to compute."""
    return (prompt_len - 2) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def prompts(tiny_models: ModelSet) -> list[list[int]]:
    return shared_prefix_prompts(
        4,
        vocab_size=vocab_size_of(tiny_models.target),
        prefix_len=PREFIX_LEN,
        suffix_len=48,
        num_prefixes=NUM_PREFIXES,
    )


@pytest.fixture(scope="module")
def plain_tokens(
    tiny_models: ModelSet, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> list[list[int]]:
    """Reference completions from an in-process engine with no connector."""
    with pytest.MonkeyPatch.context() as mp:
        set_engine_env(mp, tmp_path_factory.mktemp("plain-engine"))
        with running_llm(tiny_models.target) as llm:
            tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            assert counter_value(llm, "vllm:external_prefix_cache_hits") == 0
    assert all(len(t) == MAX_TOKENS for t in tokens)
    # Prompts that share a prefix hit the local prefix cache, but never past the prefix.
    assert max(cached) <= PREFIX_LEN
    return tokens


def test_example_connector_loads_across_engines(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    plain_tokens: list[list[int]],
    tmp_path: Path,
) -> None:
    storage = tmp_path / "example-store"
    config = example_connector(storage)

    with running_llm(tiny_models.target, kv_transfer_config=config) as llm:
        saved_tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert counter_value(llm, "vllm:external_prefix_cache_hits") == 0
    # One folder per prompt, one file per attention layer.
    folders = sorted(storage.iterdir())
    assert len(folders) == len(prompts)
    assert all(len(list(f.glob("*.safetensors"))) == 2 for f in folders)

    with running_llm(tiny_models.target, kv_transfer_config=config) as llm:
        loaded_tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        external_hits = counter_value(llm, "vllm:external_prefix_cache_hits")

    assert cached == [example_hit(len(p)) for p in prompts]
    # The first prompt of each prefix pair loads all of its blocks from the files.
    assert external_hits >= NUM_PREFIXES * example_hit(len(prompts[0]))
    assert saved_tokens == plain_tokens
    assert loaded_tokens == plain_tokens


def test_multiprocess_engine_matches_in_process(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    plain_tokens: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    set_engine_env(monkeypatch, tmp_path, multiprocess=True)
    with running_llm(tiny_models.target, multiprocess=True) as llm:
        tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
    assert tokens == plain_tokens
