"""What the real fleet of `benchmarks/fleet_check.py` measures besides its workload: requests
before it (each engine's prefill per token and a request's fixed latency; a first load from the
bucket on each node), and kvtierd's counters over a stretch of the run (the mean costs it timed
there).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.harness.kvtierd import Kvtierd
from kvtier.bench.client import RequestResult, completion_body, stream_completion
from kvtier.bench.scrape import Samples, parse_counters, total
from tests.fixtures import models

CALIBRATIONS = 3
UPLOADS = "kvtier_object_store_uploads_total"
PREFILL_FIT = "kvtier_prefill_fit_seconds"


def warm(
    server: Any, daemon: Kvtierd, model: str, vocab: int, index: int, length: int, answer: int
) -> EngineCalibration:
    """Requests of prompts no session shares, before the workload: one of ``length`` tokens,
    answered with ``answer`` (the server's first request sets up what later ones reuse); then,
    a token each, ``CALIBRATIONS`` prompts of that length it computes whole, and as many of the
    first prompt again, which its cache holds but the last block of. Their TTFTs measure its
    prefill per token and what every request pays past it; the prompts computed whole each
    waited for a probe of the store to find nothing, timed by kvtierd."""
    url = server.url
    prompt = _unused_prompt(vocab, 10 + index, length)
    _request(url, model, prompt, answer)
    seeds = range(20 + index * CALIBRATIONS, 20 + (index + 1) * CALIBRATIONS)
    before = [parse_counters(daemon.metrics())]
    fresh = [_request(url, model, _unused_prompt(vocab, seed, length), 1) for seed in seeds]
    window = Window(before, [parse_counters(daemon.metrics())])
    held = [_request(url, model, prompt, 1) for _ in range(CALIBRATIONS)]
    return EngineCalibration(
        held=Calibration.of(held), fresh=Calibration.of(fresh), fresh_probe_s=window.probe_miss_s
    )


@dataclass
class Window:
    """kvtierd's counters over a stretch of the run, summed over nodes: the mean costs it
    timed in that stretch (its gauges weigh only the last loads)."""

    before: list[Samples]
    after: list[Samples]

    def increase(self, name: str, **labels: str) -> float:
        return sum(
            total(a, name, **labels) - total(b, name, **labels)
            for a, b in zip(self.after, self.before, strict=True)
        )

    def mean(self, seconds: str, count: str, **labels: str) -> float:
        n = self.increase(count, **labels)
        return self.increase(seconds, **labels) / n if n else 0.0

    @property
    def probe_miss_s(self) -> float:
        return self.mean(
            "kvtier_object_store_probe_miss_seconds_total", "kvtier_object_store_probe_misses_total"
        )

    def load_s_per_chunk(self, tier: str) -> float:
        return self.mean("kvtier_load_seconds_total", "kvtier_loaded_chunks_total", tier=tier)

    @property
    def prefill_s_per_token(self) -> float:
        """The engines' prefill steps' seconds over their tokens: what prefill cost on this
        machine under this load (side by side with the other engine, both kvtierds, moto and
        the client)."""
        return self.mean("kvtier_prefill_seconds_total", "kvtier_prefill_tokens_total")

    def prefill_fit(self, part: str) -> float:
        """kvtierd's fit of the steps at the window's end (``part`` step or token), over
        nodes."""
        return statistics.mean(total(a, PREFILL_FIT, part=part) for a in self.after)

    @property
    def upload_s(self) -> float:
        return self.mean("kvtier_object_store_upload_seconds_total", UPLOADS)


def warm_the_store(nodes: list[Any], model: str, vocab: int, length: int) -> None:
    """A prompt each node computes and the other then finds only in the bucket: a node's first
    load from the store starts its download threads and connections, once, which no later load
    pays."""
    for n in range(2):
        (a, daemon), (b, _) = nodes[n], nodes[1 - n]
        prompt = _unused_prompt(vocab, 100 + n, length)
        before = total(parse_counters(daemon.metrics()), UPLOADS)
        _request(a.url, model, prompt, 1)
        deadline = time.monotonic() + 60
        while total(parse_counters(daemon.metrics()), UPLOADS) <= before:
            if time.monotonic() > deadline:
                raise RuntimeError("the warm-up prompt's chunks were never uploaded")
            time.sleep(0.05)
        _request(b.url, model, prompt, 1)


def _unused_prompt(vocab: int, seed: int, length: int) -> list[int]:
    """A prompt of random tokens of its own (no session shares a chunk with it)."""
    return random.Random(seed).choices(range(len(models.SPECIAL_TOKENS), vocab), k=length)


@dataclass
class EngineCalibration:
    held: Calibration
    fresh: Calibration
    fresh_probe_s: float = 0.0
    """What the fresh prompts waited for their probe's miss (the held ones probe nothing)."""

    @property
    def prefill_s_per_token(self) -> float:
        computed = self.fresh.computed_tokens - self.held.computed_tokens
        return (self.fresh.ttft_s - self.fresh_probe_s - self.held.ttft_s) / computed

    @property
    def latency_s(self) -> float:
        return max(0.0, self.held.ttft_s - self.held.computed_tokens * self.prefill_s_per_token)


@dataclass
class Calibration:
    ttft_s: float
    """The median TTFT of calibration requests, which computed ``computed_tokens`` and loaded
    ``cached_tokens`` (medians too)."""
    computed_tokens: float
    cached_tokens: float

    @classmethod
    def of(cls, results: list[RequestResult]) -> Calibration:
        return cls(
            ttft_s=statistics.median(r.ttft for r in results),
            computed_tokens=statistics.median(
                r.prompt_tokens - (r.cached_tokens or 0) for r in results
            ),
            cached_tokens=statistics.median(r.cached_tokens or 0 for r in results),
        )


def _request(url: str, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    result = RequestResult("warm", 0, len(prompt), time.perf_counter())
    asyncio.run(_one(url, completion_body(model, prompt, max_tokens), result))
    if not result.ok:
        raise RuntimeError(f"warm-up request failed: {result.error}")
    return result


async def _one(url: str, body: dict[str, Any], result: RequestResult) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        await stream_completion(client, url, body, result)
