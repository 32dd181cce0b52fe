"""The GPU-ratio workload's document length fitted to a machine (benchmarks/gpu_ratio_fit.py):
the length whose recompute:load ratio lies nearest the GPU node's, and the servers' sizes scaled
to it. The engine's part runs in tests/bench/test_gpu_ratio.py."""

from __future__ import annotations

import pytest

from benchmarks.gpu_ratio import gpu_ratios
from benchmarks.gpu_ratio_fit import DocFit, fit, nearest, sized_to
from benchmarks.models import GPU_RATIO
from benchmarks.serving_gpu_ratio import SHORT_PROMPT, prefill_prompts

ARENA_S = 2e-6


def attention_bound(us_at_zero: float, us_per_context_token: float):  # type: ignore[no-untyped-def]
    """A prefill time per token that grows with the prompt, as attention's does."""
    return lambda doc: (us_at_zero + us_per_context_token * doc) * 1e-6


def test_the_nearest_ratio_is_by_factor_and_a_tie_goes_to_the_longer_document() -> None:
    assert nearest({128: 8.0, 256: 40.0}, 16.0) == 128  # 2x under against 2.5x over
    assert nearest({128: 8.0, 256: 32.0}, 16.0) == 256  # 2x either way
    assert nearest({128: 15.0, 256: 17.0, 512: 60.0}, 16.0) == 256


def test_a_slow_cpus_prompts_are_shortened_and_a_fast_ones_kept_long() -> None:
    gpu = gpu_ratios(128)["cpu"]
    slow = fit(attention_bound(10.0, 0.2), ARENA_S, 128)  # ratio 17.8 at 128, 101 at 960
    assert slow.doc_tokens == 128
    assert slow.within_gpu_window
    assert slow.arena_ratio_by_doc[960] == pytest.approx((10 + 0.2 * 960) / 2)
    assert slow.gpu_arena_ratio == pytest.approx(gpu)
    fast = fit(attention_bound(4.0, 0.03), ARENA_S, 128)  # 16.4 at 960
    assert fast.doc_tokens == 960
    assert "960 tokens, fitted" in fast.describe()
    assert "within 2x" in fast.describe()


def test_a_machine_where_no_length_reaches_the_window_is_said_to_be_outside_it() -> None:
    found = fit(attention_bound(200.0, 0.5), ARENA_S, 128)  # 132 at the shortest
    assert found.doc_tokens == 128
    assert not found.within_gpu_window
    assert "outside 2x" in found.describe()


def test_a_length_asked_for_is_not_fitted() -> None:
    asked = DocFit(384)
    assert not asked.within_gpu_window
    assert asked.describe() == "Documents of 384 tokens, as asked (not fitted)."


def longest(doc: int) -> int:
    """The multi-round workload's longest request: the document, 4 rounds of a 32-token question
    and 3 answers before the last one's."""
    return doc + 4 * 32 + 4 * 32


def test_the_kv_cache_and_model_length_scale_with_the_longest_request() -> None:
    short = sized_to(GPU_RATIO, 128, longest)
    scale = longest(128) / longest(GPU_RATIO.doc_tokens)
    assert short.doc_tokens == 128
    assert short.kv_cache_bytes == pytest.approx(GPU_RATIO.kv_cache_bytes * scale, abs=1)
    assert longest(128) <= short.max_model_len <= GPU_RATIO.max_model_len * scale + 1
    assert (short.question_tokens, short.answer_tokens) == (32, 32)
    same = sized_to(GPU_RATIO, GPU_RATIO.doc_tokens, longest)
    assert same == GPU_RATIO


def test_shorter_documents_get_levels_that_send_as_many_prompt_tokens() -> None:
    short = sized_to(GPU_RATIO, 128, longest)  # 384-token requests against 1,216
    assert short.level_scale == 4
    assert sized_to(GPU_RATIO, 704, longest).level_scale == 2
    assert sized_to(GPU_RATIO, GPU_RATIO.doc_tokens, longest).level_scale == 1


def test_documents_past_what_the_model_holds_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        sized_to(GPU_RATIO, 4096, lambda doc: 2 * doc)


def test_each_length_is_measured_against_short_prompts_no_other_length_cached() -> None:
    first, second = prefill_prompts(1000, 192), prefill_prompts(1000, 256)
    shorts = [tuple(p) for p in first[SHORT_PROMPT] + second[SHORT_PROMPT]]
    assert len(set(shorts)) == len(shorts)
    firsts = {tuple(p[:32]) for p in first[SHORT_PROMPT] + first[192]}
    assert len(firsts) == len(first[SHORT_PROMPT]) + len(first[192])  # no shared prefix
    assert prefill_prompts(1000, 192) == first  # the same run measures the same prompts
