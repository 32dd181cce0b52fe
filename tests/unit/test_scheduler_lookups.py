"""The scheduler's lookup hook over real embedded tiers (a small arena in /dev/shm, lmdb under
tmp_path), with no engine: vLLM's configs and requests are the few fields the scheduler reads."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvtier_vllm.kv.metadata import KVTierMetadata
from kvtier_vllm.kv.scheduler_side.load_chooser import WholeHit
from kvtier_vllm.kv.scheduler_side.prompt_keys import keys_in
from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler
from kvtier_vllm.shared.settings import ConnectorConfig

from kvtier.client import InProcessClient
from kvtier.core.keys import ChunkKey
from kvtier.core.load_choice import LoadChoice
from kvtier.tiers.cpu import CpuTier
from tests.support import MiB
from tests.unit.test_planner import ArenaReading

BLOCK = 16
BPC = 4
CHUNK_TOKENS = BLOCK * BPC
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


class FullAttentionSpec:
    """vLLM's spec of a full-attention group, which the connector knows by its name."""

    block_size = BLOCK


def _vllm_config() -> Any:
    # two float16 layers of 16 heads of 32: 256 KiB chunks, the arena's smallest slot class
    model = SimpleNamespace(
        model="tiny-llama",
        revision=None,
        dtype=torch.float16,
        use_mla=False,
        get_total_num_kv_heads=lambda: 16,
        get_num_kv_heads=lambda p: 16,
        get_head_size=lambda: 32,
        get_num_layers=lambda p: len(LAYERS),
    )
    parallel = SimpleNamespace(
        tensor_parallel_size=1, rank=0, pipeline_parallel_size=1, data_parallel_index=0
    )
    cache = SimpleNamespace(block_size=BLOCK, cache_dtype="auto", prefix_caching_hash_algo="sha256")
    return SimpleNamespace(
        model_config=model, parallel_config=parallel, cache_config=cache, speculative_config=None
    )


def open_scheduler(shm_path: Path, tmp_path: Path, **settings: Any) -> KVTierScheduler:
    """An embedded scheduler of one full-attention group, its arena at ``shm_path``
    (``settings``: the connector's, beside those set here)."""
    tiers = tmp_path / "kvtier.yaml"  # JSON is YAML
    arena = {"path": str(shm_path), "size_bytes": 16 * MiB, "extent_bytes": 2 * MiB}
    lmdb = {"path": str(tmp_path / "lmdb"), "budget_bytes": 64 * MiB}
    tiers.write_text(json.dumps({"arena": arena, "lmdb": lmdb}))
    cfg = ConnectorConfig(
        kvtier_config=tiers,
        model_revision="r1",
        blocks_per_chunk=BPC,
        verify_sample_rate=0,
        **settings,
    )
    groups = [SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=list(LAYERS))]
    return KVTierScheduler(_vllm_config(), SimpleNamespace(kv_cache_groups=groups), cfg)


@pytest.fixture
def scheduler(shm_path: Path, tmp_path: Path) -> Iterator[KVTierScheduler]:
    s = open_scheduler(shm_path, tmp_path)
    yield s
    s.shutdown()


