"""Running a workload against a server: one concurrency level, or a sweep of them."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvtier.bench.client import (
    CHAT,
    RequestResult,
    ServerInfo,
    base_url,
    chat_body,
    completion_body,
    server_info,
    stream_completion,
)
from kvtier.bench.errors import BenchError
from kvtier.bench.images import data_url, png
from kvtier.bench.scrape import REQUEST_SUCCESS, Samples, ServerCounters, delta, has, scrape
from kvtier.bench.scrape import server_counters as read_counters
from kvtier.bench.scrape import total as metric_total
from kvtier.bench.stats import Percentiles, inter_token_gaps, rate
from kvtier.bench.workloads import ChatSession, Session, WorkloadSpec

Progress = Callable[[str, int, int], None]
"""Called with (phase, requests done, requests in the phase) as requests complete."""

_SETTLE_S = 2.0  # the longest wait for the server's counters to catch up


@dataclass(frozen=True)
class BenchConfig:
    url: str
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    requests: int = 32
    """Measured requests per level."""
    warmup: int = 0
    """Requests sent before each level's measurement, from contexts of their own."""
    model: str | None = None
    """None: the first model the server lists."""
    timeout_s: float = 600.0
    kvtier_metrics_url: str | None = None
    """The kvtierd /metrics page, for the daemon's hit counters."""

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be >= 1")
        if self.requests < 1 or self.warmup < 0:
            raise ValueError("requests must be >= 1 and warmup >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RequestRecord:
    session: str
    round: int
    ok: bool
    prompt_len: int
    """Tokens sent."""
    prompt_tokens: int
    """Tokens the server reported (0 when it did not)."""
    output_tokens: int
    cached_tokens: int | None
    ttft_s: float
    latency_s: float
    error: str = ""


@dataclass(frozen=True)
class LevelResult:
    """One concurrency level. Throughputs count successful requests only.

    ``output_tps_per_user`` is the mean over requests of output tokens over that request's
    end-to-end latency: the rate one user sees, prefill included.
    """

    concurrency: int
    requests: int
    ok: int
    errors: int
    warmup_errors: int
    duration_s: float
    ttft_s: Percentiles
    itl_s: Percentiles
    latency_s: Percentiles
    prompt_tokens: int
    """Sent in the measured requests."""
    output_tokens: int
    cached_tokens: int | None
    """Summed from the usage the server reported, None when it reported none."""
    output_tps: float
    output_tps_per_user: float
    requests_per_s: float
    server: ServerCounters
    records: list[RequestRecord]

    @property
    def error_messages(self) -> list[str]:
        return sorted({r.error for r in self.records if r.error})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_ratio"] = self.server.hit_ratio
        out["hit_ratio_by_source"] = self.server.hit_ratio_by_source
        out["daemon_hit_ratio"] = self.server.daemon_hit_ratio
        out["ttft_parts"] = self.server.ttft_parts
        out["error_messages"] = self.error_messages
        return out


@dataclass(frozen=True)
class RunResult:
    config: BenchConfig
    server: ServerInfo
    levels: list[LevelResult]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "server": asdict(self.server),
            "levels": [level.to_dict() for level in self.levels],
        }


def check_fits(spec: WorkloadSpec, info: ServerInfo) -> None:
    """Refuse, before any request, a workload whose longest request exceeds max_model_len."""
    need = spec.longest_request()
    if info.max_model_len is not None and need > info.max_model_len:
        raise BenchError(
            f"the {spec.kind} workload does not fit max_model_len {info.max_model_len} of "
            f"{info.model}: its longest request needs {need} tokens ({spec.describe_longest()})"
        )


async def _run_sessions(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    spec: WorkloadSpec,
    sessions: list[Session],
    concurrency: int,
    on_done: Callable[[], None],
) -> list[RequestResult]:
    chat = spec.kind == "multimodal"
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    results: list[RequestResult] = []

    images = [data_url(png(i, spec.image_side)) for i in range(spec.images)] if chat else []

    async def user() -> None:
        while not queue.empty():
            session = queue.get_nowait()
            for r in range(session.rounds):
                if isinstance(session, ChatSession):
                    text, image = session.chat_prompt(r)
                    sent = len(text.split()) + spec.image_tokens
                    result = RequestResult(session.name, r, sent, time.perf_counter())
                    body = chat_body(model, text, images[image], spec.answer_tokens)
                    await stream_completion(client, url, body, result, CHAT)
                    session.record_text(r, result.text if result.ok else None)
                else:
                    prompt = session.prompt(r)
                    result = RequestResult(session.name, r, len(prompt), time.perf_counter())
                    body = completion_body(model, prompt, spec.answer_tokens)
                    await stream_completion(client, url, body, result)
                    session.record(r, result.token_ids if result.ok else None)
                results.append(result)
                on_done()

    await asyncio.gather(*(user() for _ in range(min(concurrency, len(sessions)))))
    return results


