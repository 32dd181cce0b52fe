"""Percentiles, inter-token gaps and the hit ratios read from Prometheus text."""

from __future__ import annotations

import math

import pytest

from kvtier.bench.scrape import Histogram, delta, histogram, parse_counters, server_counters
from kvtier.bench.stats import Percentiles, inter_token_gaps, percentile, rate


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile(values, 101)


def test_percentiles_of() -> None:
    p = Percentiles.of([1.0, 2.0, 3.0])
    assert (p.p50, p.mean) == (2.0, 2.0)
    assert p.p99 == pytest.approx(2.98)


def test_inter_token_gaps_split_a_chunk_of_several_tokens() -> None:
    gaps = inter_token_gaps([0.0, 0.1, 0.4], [1, 1, 3])
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert inter_token_gaps([0.5], [4]) == []


def test_rate() -> None:
    assert rate(10, 2.0) == 5.0
    assert math.isnan(rate(10, 0.0))


PAGE = """\
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} %(prompt)s
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prompt_tokens_cached_by_source counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} %(device)s
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} %(host)s
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} %(ok)s
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 0
# TYPE vllm:kvtier_transfer_chunks counter
vllm:kvtier_transfer_chunks_total{engine="0",model_name="m",direction="load",pool="p"} %(load)s
# TYPE vllm:kvtier_hook_seconds counter
vllm:kvtier_hook_seconds_total{engine="0",model_name="m",hook="start_load_kv"} %(hook)s
# TYPE vllm:kvtier_verify_requests counter
vllm:kvtier_verify_requests_total{engine="0",model_name="m",outcome="sampled"} %(sampled)s
vllm:kvtier_verify_requests_total{engine="0",model_name="m",outcome="served"} %(served)s
"""

DAEMON = """\
# TYPE kvtier_lookup_chunks counter
kvtier_lookup_chunks_total{pool="p",replica="r"} %(lookups)s
# TYPE kvtier_hit_chunks counter
kvtier_hit_chunks_total{tier="cpu",pool="p",replica="r"} %(cpu)s
kvtier_hit_chunks_total{tier="lmdb",pool="p",replica="r"} %(lmdb)s
"""


def test_hit_ratio_by_source_from_a_before_after_delta() -> None:
    first = {"prompt": 100, "device": 10, "host": 0, "ok": 2, "load": 0, "hook": 0.25}
    first |= {"sampled": 1, "served": 9}
    before = parse_counters(PAGE % first)
    second = {"prompt": 500, "device": 110, "host": 200, "ok": 6, "load": 7, "hook": 1.0}
    second |= {"sampled": 2, "served": 48}
    after = parse_counters(PAGE % second)
    d_before = parse_counters(DAEMON % {"lookups": 10, "cpu": 1, "lmdb": 0})
    d_after = parse_counters(DAEMON % {"lookups": 30, "cpu": 11, "lmdb": 5})
    c = server_counters(delta(before, after), delta(d_before, d_after), model="m")
    assert c.prompt_tokens == 400
    assert c.requests_succeeded == 4
    assert c.cached_tokens_by_source == {"device": 100, "host": 200}
    assert c.hit_ratio == pytest.approx(0.75)
    assert c.hit_ratio_by_source == pytest.approx({"device": 0.25, "host": 0.5})
    assert c.connector_chunks == {"load": 7}
    assert c.connector_hook_seconds == {"start_load_kv": 0.75}
    assert c.verify_draws == {"sampled": 1, "served": 39}
    assert c.realized_sample_rate == pytest.approx(1 / 40)
    assert c.daemon_hit_chunks_by_tier == {"cpu": 10, "lmdb": 5}
    assert c.daemon_hit_ratio == pytest.approx(0.75)


HISTOGRAMS = """\
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.1",model_name="m"} %(q1)s
vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="m"} %(q5)s
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} %(n)s
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} %(n)s
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} %(qsum)s
vllm:request_queue_time_seconds_bucket{engine="0",le="0.1",model_name="other"} 50
vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="other"} 50
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="other"} 50
vllm:request_queue_time_seconds_count{engine="0",model_name="other"} 50
vllm:request_queue_time_seconds_sum{engine="0",model_name="other"} 1
# TYPE vllm:kvtier_load_wait_seconds histogram
vllm:kvtier_load_wait_seconds_bucket{engine="0",le="0.01",model_name="m"} %(w1)s
vllm:kvtier_load_wait_seconds_bucket{engine="0",le="0.1",model_name="m"} %(w2)s
vllm:kvtier_load_wait_seconds_bucket{engine="0",le="+Inf",model_name="m"} %(w2)s
vllm:kvtier_load_wait_seconds_count{engine="0",model_name="m"} %(w2)s
vllm:kvtier_load_wait_seconds_sum{engine="0",model_name="m"} %(wsum)s
"""


def test_a_levels_histogram_is_the_delta_of_its_buckets_with_quantiles_from_them() -> None:
    before = {"q1": 5, "q5": 8, "n": 10, "qsum": 4.0, "w1": 1, "w2": 1, "wsum": 0.005}
    after = {"q1": 15, "q5": 26, "n": 30, "qsum": 9.0, "w1": 1, "w2": 5, "wsum": 0.205}
    d = delta(parse_counters(HISTOGRAMS % before), parse_counters(HISTOGRAMS % after))
    queue = histogram(d, "vllm:request_queue_time_seconds", model_name="m")
    # 20 requests: 10 at or below 0.1 s, 8 in (0.1, 0.5], 2 past 0.5
    assert queue == Histogram(bounds=(0.1, 0.5), cumulative=(10, 18), count=20, sum=5.0)
    assert queue.mean == pytest.approx(0.25)
    assert queue.quantile(0.5) == pytest.approx(0.1)  # rank 10: the first bucket's top
    assert queue.quantile(0.25) == pytest.approx(0.05)  # rank 5 of 10 in [0, 0.1]
    assert queue.quantile(0.7) == pytest.approx(0.1 + 0.4 * 4 / 8)  # rank 14: 4 of 8 in it
    assert queue.quantile(0.95) == 0.5  # in the +Inf bucket: the last finite bound
    with pytest.raises(ValueError, match=r"0\.\.1"):
        queue.quantile(90)
    c = server_counters(d, model="m")
    assert c.ttft_histograms["queue"] == queue
    parts = c.ttft_parts
    assert set(parts) == {"queue", "load_wait"}  # only what the page has
    assert parts["load_wait"]["requests"] == 4
    assert parts["load_wait"]["mean_s"] == pytest.approx(0.05)
    # no wait fell at or below 0.01 s: all four lie in (0.01, 0.1], the p90 at 3.6 of them
    assert parts["load_wait"]["p90_s"] == pytest.approx(0.01 + 0.09 * 3.6 / 4)
    assert parts["queue"]["p90_s"] == pytest.approx(0.1 + 0.4 * 8 / 8)


def test_a_histogram_with_no_observation_has_no_mean_or_quantile() -> None:
    empty = Histogram(bounds=(0.1,), cumulative=(0,), count=0, sum=0.0)
    assert empty.mean is None
    assert empty.quantile(0.9) is None
    assert histogram({}, "vllm:request_queue_time_seconds") is None


def test_a_server_without_the_metrics_gives_none() -> None:
    c = server_counters(None)
    assert c.ttft_parts == {}
    assert c.prompt_tokens is None
    assert c.hit_ratio is None
    assert c.daemon_hit_ratio is None
    assert c.realized_sample_rate is None