def request(req_id: str, chunks: int) -> Any:
    """A prompt of ``chunks`` whole chunks and one token more, with its block hashes."""
    tokens = chunks * CHUNK_TOKENS + 1
    hashes = [f"{req_id}-{i}".encode().ljust(32, b".") for i in range(tokens // BLOCK)]
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(range(tokens)),
        num_prompt_tokens=tokens,
        block_hashes=hashes,
        lora_request=None,
    )


def chunk_keys(s: KVTierScheduler, req: Any, chunks: range) -> list[ChunkKey]:
    return keys_in(s.namespaces["target"], req.block_hashes, chunks, BPC)


def arena(s: KVTierScheduler) -> CpuTier:
    assert isinstance(s.client, InProcessClient)
    return s.client.manager.cpu


def store(s: KVTierScheduler, keys: list[ChunkKey]) -> None:
    assert s.client is not None
    refs = [r for r in s.client.reserve(keys) if r is not None]
    assert len(refs) == len(keys)
    assert s.client.commit(refs) == len(keys)


def test_a_stored_prefix_is_a_hit_of_its_tokens_past_vllms_own(scheduler: KVTierScheduler) -> None:
    req = request("a", 6)
    store(scheduler, chunk_keys(scheduler, req, range(4)))
    assert scheduler.get_num_new_matched_tokens(req, 0) == (4 * CHUNK_TOKENS, True)
    assert scheduler.hit_sources(req, 4 * CHUNK_TOKENS) == {}  # not granted yet
    # vLLM holds the first chunk itself: the hit is what lies past it
    other = request("a", 6)
    other.request_id = "b"
    assert scheduler.get_num_new_matched_tokens(other, CHUNK_TOKENS) == (3 * CHUNK_TOKENS, True)


def test_a_prompt_nothing_holds_is_a_miss(scheduler: KVTierScheduler) -> None:
    req = request("a", 4)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again


def test_a_granted_hit_is_loaded_into_its_blocks_and_its_leases_go_back(
    scheduler: KVTierScheduler,
) -> None:
    req = request("a", 3)
    store(scheduler, chunk_keys(scheduler, req, range(2)))
    tokens, _ = scheduler.get_num_new_matched_tokens(req, 0)
    assert tokens == 2 * CHUNK_TOKENS
    meta = granted_and_scheduled(scheduler, req, tokens)
    assert [c.block_ids for c in meta.loads] == [(1, 2, 3, 4), (5, 6, 7, 8)]
    copied_and_released(scheduler, req, 2)


def granted_and_scheduled(scheduler: KVTierScheduler, req: Any, tokens: int) -> KVTierMetadata:
    """vLLM grants ``req`` the hit of ``tokens`` and schedules it: the step's metadata."""
    blocks = list(range(1, len(req.block_hashes) + 1))
    scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: [blocks]), tokens)
    assert scheduler.hit_sources(req, tokens) == {"host": tokens}
    new = SimpleNamespace(req_id=req.request_id, block_ids=[blocks], num_computed_tokens=0)
    return scheduler.build_connector_meta(step([new], {req.request_id: 1}))


def step(new: list[Any], scheduled: dict[str, int]) -> Any:
    """A scheduler step's output, of new requests only."""
    return SimpleNamespace(
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
        num_scheduled_tokens=scheduled,
    )


def copied_and_released(scheduler: KVTierScheduler, req: Any, chunks: int) -> None:
    """``req`` finishes: its load's ``chunks`` stay leased until the workers copied them, then
    go back with the next lookup (and the arena may evict them)."""
    scheduler.request_finished(req)
    evictable = lambda: arena(scheduler).evict(namespace=scheduler.namespaces["target"])  # noqa: E731
    assert evictable() == 0  # leased until the workers copied them
    scheduler.build_connector_meta(step([], {req.request_id: 1}))
    assert evictable() == 0  # due with the next call that releases
    scheduler.get_num_new_matched_tokens(request("c", 1), 0)  # a lookup takes them along
    assert evictable() == chunks


class FirstRun(WholeHit):
    """A load chooser that loads the hit's first run of one tier; keeps the runs it was asked
    about."""

    def __init__(self) -> None:
        self.asked: list[list[tuple[str, int]]] = []

    def choose(self, runs: Sequence[tuple[str, int]], chunk_tokens: int) -> LoadChoice:
        self.asked.append(list(runs))
        return LoadChoice(runs[0][1] * chunk_tokens if runs else 0, ())


