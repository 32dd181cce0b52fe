"""The GPU-ratio workload's document length, fitted to this machine before the run.

The GPU-ratio model's compute is mostly attention over the KV it keeps: with as many KV heads as
query heads and fp32 KV, attention does about ``context / 2`` FLOPs for each byte of KV a token
keeps, whatever the heads' count or width. Its prefill time per token therefore grows with the
prompt while a load's does not, and the recompute:load ratio a run measures depends on the
prompts' length as much as on the CPU. On a 2-core EPYC without AVX-512 (2026-12-07) the arena's
ratio was 26 at 128 tokens and 95 at 992; on one with AVX-512 BF16 it was 14-20 at 992. The
prompt's length is the lever left, so unless ``--doc-tokens`` names a length the run starts an
engine first, measures its prefill time per token at each candidate length
(benchmarks/gpu_ratio.py's ``measure_prefill``) and the arena's load time per token, and runs
the workload at the length whose ratio lies nearest the GPU node's, with every server's KV cache
scaled to it.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.gpu_ratio import GPU_WINDOW, gpu_ratios, measure_arena_load, measure_prefill
from benchmarks.models import ServingModel
from tests.fixtures.servers import VllmServer

DOC_LENGTHS = (128, 192, 256, 384, 512, 704, 960)
"""The document lengths tried, in tokens, up to the model's own (960): whole blocks of 32."""


@dataclass(frozen=True)
class DocFit:
    """The document length chosen, the arena ratio measured at each length tried and the GPU
    node's it was fitted to."""

    doc_tokens: int
    arena_ratio_by_doc: dict[int, float] = field(default_factory=dict)
    gpu_arena_ratio: float = 0.0
    arena_s_per_token: float = 0.0

    @property
    def within_gpu_window(self) -> bool:
        ratio = self.arena_ratio_by_doc.get(self.doc_tokens)
        gpu = self.gpu_arena_ratio
        return ratio is not None and gpu / GPU_WINDOW <= ratio <= gpu * GPU_WINDOW

    def describe(self) -> str:
        tried = ", ".join(f"{doc}: {r:.1f}" for doc, r in sorted(self.arena_ratio_by_doc.items()))
        if not tried:
            return f"Documents of {self.doc_tokens} tokens, as asked (not fitted)."
        return (
            f"Documents of {self.doc_tokens} tokens, fitted before the run: the arena's "
            f"recompute:load ratio by document length ({tried}) nearest the GPU node's "
            f"{self.gpu_arena_ratio:.1f} ({'within' if self.within_gpu_window else 'outside'} "
            f"{GPU_WINDOW:g}x of it)."
        )


def nearest(ratio_by_doc: dict[int, float], gpu: float) -> int:
    """The length whose ratio lies nearest ``gpu`` by factor (the longer on a tie: it leaves
    more prefill for a hit to save)."""
    return min(ratio_by_doc, key=lambda doc: (abs(math.log(ratio_by_doc[doc] / gpu)), -doc))


def fit(
    prefill_s_per_token: Callable[[int], float],
    arena_s_per_token: float,
    chunk_tokens: int,
    lengths: Sequence[int] = DOC_LENGTHS,
) -> DocFit:
    """The length of ``lengths`` whose ratio of ``prefill_s_per_token(length)`` to
    ``arena_s_per_token`` is nearest the GPU node's arena ratio at ``chunk_tokens``."""
    gpu = gpu_ratios(chunk_tokens)["cpu"]
    by_doc = {doc: prefill_s_per_token(doc) / arena_s_per_token for doc in lengths}
    return DocFit(nearest(by_doc, gpu), by_doc, gpu, arena_s_per_token)


def sized_to(sizes: ServingModel, doc_tokens: int, longest: Callable[[int], int]) -> ServingModel:
    """``sizes`` with documents of ``doc_tokens``, its KV cache scaled with the longest request
    (``longest(doc_tokens)``): the working set scales with it, and the cache stays the same share
    of it. ``max_model_len`` is what the cache holds, at most the model's own. Shorter requests
    get levels of more users, so that a level sends about the prompt tokens it would at the
    model's own length."""
    scale = longest(doc_tokens) / longest(sizes.doc_tokens)
    kv_cache_bytes = math.ceil(sizes.kv_cache_bytes * scale)
    max_model_len = min(sizes.max_model_len, math.ceil(sizes.max_model_len * scale))
    if longest(doc_tokens) > max_model_len:
        raise ValueError(f"{doc_tokens}-token documents do not fit {max_model_len} tokens")
    return replace(
        sizes,
        doc_tokens=doc_tokens,
        kv_cache_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        level_scale=max(1, math.ceil(1 / scale)),
    )


def fit_on_server(
    url: str,
    model: Path,
    prompts: Callable[[int], dict[int, list[list[int]]]],
    arena_s_per_token: float,
    sizes: ServingModel,
    chunk_tokens: int,
    lengths: Sequence[int] = DOC_LENGTHS,
) -> DocFit:
    """Fits (``fit``) the prefill time per token the server at ``url`` takes over
    ``prompts(prompt_tokens)`` at each of ``lengths``' prompts (a document and a question) that
    fits ``sizes.max_model_len``."""

    def prefill_s(doc: int) -> float:
        long = prompts(doc + sizes.question_tokens)
        return measure_prefill(url, str(model), long)["prefill_s_per_token"]

    fitting = [d for d in lengths if d + sizes.question_tokens <= sizes.max_model_len]
    return fit(prefill_s, arena_s_per_token, chunk_tokens, fitting)


def fit_on_engine(
    sizes: ServingModel,
    model: Path,
    prompts: Callable[[int], dict[int, list[list[int]]]],
    kv_per_token: int,
    chunk_tokens: int,
) -> DocFit:
    """Measures the arena's load time per token, starts vLLM alone on ``model`` at ``sizes``
    and fits its prefill times (``fit_on_server``)."""
    arena_s = measure_arena_load(kv_per_token, chunk_tokens)
    with tempfile.TemporaryDirectory(prefix="kvt-fit-") as tmp:
        kv, max_len = sizes.kv_cache_bytes, sizes.max_model_len
        with VllmServer(
            model, Path(tmp), kv_cache_bytes=kv, max_model_len=max_len, dtype=sizes.dtype
        ) as server:
            return fit_on_server(server.url, model, prompts, arena_s, sizes, chunk_tokens)
