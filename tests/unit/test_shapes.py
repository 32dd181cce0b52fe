"""Parallel shapes: which heads each TP rank holds in a chunk, what is refused at start, and
copies of each rank's part through the worker's own views (CPU tensors, no engine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvtier_vllm.kv.metadata import ChunkCopy
from kvtier_vllm.kv.worker_side.worker import KVTierWorker
from kvtier_vllm.shared.settings import ConnectorConfig
from kvtier_vllm.shared.shapes import (
    HEADS_FIRST,
    TOKENS_FIRST,
    Shard,
    page_order,
    refusal,
    tp_shard,
)

from kvtier.tiers.arena import ArenaMemory

BLOCK, HEAD, LAYERS, BLOCKS = 32, 32, 2, 6


def test_ranks_split_heads_in_order_and_every_rank_writes() -> None:
    shards = [tp_shard(8, 4, r) for r in range(4)]
    assert [(s.first, s.count) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert all(s.writes and s.writers == 4 and s.heads == 8 and s.tp_size == 1 for s in shards)


def test_replicated_heads_are_written_by_the_first_replica_only() -> None:
    # vLLM: rank r holds KV head r // (tp // heads)
    shards = [tp_shard(2, 4, r) for r in range(4)]
    assert [s.first for s in shards] == [0, 0, 1, 1]
    assert [s.writes for s in shards] == [True, False, True, False]
    assert {s.writers for s in shards} == {2}
    assert {s.tp_size for s in shards} == {1}  # still read by any TP degree


def test_mla_is_stored_once() -> None:
    shards = [tp_shard(16, 4, r, mla=True) for r in range(4)]
    assert {(s.heads, s.first, s.count, s.writers) for s in shards} == {(1, 0, 1, 1)}
    assert [s.writes for s in shards] == [True, False, False, False]


def test_a_split_vllm_never_makes_keeps_its_chunks_to_its_own_degree() -> None:
    shard = tp_shard(6, 4, 3)
    assert (shard.tp_size, shard.heads, shard.first) == (4, 4, 3)


def test_a_shard_outside_its_chunk_is_an_error() -> None:
    with pytest.raises(ValueError, match="outside a chunk"):
        Shard(heads=2, first=2, count=1)


def test_page_orders_of_vllm_layouts() -> None:
    assert page_order("LBHNC") == page_order("BLHNC") == HEADS_FIRST
    assert page_order("LBNHC") == page_order("BLNHC") == TOKENS_FIRST
    assert page_order("LHBNC") == page_order("BHLNC") == ""


def _vllm_config(
    tp: int = 1, rank: int = 0, kv_heads: int = 4, layout: str = "LBHNC", **parallel: int
) -> Any:
    model = SimpleNamespace(
        model="m",
        revision=None,
        dtype=torch.float32,
        use_mla=False,
        get_total_num_kv_heads=lambda: kv_heads,
        get_num_kv_heads=lambda p: max(1, kv_heads // p.tensor_parallel_size),
        get_head_size=lambda: HEAD,
        get_num_layers=lambda p: LAYERS,
    )
    par = SimpleNamespace(
        tensor_parallel_size=tp,
        rank=rank,
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
        data_parallel_index=0,
    )
    for name, value in parallel.items():
        setattr(par, name, value)
    cache = SimpleNamespace(
        block_size=BLOCK,
        cache_dtype="auto",
        prefix_caching_hash_algo="sha256",
        kv_cache_layout=layout,
    )
    return SimpleNamespace(
        model_config=model, parallel_config=par, cache_config=cache, speculative_config=None
    )


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
        ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2"),
        ({"prefill_context_parallel_size": 2}, "prefill_context_parallel_size=2"),
    ],
)
def test_unproven_shapes_are_refused_naming_the_setting(
    setting: dict[str, int], named: str
) -> None:
    assert named in refusal(_vllm_config(**setting))
    assert refusal(_vllm_config()) == ""


def test_a_layout_whose_pages_are_scattered_is_refused() -> None:
    config = _vllm_config()
    config.cache_config.kv_cache_layout = "LHBNC"
    assert "LHBNC" in refusal(config)


def _kv(heads: int, tokens_first: bool, seed: int = 0) -> torch.Tensor:
    """A layer's cache [blocks, heads, tokens, K‖V] as vLLM hands it, stored in either order."""
    gen = torch.Generator().manual_seed(seed)
    if tokens_first:
        physical = torch.rand((BLOCKS, BLOCK, heads, 2 * HEAD), generator=gen)
        return physical.permute(0, 2, 1, 3)
    return torch.rand((BLOCKS, heads, BLOCK, 2 * HEAD), generator=gen)


