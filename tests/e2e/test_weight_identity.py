"""Chunks are named after the weights that computed them, not the model's name or path.

A checkpoint rewritten in place with other weights (same directory, same config) is a new
revision: an engine serving it finds none of the chunks the old weights stored, in lmdb or
anywhere else, and its outputs are its own; the same checkpoint served again hits. vLLM names a
LoRA adapter's KV by the adapter's name and path only, so requests with an adapter are never
cached, while requests without one still are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import MAX_TOKENS, deploy
from tests.e2e.models import (
    ModelSet,
    counter,
    counter_value,
    generate_tokens,
    greedy,
    running_llm,
)
from tests.e2e.test_connector import EXTERNAL_HITS, TRANSFER_BYTES, embedded_yaml, kvtier_config

pytestmark = pytest.mark.slow


def run(
    served: Path, prompts: list[list[int]], connector: Any
) -> tuple[list[list[int]], list[int], int]:
    with running_llm(served, kv_transfer_config=connector) as llm:
        tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        return tokens, cached, counter_value(llm, EXTERNAL_HITS)


def test_new_weights_under_the_same_path_never_load_the_old_weights_chunks(
    two_builds: tuple[Path, Path],
    prompts: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
) -> None:
    old, new = two_builds
    with running_llm(new) as llm:  # the new weights' own outputs, without kvtier
        new_baseline, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
    served = tmp_path / "served-model"
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})

    deploy(old, served)
    old_tokens, _, _ = run(served, prompts, connector)  # stores the old weights' chunks
    assert old_tokens != new_baseline  # the weights differ where it shows

    deploy(new, served)  # same path, same config, other weights
    tokens, cached, hits = run(served, prompts, connector)
    assert hits == 0
    assert cached == [0] * len(prompts)
    assert tokens == new_baseline

    # the same checkpoint again: its own chunks, stored by the engine before, hit
    tokens, cached, hits = run(served, prompts, connector)
    assert hits > 0
    assert all(c >= 600 for c in cached), cached
    assert tokens == new_baseline


def test_weights_kvtier_cannot_read_are_cached_only_under_an_explicit_model_revision(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = str(embedded_yaml(tmp_path, shm_path))
    dummy = {"load_format": "dummy"}  # random weights: the files say nothing about them
    with running_llm(
        tiny_models.target, kv_transfer_config=kvtier_config({"kvtier_config": config}), **dummy
    ) as llm:
        generate_tokens(llm, prompts[:2], max_tokens=MAX_TOKENS)
        assert counter(llm, TRANSFER_BYTES, direction="store") == 0
    refusals = [r.getMessage() for r in caplog.records if "kvtier is off" in r.getMessage()]
    assert len(refusals) == 1, refusals
    assert "load_format=dummy" in refusals[0]
    assert "model_revision" in refusals[0]

    named = kvtier_config({"kvtier_config": config, "model_revision": "profiling-1"})
    with running_llm(tiny_models.target, kv_transfer_config=named, **dummy) as llm:
        generate_tokens(llm, prompts[:2], max_tokens=MAX_TOKENS)
        assert counter(llm, TRANSFER_BYTES, direction="store") > 0


def write_adapter(path: Path, base: Path, seed: int) -> Path:
    """A rank-8 LoRA adapter on q_proj and v_proj, with random weights, in PEFT's format."""
    import numpy as np
    from safetensors.numpy import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, rank = config["hidden_size"], 8
    outputs = {"q_proj": hidden, "v_proj": config["num_key_value_heads"] * config["head_dim"]}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.standard_normal((rank, hidden), np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.standard_normal((out, rank), np.float32)
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 16,
        "target_modules": sorted(outputs),
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return path


def test_lora_requests_are_never_cached_and_requests_without_one_still_are(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
) -> None:
    from vllm.lora.request import LoRARequest

    model = tiny_models.target
    lora = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    adapter = write_adapter(tmp_path / "adapter", model, seed=0)
    request = LoRARequest("sql", 1, str(adapter))
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})

    def generate(llm: Any, adapter: LoRARequest | None) -> tuple[list[list[int]], list[int]]:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            greedy(MAX_TOKENS),
            use_tqdm=False,
            lora_request=adapter,
        )
        return (
            [list(out.outputs[0].token_ids) for out in outputs],
            [out.num_cached_tokens or 0 for out in outputs],
        )

    with running_llm(model, kv_transfer_config=connector, **lora) as llm:
        assert generate(llm, None)[0] == baseline[: len(prompts)]
        old_tokens, _ = generate(llm, request)

    write_adapter(adapter, model, seed=1)  # other adapter weights, same name and path
    with running_llm(model, **lora) as llm:
        new_baseline, _ = generate(llm, request)
    assert new_baseline != old_tokens

    with running_llm(model, kv_transfer_config=connector, **lora) as llm:
        tokens, cached = generate(llm, request)
        assert counter_value(llm, EXTERNAL_HITS) == 0
        assert cached == [0] * len(prompts)
        assert tokens == new_baseline
        tokens, cached = generate(llm, None)  # the base model's chunks, from the first engine
        assert counter_value(llm, EXTERNAL_HITS) > 0
        assert all(c >= 600 for c in cached), cached
        assert tokens == baseline[: len(prompts)]
