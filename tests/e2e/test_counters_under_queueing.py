"""kvtierd's counters under queueing: requests that wait several steps for room in a GPU cache too
small for them are asked about again every step, and kvtierd still counts what was served: a
chunk's hit once per request, a load once per chunk the engine loaded, few calls per hit and one
lookup per miss."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.models import ModelSet, counter, generate_tokens, running_llm
from tests.e2e.test_connector import kvtier_config
from tests.fixtures.models import vocab_size_of
from tests.integration.daemon_harness import DaemonFiles, Processes, RunningDaemon

BLOCK = 32
PROMPT = 688  # 21 whole chunks can be a hit: the last token is always computed
CHUNKS = (PROMPT - 1) // BLOCK
MAX_TOKENS = 4
# one request at a time fits: 28 blocks of 32 KiB (the tiny model's KV per block), and the
# null block
ENGINE = {"max_model_len": 28 * BLOCK, "kv_cache_memory_bytes": 29 * BLOCK * 1024}
SETTLE_S = 120.0  # reports and heartbeats wait on a machine's load: a bound, never a figure
DATA_PLANE = {"lookup", "reserve", "commit", "abort", "prefetch", "release", "promote"}


def unique_prompts(models: ModelSet, n: int, seed: int) -> list[list[int]]:
    from tests.fixtures.models import shared_prefix_prompts

    vocab = vocab_size_of(models.target)
    return shared_prefix_prompts(
        n, vocab_size=vocab, prefix_len=PROMPT - 48, suffix_len=48, num_prefixes=n, seed=seed
    )


class DaemonCounts:
    """kvtierd's counters as its /metrics page shows them, summed over labels."""

    def __init__(self, daemon: RunningDaemon) -> None:
        self.daemon = daemon

    def now(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for name, labels, value in self.daemon.metrics():
            if name == "kvtier_hit_chunks_total":
                out["hits"] += value
            elif name == "kvtier_lookup_chunks_total":
                out["asked"] += value
            elif name == "kvtier_verified_chunks_total":
                out["verified"] += value
            elif name == "kvtier_transfer_chunks_total" and labels.get("direction") == "load":
                out["loads"] += value
            elif name == "kvtier_requests_total":
                out[f"calls:{labels['op']}"] += value
                if labels["op"] in DATA_PLANE:
                    out["calls"] += value
        return out

    def settled(self, before: Counter[str], done: Callable[[Counter[str]], bool]) -> Counter[str]:
        """The change since ``before`` once ``done`` holds (hits answered from the arena's
        index reach kvtierd with a report, within a heartbeat of the engine going idle, which
        a loaded machine delays), or as it stands at the deadline."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            delta = self.now()
            delta.subtract(before)
            if done(delta) or time.monotonic() > deadline:
                return delta
            time.sleep(0.2)


def counted_asks(monkeypatch: pytest.MonkeyPatch, replan: bool) -> Counter[str]:
    """How often vLLM asks the connector about each request; with ``replan``, the load is
    planned anew at every ask (as when vLLM's own cache grew, the arena lost a chunk or the
    request was preempted)."""
    from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler

    seen: Counter[str] = Counter()
    original = KVTierScheduler.get_num_new_matched_tokens

    def counting(self: KVTierScheduler, request: Any, computed: int) -> tuple[int | None, bool]:
        seen[request.request_id] += 1
        decision = self.state(request).decision
        if replan and decision is not None:
            self.calls.release(decision.drop_plan())
        return original(self, request, computed)

    monkeypatch.setattr(KVTierScheduler, "get_num_new_matched_tokens", counting)
    return seen


@pytest.fixture
def asks(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    return counted_asks(monkeypatch, replan=False)


@pytest.fixture
def replanning_asks(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    return counted_asks(monkeypatch, replan=True)


def test_waiting_requests_are_counted_once_and_cost_few_calls(
    tiny_models: ModelSet,
    procs: Processes,
    daemon_files: DaemonFiles,
    asks: Counter[str],
) -> None:
    daemon = procs.start_daemon(daemon_files)
    counts = DaemonCounts(daemon)
    connector = kvtier_config({"mode": "sidecar", "socket_path": str(daemon_files.socket)})
    stored, fresh = unique_prompts(tiny_models, 8, seed=21), unique_prompts(tiny_models, 4, 22)
    before = counts.now()
    with running_llm(tiny_models.target, kv_transfer_config=connector, **ENGINE) as llm:
        generate_tokens(llm, stored, max_tokens=MAX_TOKENS)
    delta = counts.settled(before, lambda d: d["asked"] >= CHUNKS * 8 and d["calls:commit"] > 0)
    # nothing to reuse: one lookup per request, however often vLLM asked while it waited
    assert max(asks.values()) >= 4, asks
    assert (delta["asked"], delta["hits"], delta["calls:lookup"]) == (CHUNKS * 8, 0, 8), delta
    # vLLM publishes no KV events here: the tiers' journal is never asked for them
    assert delta["calls:commit"] > 0, delta
    assert delta["calls:chunk_events"] == 0, delta

    # every stored prompt again, from a fresh engine: each one waits for the one before
    asks.clear()
    before = counts.now()
    with running_llm(tiny_models.target, kv_transfer_config=connector, **ENGINE) as llm:
        _, cached = generate_tokens(llm, stored, max_tokens=MAX_TOKENS)
        loaded = counter(llm, "vllm:kvtier_transfer_chunks", direction="load")
        delta = counts.settled(before, lambda d: d["hits"] >= loaded and d["loads"] >= loaded)
    assert cached == [CHUNKS * BLOCK] * len(stored)
    assert max(asks.values()) >= 4, asks  # the queueing this test is about happened
    assert loaded == CHUNKS * len(stored)
    assert (delta["asked"], delta["hits"], delta["loads"]) == (loaded, loaded, loaded), delta
    assert delta["calls"] <= 2 * len(stored), delta

    # half the prompts were never stored: the README's hit ratio is the true one
    before = counts.now()
    with running_llm(tiny_models.target, kv_transfer_config=connector, **ENGINE) as llm:
        generate_tokens(llm, stored[:4] + fresh, max_tokens=MAX_TOKENS)
        loaded = counter(llm, "vllm:kvtier_transfer_chunks", direction="load")
        delta = counts.settled(before, lambda d: d["hits"] >= loaded and d["asked"] >= 8 * CHUNKS)
    asked = CHUNKS * 8
    assert loaded == CHUNKS * 4
    assert delta["asked"] == asked, delta
    assert delta["hits"] / delta["asked"] == pytest.approx(loaded / asked)
    assert delta["loads"] == loaded, delta


def test_tiny_model_kv_is_the_size_this_test_assumes(tiny_models: ModelSet) -> None:
    # 2 layers x (K, V) x 2 KV heads x head_dim 32 x 4 bytes per token
    import json

    config = json.loads((Path(tiny_models.target) / "config.json").read_text())
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * 32 * 4
    dtype = config.get("dtype", config.get("torch_dtype"))
    assert (config["head_dim"], dtype, per_token) == (32, "float32", 1024)


def test_a_request_asked_while_it_waits_is_drawn_once_by_the_sampler(
    tiny_models: ModelSet,
    procs: Processes,
    daemon_files: DaemonFiles,
    replanning_asks: Counter[str],
) -> None:
    procs.start_daemon(daemon_files)
    sidecar = {"mode": "sidecar", "socket_path": str(daemon_files.socket)}
    stored = unique_prompts(tiny_models, 8, seed=23)
    with running_llm(tiny_models.target, kv_transfer_config=kvtier_config(sidecar)) as llm:
        generate_tokens(llm, stored, max_tokens=MAX_TOKENS)

    replanning_asks.clear()
    sampling = kvtier_config({**sidecar, "verify_sample_rate": 0.25, "verify_seed": 5})
    with running_llm(tiny_models.target, kv_transfer_config=sampling, **ENGINE) as llm:
        _, cached = generate_tokens(llm, stored, max_tokens=MAX_TOKENS)
        draws = {
            outcome: counter(llm, "vllm:kvtier_verify_requests", outcome=outcome)
            for outcome in ("sampled", "served")
        }
    asks = sum(replanning_asks.values())
    assert asks >= 3 * len(stored), replanning_asks  # each waited, and was planned anew
    # each request had a hit and was drawn once, however often it was asked: a sampled one is
    # served as a miss
    assert draws["sampled"] + draws["served"] == len(stored), (draws, asks)
    assert draws["sampled"] == cached.count(0), (draws, cached)
    assert draws["served"] == cached.count(CHUNKS * BLOCK), (draws, cached)


def test_hit_counters_stay_exact_when_every_hit_is_verified(
    tiny_models: ModelSet,
    procs: Processes,
    daemon_files: DaemonFiles,
    asks: Counter[str],
) -> None:
    daemon = procs.start_daemon(daemon_files)
    counts = DaemonCounts(daemon)
    sidecar = {"mode": "sidecar", "socket_path": str(daemon_files.socket)}
    stored = unique_prompts(tiny_models, 8, seed=24)
    with running_llm(tiny_models.target, kv_transfer_config=kvtier_config(sidecar)) as llm:
        generate_tokens(llm, stored, max_tokens=MAX_TOKENS)

    asks.clear()
    before = counts.now()
    every = kvtier_config({**sidecar, "verify_sample_rate": 1.0})
    with running_llm(tiny_models.target, kv_transfer_config=every, **ENGINE) as llm:
        _, cached = generate_tokens(llm, stored, max_tokens=MAX_TOKENS)
        sampled = counter(llm, "vllm:kvtier_verify_requests", outcome="sampled")
        delta = counts.settled(before, lambda d: d["verified"] >= CHUNKS * len(stored))
    assert max(asks.values()) >= 4, asks  # they waited, and were asked about again
    assert cached == [0] * len(stored)  # every one sampled: computed, none loaded
    assert sampled == len(stored)
    # kvtierd counts what they asked for and found as verified: no hit was served
    assert (delta["asked"], delta["verified"], delta["hits"]) == (
        CHUNKS * len(stored),
        CHUNKS * len(stored),
        0,
    ), delta
