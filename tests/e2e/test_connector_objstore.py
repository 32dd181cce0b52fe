"""A fresh engine on a node whose lmdb was wiped gets its hits from the object store (S3 on moto,
reached through IRSA), with identical outputs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, counter_value, generate_tokens, running_llm
from tests.e2e.test_connector import (
    EVERY_HIT,
    EXTERNAL_HITS,
    cached_by_source,
    kvtier_config,
    verified,
)
from tests.objstore.fixtures import AwsIrsa

pytestmark = pytest.mark.slow


def node_yaml(root: Path, shm_path: Path, url: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "kvtier.yaml"
    tree = {
        "arena": {
            "path": str(shm_path),
            "size_bytes": "64MiB",
            "extent_bytes": "2MiB",
            "min_slot_bytes": "4KiB",
        },
        "lmdb": {"path": str(root / "lmdb"), "budget_bytes": "256MiB"},
        "object": {
            "url": url,
            "index_path": str(root / "objindex"),
            "index_map_bytes": "64MiB",
            "lookup_budget_ms": 200,
        },
    }
    path.write_text(yaml.safe_dump(tree))
    return path


def test_a_fresh_node_gets_its_hits_from_the_object_store(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    s3_store: str,
    aws_irsa: AwsIrsa,
) -> None:
    first = node_yaml(tmp_path / "a", shm_path, s3_store)
    connector = kvtier_config({"kvtier_config": str(first)})
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
    assert tokens == baseline[: len(prompts)]
    # the engine's exit wrote the arena to lmdb and lmdb to the store; wipe the node's disk
    shutil.rmtree(tmp_path / "a" / "lmdb")

    # the same node, lmdb gone, the object index kept: hits are indexed object chunks
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert counter_value(llm, EXTERNAL_HITS) > 0
        assert cached_by_source(llm, "external_unspecified") > 0
    assert tokens == baseline[: len(prompts)]
    assert all(c >= 600 for c in cached), cached

    # another node, nothing local at all: its lookups probe the store for what node a uploaded
    other = node_yaml(tmp_path / "b", shm_path, s3_store)
    connector = kvtier_config({"kvtier_config": str(other)})
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert counter_value(llm, EXTERNAL_HITS) > 0
    assert tokens == baseline[: len(prompts)]
    assert all(c >= 600 for c in cached), cached


def test_hits_from_the_object_store_recomputed_match(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    s3_store: str,
    aws_irsa: AwsIrsa,
) -> None:
    config = str(node_yaml(tmp_path / "a", shm_path, s3_store))
    with running_llm(
        tiny_models.target, kv_transfer_config=kvtier_config({"kvtier_config": config})
    ) as llm:
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == baseline[: len(prompts)]
    shutil.rmtree(tmp_path / "a" / "lmdb")  # what the engine's exit uploaded is all there is
    verifying = kvtier_config({"kvtier_config": config, **EVERY_HIT})
    with running_llm(tiny_models.target, kv_transfer_config=verifying) as llm:
        tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        matched, mismatched = verified(llm)
        assert counter_value(llm, EXTERNAL_HITS) == 0
    assert tokens == baseline[: len(prompts)]
    assert mismatched == 0
    assert matched >= 20  # a 640-token shared prefix: 20 chunks fetched, promoted and compared
