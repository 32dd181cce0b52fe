"""Counters scraped from Prometheus text, and what a level's before/after delta says about
cache hits.

vLLM 0.32 exposes ``vllm:prompt_tokens_total`` (every prompt token), and
``vllm:prompt_tokens_cached_by_source_total{source}`` (device, host, disk, p2p,
external_unspecified) for the tokens a cache supplied; ``vllm:prompt_tokens_by_source_total``
splits them into local_compute, local_cache_hit and external_kv_transfer. kvtier's connector adds
``vllm:kvtier_transfer_{chunks,bytes}_total{direction,pool}`` and
``vllm:kvtier_hook_seconds_total{hook}`` (vLLM's time inside its hooks) to the same page, and
the daemon serves ``kvtier_lookup_chunks_total`` and ``kvtier_hit_chunks_total{tier}`` on its
own port.

vLLM's per-request histograms split a request's time to first token:
``vllm:request_queue_time_seconds`` (arrival in the engine to first scheduled, which includes
the wait in WAITING_FOR_REMOTE_KVS for an asynchronous load),
``vllm:request_prefill_time_seconds`` (first scheduled to first token, a synchronous load's copy
included) and ``vllm:time_to_first_token_seconds`` (measured by the front end, so it also holds
what happens before the engine); kvtier's connector adds ``vllm:kvtier_load_wait_seconds`` (a
request's first ask to its load landing). Their deltas over a level are `Histogram`s: the mean
is exact, quantiles are interpolated within buckets.

The counters are server-wide: other traffic during a level is counted too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
CONNECTOR_CHUNKS = "vllm:kvtier_transfer_chunks_total"
CONNECTOR_BYTES = "vllm:kvtier_transfer_bytes_total"
CONNECTOR_HOOK_SECONDS = "vllm:kvtier_hook_seconds_total"
CONNECTOR_DRAWS = "vllm:kvtier_verify_requests_total"
DAEMON_LOOKUPS = "kvtier_lookup_chunks_total"
DAEMON_HITS = "kvtier_hit_chunks_total"
TTFT_PARTS = {
    "queue": "vllm:request_queue_time_seconds",
    "load_wait": "vllm:kvtier_load_wait_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
}
"""The histograms a request's time to first token is split by, by part."""