def test_a_hit_cut_to_its_first_run_loads_only_that_run(scheduler: KVTierScheduler) -> None:
    """Chunks 0-1 in the arena, 2-3 in lmdb (read from lmdb's map when loaded): cut to its
    arena run, the hit is those two, and only they are leased and copied."""
    req = request("a", 5)
    assert isinstance(scheduler.client, InProcessClient)
    assert scheduler.hits is not None
    store(scheduler, chunk_keys(scheduler, req, range(2, 4)))
    assert scheduler.client.flush()
    scheduler.client.manager.evict("cpu", namespace=scheduler.namespaces["target"])
    store(scheduler, chunk_keys(scheduler, req, range(2)))
    scheduler.hits.chooser = chooser = FirstRun()
    tokens, _ = scheduler.get_num_new_matched_tokens(req, 0)
    assert chooser.asked == [[("cpu", 2), ("lmdb", 2)]]
    assert tokens == 2 * CHUNK_TOKENS
    meta = granted_and_scheduled(scheduler, req, tokens)
    assert [c.chunk for c in meta.loads] == [bytes(k) for k in chunk_keys(scheduler, req, range(2))]
    assert [c.block_ids for c in meta.loads] == [(1, 2, 3, 4), (5, 6, 7, 8)]
    copied_and_released(scheduler, req, 2)  # 2-3 were neither leased nor promoted


class CountedCalls(ArenaReading):
    """Reads the arena's index as a sidecar client does, and counts the calls a daemon would
    answer (index reads are local)."""

    def __init__(self, client: InProcessClient) -> None:
        super().__init__(client)
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        found = super().__getattr__(name)
        if name in ("lookup", "lease", "lookup_behind", "promote") and callable(found):

            def counted(*args: object, **kwargs: object) -> object:
                self.calls += 1
                return found(*args, **kwargs)

            return counted
        return found


def counting_calls(s: KVTierScheduler) -> CountedCalls:
    """The lookup's client, as a sidecar's: see `CountedCalls`."""
    assert s.hits is not None
    assert isinstance(s.client, InProcessClient)
    s.hits.client = counted = CountedCalls(s.client)  # type: ignore[assignment]
    return counted


def test_an_answer_stands_with_no_call_until_the_arena_could_answer_otherwise(
    scheduler: KVTierScheduler,
) -> None:
    client = counting_calls(scheduler)
    req = request("a", 6)
    store(scheduler, chunk_keys(scheduler, req, range(4)))
    assert scheduler.get_num_new_matched_tokens(req, 0) == (4 * CHUNK_TOKENS, True)
    calls = client.calls
    # vLLM asks again while the request waits for room: the same answer, with no call
    assert scheduler.get_num_new_matched_tokens(req, 0) == (4 * CHUNK_TOKENS, True)
    assert client.calls == calls
    store(scheduler, chunk_keys(scheduler, req, range(4, 5)))  # a longer hit is there now
    assert scheduler.get_num_new_matched_tokens(req, 0) == (5 * CHUNK_TOKENS, True)
    assert client.calls > calls

    miss = request("m", 6)
    assert scheduler.get_num_new_matched_tokens(miss, 0) == (0, False)
    calls = client.calls
    assert scheduler.get_num_new_matched_tokens(miss, 0) == (0, False)
    assert client.calls == calls  # nothing where its hit would start: no call
    store(scheduler, chunk_keys(scheduler, miss, range(2)))
    assert scheduler.get_num_new_matched_tokens(miss, 0) == (2 * CHUNK_TOKENS, True)


def test_a_request_whose_load_failed_in_some_blocks_is_not_looked_up_again(
    scheduler: KVTierScheduler,
) -> None:
    # one group: a failed chunk comes back as load errors of its blocks, and vLLM computes the
    # request from the first; asked again (preempted), it is computed, not loaded again
    req = request("a", 3)
    store(scheduler, chunk_keys(scheduler, req, range(2)))
    tokens, asynchronous = scheduler.get_num_new_matched_tokens(req, 0)
    assert (tokens, asynchronous) == (2 * CHUNK_TOKENS, True)
    blocks = list(range(1, len(req.block_hashes) + 1))
    scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: [blocks]), tokens)
    scheduler.update_connector_output(None, (), {blocks[BPC]})  # the second chunk's first block
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