def _summarise(
    concurrency: int,
    results: list[RequestResult],
    duration: float,
    warmup_errors: int,
    counters: ServerCounters,
) -> LevelResult:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in inter_token_gaps(r.chunk_times, r.chunk_tokens)]
    output = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    per_user = [r.output_tokens / r.latency for r in ok if r.latency > 0]
    records = [
        RequestRecord(
            r.session,
            r.round_index,
            r.ok,
            r.prompt_len,
            r.prompt_tokens,
            r.output_tokens,
            r.cached_tokens,
            r.ttft if r.ok else math.nan,
            r.latency,
            r.error,
        )
        for r in results
    ]
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        ok=len(ok),
        errors=len(results) - len(ok),
        warmup_errors=warmup_errors,
        duration_s=duration,
        ttft_s=Percentiles.of([r.ttft for r in ok]),
        itl_s=Percentiles.of(gaps),
        latency_s=Percentiles.of([r.latency for r in ok]),
        prompt_tokens=sum(r.prompt_len for r in results),
        output_tokens=output,
        cached_tokens=sum(cached) if cached else None,
        output_tps=rate(output, duration),
        output_tps_per_user=sum(per_user) / len(per_user) if per_user else math.nan,
        requests_per_s=rate(len(ok), duration),
        server=counters,
        records=records,
    )


class _Bench:
    """One HTTP client and the server's identity, shared by the levels of a sweep."""

    def __init__(self, config: BenchConfig, client: httpx.AsyncClient, info: ServerInfo) -> None:
        self.config = config
        self.url = base_url(config.url)
        self.client = client
        self.info = info

    async def _scrape(self) -> tuple[Samples | None, Samples | None]:
        engine = await scrape(self.client, f"{self.url}/metrics")
        daemon = None
        if self.config.kvtier_metrics_url:
            daemon = await scrape(self.client, self.config.kvtier_metrics_url)
        return engine, daemon

    async def _settled(
        self, since: Samples | None, succeeded: int
    ) -> tuple[Samples | None, Samples | None]:
        """A scrape once the server counts ``succeeded`` more successes than ``since`` (it
        updates its counters just after the last chunk), or after a short wait."""
        deadline = time.monotonic() + _SETTLE_S
        while True:
            engine, daemon = await self._scrape()
            if since is None or engine is None or not has(engine, REQUEST_SUCCESS):
                return engine, daemon  # nothing to wait for
            if time.monotonic() > deadline:
                return engine, daemon
            if metric_total(delta(since, engine), REQUEST_SUCCESS) >= succeeded:
                return engine, daemon
            await asyncio.sleep(0.05)

    async def level(self, concurrency: int, index: int, progress: Progress | None) -> LevelResult:
        cfg = self.config
        spec = cfg.workload

        def tick(phase: str, total: int) -> Callable[[], None]:
            done = 0

            def on_done() -> None:
                nonlocal done
                done += 1
                if progress is not None:
                    progress(phase, done, total)

            return on_done

        start_counts = await self._scrape()
        warmup_ok = warmup_errors = 0
        if cfg.warmup:
            phase = f"warm-up c={concurrency}"
            sessions = spec.sessions(cfg.warmup, f"warmup/{index}")
            warm = await _run_sessions(
                self.client,
                self.url,
                self.info.model,
                spec,
                sessions,
                concurrency,
                tick(phase, cfg.warmup),
            )
            warmup_ok = sum(r.ok for r in warm)
            warmup_errors = len(warm) - warmup_ok
        # the warm-up's last requests must be counted before the level's baseline is taken
        engine_before, daemon_before = await self._settled(start_counts[0], warmup_ok)
        phase = f"concurrency {concurrency}"
        sessions = spec.sessions(cfg.requests, f"level/{index}")
        start = time.perf_counter()
        results = await _run_sessions(
            self.client,
            self.url,
            self.info.model,
            spec,
            sessions,
            concurrency,
            tick(phase, cfg.requests),
        )
        duration = time.perf_counter() - start
        engine_after, daemon_after = await self._settled(engine_before, sum(r.ok for r in results))
        counters = read_counters(
            delta(engine_before, engine_after) if engine_before and engine_after else None,
            delta(daemon_before, daemon_after) if daemon_before and daemon_after else None,
            model=self.info.model,
        )
        return _summarise(concurrency, results, duration, warmup_errors, counters)


def _client(config: BenchConfig, *extra: int) -> httpx.AsyncClient:
    most = max((*config.concurrency, *extra)) + 4
    return httpx.AsyncClient(
        timeout=httpx.Timeout(config.timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=most, max_keepalive_connections=most),
    )


async def _prepare(config: BenchConfig, client: httpx.AsyncClient) -> _Bench:
    info = await server_info(client, base_url(config.url), config.model)
    check_fits(config.workload, info)
    return _Bench(config, client, info)


async def run_sweep_async(config: BenchConfig, progress: Progress | None = None) -> RunResult:
    async with _client(config) as client:
        bench = await _prepare(config, client)
        levels = [await bench.level(c, i, progress) for i, c in enumerate(config.concurrency)]
        return RunResult(config, bench.info, levels)


def run_sweep(config: BenchConfig, progress: Progress | None = None) -> RunResult:
    """Every level of ``config.concurrency`` in order, after checking the server up front."""
    return asyncio.run(run_sweep_async(config, progress))


def run_level(
    config: BenchConfig, concurrency: int, *, index: int = 0, progress: Progress | None = None
) -> LevelResult:
    """One level on its own; ``index`` picks its contexts (levels of a sweep use 0, 1, ...)."""

    async def go() -> LevelResult:
        async with _client(config, concurrency) as client:
            bench = await _prepare(config, client)
            return await bench.level(concurrency, index, progress)

    return asyncio.run(go())