def _heads(layer: torch.Tensor, first: int, count: int, tokens_first: bool) -> torch.Tensor:
    """One rank's heads of a layer, held in their own buffer as that rank's backend would."""
    if tokens_first:
        return layer.permute(0, 2, 1, 3)[:, :, first : first + count].clone().permute(0, 2, 1, 3)
    return layer[:, first : first + count].clone()


@pytest.fixture
def arena(shm_path: Path) -> Iterator[ArenaMemory]:
    """A real arena: a worker copies only for a slot whose generation its mapping confirms."""
    memory = ArenaMemory.create(shm_path, 4 << 20, 1 << 20, 16 << 10, prefault=False)
    yield memory
    memory.close()


def _mapped(worker: Any, arena: ArenaMemory) -> Any:
    worker._arena = arena  # as `_slots` maps it from the metadata's arena path
    return worker


def _worker(tp: int, rank: int, caches: dict[str, torch.Tensor], order: str, kv: int) -> Any:
    layout = "LBNHC" if order == TOKENS_FIRST else "LBHNC"
    worker = KVTierWorker(
        _vllm_config(tp, rank, kv_heads=kv, layout=layout), ConnectorConfig(model_revision="r1")
    )
    worker.register_kv_caches(caches)
    assert set(worker.plans) == {"target"}, "the pool was refused"
    return worker


def _layers(per_layer: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(per_layer)}


@pytest.mark.parametrize("tokens_first", [False, True])
@pytest.mark.parametrize(("kv_heads", "tp"), [(4, 2), (4, 4), (1, 2)])
def test_each_rank_writes_its_heads_and_a_tp1_worker_reads_the_whole_chunk(
    tokens_first: bool, kv_heads: int, tp: int, arena: ArenaMemory
) -> None:
    order = TOKENS_FIRST if tokens_first else HEADS_FIRST
    full = [_kv(kv_heads, tokens_first, seed=i) for i in range(LAYERS)]
    per_rank = max(1, kv_heads // tp)
    writers = [
        _mapped(
            _worker(
                tp,
                r,
                _layers([_heads(t, s, per_rank, tokens_first) for t in full]),
                order,
                kv_heads,
            ),
            arena,
        )
        for r in range(tp)
        for s in [tp_shard(kv_heads, tp, r).first]
    ]
    plan = writers[0].plans["target"]
    slots = torch.zeros(plan.chunk_bytes * 2, dtype=torch.uint8)
    generation = int(arena.generation[1])
    store = ChunkCopy("target", 1, plan.chunk_bytes, generation, block_ids=(3,))
    for w in writers:
        if w.plans["target"].shard.writes:
            assert w._copy(store, slots, into_arena=True)
    assert torch.count_nonzero(slots[: plan.chunk_bytes]) == 0  # nothing outside the slot
    reader = _mapped(
        _worker(1, 0, _layers([torch.zeros_like(t) for t in full]), order, kv_heads), arena
    )
    assert reader.plans["target"].chunk_bytes == plan.chunk_bytes
    load = ChunkCopy("target", 1, plan.chunk_bytes, generation, block_ids=(5,))
    assert reader._copy(load, slots, into_arena=False)
    for i, layer in enumerate(full):
        loaded = reader.pages["target"][i][5].view(torch.float32)
        expected = layer[3] if not tokens_first else layer[3].permute(1, 0, 2)
        assert torch.equal(loaded, expected.contiguous().flatten())
    # and back to each rank, its own heads only
    for r, w in enumerate(writers):
        first = tp_shard(kv_heads, tp, r).first
        mine = w.pages["target"]
        for page in mine:
            page.zero_()
        assert w._copy(load, slots, into_arena=False)
        for i, layer in enumerate(full):
            part = layer[3, first : first + per_rank]
            expected = part if not tokens_first else part.permute(1, 0, 2)
            assert torch.equal(mine[i][5].view(torch.float32), expected.contiguous().flatten())


def test_a_slot_outside_the_mapped_arena_is_a_failed_copy_not_a_crash(arena: ArenaMemory) -> None:
    worker = _worker(1, 0, _layers([_kv(4, False) for _ in range(LAYERS)]), HEADS_FIRST, 4)
    _mapped(worker, arena)
    plan = worker.plans["target"]
    slots = torch.zeros(plan.chunk_bytes, dtype=torch.uint8)
    generation = int(arena.generation[1])
    job = ChunkCopy("target", 1, plan.chunk_bytes // 2, generation, block_ids=(1,))
    assert not worker._copy(job, slots, into_arena=False)
    inside = ChunkCopy("target", 1, 0, generation, block_ids=(1,))
    assert worker._copy(inside, slots, into_arena=False)  # the same slot, inside: copied
    stale = ChunkCopy("target", 1, 0, generation + 1, block_ids=(1,))
    assert not worker._copy(stale, slots, into_arena=False)  # planned in another arena