def parse_counters(text: str) -> Samples:
    """Every counter, gauge and histogram sample (``_bucket``, ``_count``, ``_sum``; ``_created``
    timestamps left out), keyed by sample name and sorted labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        if family.type in ("gaugehistogram", "summary"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


async def scrape(client: httpx.AsyncClient, url: str) -> Samples | None:
    """The counters at ``url``; None when it serves no Prometheus text."""
    try:
        response = await client.get(url)
        if response.status_code != 200:
            return None
        return parse_counters(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def delta(before: Samples, after: Samples) -> Samples:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    return sum(
        v
        for (n, series), v in samples.items()
        if n == name and all(dict(series).get(k) == want for k, want in labels.items())
    )


def by_label(samples: Samples, name: str, label: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, series), v in samples.items():
        d = dict(series)
        if n == name and label in d and all(d.get(k) == w for k, w in labels.items()):
            out[d[label]] = out.get(d[label], 0.0) + v
    return out


def has(samples: Samples, name: str) -> bool:
    return any(n == name for n, _ in samples)


@dataclass(frozen=True)
class Histogram:
    """A histogram's observations over a level (a delta), its series summed."""

    bounds: tuple[float, ...]
    """Upper bounds of its finite buckets, ascending."""
    cumulative: tuple[float, ...]
    """Observations at or below each bound; ``count`` is the +Inf bucket's."""
    count: float
    sum: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) as Prometheus's ``histogram_quantile`` reads it: linear
        within the bucket that holds its rank, from 0 in the first bucket; a rank past the last
        finite bound gives that bound. None with no observation."""
        if not 0 <= q <= 1:
            raise ValueError(f"quantile must be within 0..1, got {q}")
        if self.count <= 0 or not self.bounds:
            return None
        rank = q * self.count
        below, lower = 0.0, 0.0
        for bound, at in zip(self.bounds, self.cumulative, strict=True):
            if at >= rank and at > below:
                return lower + (bound - lower) * (rank - below) / (at - below)
            below, lower = at, bound
        return self.bounds[-1]


def histogram(samples: Samples, name: str, **labels: str) -> Histogram | None:
    """The histogram ``name`` over the series whose labels include ``labels``; None where the
    page has no such histogram."""
    if not has(samples, f"{name}_count"):
        return None
    at: dict[float, float] = {}
    for (n, series), v in samples.items():
        d = dict(series)
        if n == f"{name}_bucket" and all(d.get(k) == w for k, w in labels.items()):
            bound = float(d["le"])
            at[bound] = at.get(bound, 0.0) + v
    bounds = sorted(b for b in at if not math.isinf(b))
    return Histogram(
        bounds=tuple(bounds),
        cumulative=tuple(at[b] for b in bounds),
        count=total(samples, f"{name}_count", **labels),
        sum=total(samples, f"{name}_sum", **labels),
    )


@dataclass(frozen=True)
class ServerCounters:
    """What the server counted during one level (deltas); None where it exposes no such
    metric."""

    requests_succeeded: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    cached_tokens_by_source: dict[str, float] = field(default_factory=dict)
    prompt_tokens_by_source: dict[str, float] = field(default_factory=dict)
    connector_chunks: dict[str, float] = field(default_factory=dict)
    """kvtier connector chunks by direction (load, store)."""
    connector_bytes: dict[str, float] = field(default_factory=dict)
    connector_hook_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds vLLM spent inside kvtier connector hooks, by hook."""
    verify_draws: dict[str, float] = field(default_factory=dict)
    """Requests with a hit the verification sampler drew for, by outcome (sampled, served)."""
    daemon_lookup_chunks: float | None = None
    daemon_hit_chunks_by_tier: dict[str, float] = field(default_factory=dict)
    ttft_histograms: dict[str, Histogram] = field(default_factory=dict)
    """The engine's histograms of `TTFT_PARTS`, by part (those it exposes)."""

    @property
    def ttft_parts(self) -> dict[str, dict[str, float | None]]:
        """Per part of a request's time to first token: the requests observed, the mean
        (exact) and the p90 (interpolated within the histogram's buckets), in seconds."""
        return {
            part: {"requests": h.count, "mean_s": h.mean, "p90_s": h.quantile(0.9)}
            for part, h in self.ttft_histograms.items()
        }

    @property
    def hit_ratio(self) -> float | None:
        """Prompt tokens served from any cache over all prompt tokens."""
        if not self.prompt_tokens or not self.cached_tokens_by_source:
            return None
        return sum(self.cached_tokens_by_source.values()) / self.prompt_tokens

    @property
    def hit_ratio_by_source(self) -> dict[str, float]:
        if not self.prompt_tokens:
            return {}
        return {k: v / self.prompt_tokens for k, v in self.cached_tokens_by_source.items()}

    @property
    def realized_sample_rate(self) -> float | None:
        """Sampled requests over the requests with a hit: `verify_sample_rate`, as realized."""
        drawn = sum(self.verify_draws.values())
        return self.verify_draws.get("sampled", 0.0) / drawn if drawn else None

    @property
    def daemon_hit_ratio(self) -> float | None:
        if not self.daemon_lookup_chunks:
            return None
        return sum(self.daemon_hit_chunks_by_tier.values()) / self.daemon_lookup_chunks


def server_counters(
    engine: Samples | None, daemon: Samples | None = None, *, model: str | None = None
) -> ServerCounters:
    """Read one level's deltas; ``model`` keeps vLLM's series of that model only."""
    e = engine or {}
    labels: Mapping[str, str] = {"model_name": model} if model else {}
    if model and not any(dict(series).get("model_name") == model for _, series in e):
        labels = {}  # a server that labels differently: take every series

    def opt(name: str) -> float | None:
        return total(e, name, **labels) if has(e, name) else None

    d = daemon or {}
    return ServerCounters(
        requests_succeeded=opt(REQUEST_SUCCESS),
        prompt_tokens=opt(PROMPT_TOKENS),
        generation_tokens=opt(GENERATION_TOKENS),
        cached_tokens_by_source=by_label(e, CACHED_BY_SOURCE, "source", **labels),
        prompt_tokens_by_source=by_label(e, PROMPT_BY_SOURCE, "source", **labels),
        connector_chunks=by_label(e, CONNECTOR_CHUNKS, "direction", **labels),
        connector_bytes=by_label(e, CONNECTOR_BYTES, "direction", **labels),
        connector_hook_seconds=by_label(e, CONNECTOR_HOOK_SECONDS, "hook", **labels),
        verify_draws=by_label(e, CONNECTOR_DRAWS, "outcome", **labels),
        daemon_lookup_chunks=total(d, DAEMON_LOOKUPS) if has(d, DAEMON_LOOKUPS) else None,
        daemon_hit_chunks_by_tier=by_label(d, DAEMON_HITS, "tier"),
        ttft_histograms={
            part: h
            for part, name in TTFT_PARTS.items()
            if (h := histogram(e, name, **labels)) is not None
        },
    )
