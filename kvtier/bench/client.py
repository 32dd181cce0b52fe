"""A streaming client of an OpenAI-compatible ``/v1/completions`` endpoint, with token ids as
prompts, timing the first token and each token after it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier.bench.errors import BenchError


@dataclass(frozen=True)
class ServerInfo:
    model: str
    max_model_len: int | None
    """None when ``/v1/models`` does not say (servers other than vLLM)."""


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from ``time.perf_counter``."""

    session: str
    round_index: int
    prompt_len: int
    start: float
    end: float = 0.0
    ok: bool = False
    error: str = ""
    chunk_times: list[float] = field(default_factory=list)
    """Arrival of each chunk that carried output tokens."""
    chunk_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] | None = None
    """The output token ids, when the server returns them."""
    text: str = ""
    """The output text."""
    prompt_tokens: int = 0
    """From the server's usage; 0 when it sent none."""
    output_tokens: int = 0
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens`` (vLLM's --enable-prompt-tokens-details)."""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else float("nan")

    @property
    def latency(self) -> float:
        return self.end - self.start


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url.removesuffix("/v1")


async def server_info(client: httpx.AsyncClient, url: str, model: str | None) -> ServerInfo:
    """The served model (``model`` checked against the list, or the first one) and its
    ``max_model_len``; an unreachable or non-OpenAI server is a BenchError."""
    try:
        response = await client.get(f"{url}/v1/models")
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {url}: {exc or type(exc).__name__}") from None
    if response.status_code != 200:
        raise BenchError(f"{url}/v1/models answered HTTP {response.status_code}")
    try:
        models = response.json()["data"]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{url}/v1/models did not return an OpenAI model list") from None
    if not models:
        raise BenchError(f"{url} serves no model")
    by_id = {m.get("id"): m for m in models}
    if model is None:
        entry = models[0]
    elif model in by_id:
        entry = by_id[model]
    else:
        raise BenchError(f"{url} does not serve {model!r} (it serves {', '.join(map(str, by_id))})")
    limit = entry.get("max_model_len")
    return ServerInfo(str(entry["id"]), int(limit) if limit is not None else None)


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, **_sampling(model, max_tokens)}


def chat_body(model: str, text: str, image_url: str, max_tokens: int) -> dict[str, Any]:
    """One user message: ``text``, then the image."""
    content = [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": image_url}},
    ]
    return {"messages": [{"role": "user", "content": content}], **_sampling(model, max_tokens)}


def _sampling(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        # vLLM returns each chunk's token ids: the history then holds what was generated
        "return_token_ids": True,
    }


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    result: RequestResult,
    path: str = COMPLETIONS,
) -> RequestResult:
    """Send one streamed completion (or chat completion, at ``path``), filling ``result``.
    Failures are recorded, not raised."""
    ids: list[int] = []
    text: list[str] = []
    has_ids = False
    try:
        async with client.stream("POST", f"{url}{path}", json=body) as response:
            if response.status_code != 200:
                why = (await response.aread()).decode(errors="replace").strip()
                result.error = f"HTTP {response.status_code}: {why[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return result
                tokens = 0
                for choice in chunk.get("choices") or []:
                    said = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if said:
                        text.append(said)
                    got = choice.get("token_ids")
                    if got is not None:
                        has_ids = True
                        ids += got
                        tokens += len(got)
                    elif said:
                        tokens += 1  # without ids, a chunk is taken to carry one token
                if tokens:
                    result.chunk_times.append(now)
                    result.chunk_tokens.append(tokens)
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens")
                    result.cached_tokens = int(cached) if cached is not None else None
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    finally:
        result.end = time.perf_counter()
    if not result.output_tokens:
        result.output_tokens = sum(result.chunk_tokens)
    result.token_ids = ids if has_ids else None
    result.text = "".join(text)
    if not result.chunk_times:
        result.error = "the stream carried no output tokens"
        return result
    result.ok = True
    return result
