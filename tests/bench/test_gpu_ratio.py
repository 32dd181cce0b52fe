"""The GPU-ratio measurement (benchmarks/gpu_ratio.py): the GPU node's ratios, this machine's
loads from the arena and from lmdb with its pages dropped, and the engine's prefill time per
token on the GPU-ratio model served by a real vLLM server."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.gpu_ratio import (
    LoadCosts,
    PageCacheDropper,
    gpu_ratios,
    measure_arena_load,
    measure_loads,
    measure_prefill,
    ratios,
)
from benchmarks.gpu_ratio_fit import fit_on_server, nearest
from benchmarks.harness.sizes import KiB, MiB
from benchmarks.models import GPU_RATIO
from benchmarks.serving_gpu_ratio import prefill_prompts
from tests.fixtures import models
from tests.fixtures.servers import VllmServer

pytestmark = pytest.mark.timeout(600)  # a vLLM server starts in minutes on a busy machine


def test_the_gpu_node_recomputes_16_times_an_arena_load_and_1_3_times_an_nvme_read() -> None:
    gpu = gpu_ratios(256)
    assert gpu["cpu"] == pytest.approx(16, rel=0.05)
    assert gpu["lmdb"] == pytest.approx(1.3, rel=0.05)
    assert gpu["object"] < 1


def test_a_ratio_within_2x_of_the_gpus_counts_and_one_past_it_does_not() -> None:
    gpu = gpu_ratios(128)
    loads = LoadCosts(arena_s_per_token=1e-6, lmdb_cold_s_per_token=1e-5, dropped_by="fadvise")
    near = ratios(gpu["cpu"] * 1.9e-6, loads, 128)
    assert near["within_gpu_window"] == {"cpu": True, "lmdb": False}  # lmdb: 1.9 * 16 / 10
    fast_arena = LoadCosts(arena_s_per_token=1e-7, lmdb_cold_s_per_token=1e-5, dropped_by="")
    far = ratios(gpu["lmdb"] * 1e-5, fast_arena, 128)
    assert far["within_gpu_window"] == {"cpu": False, "lmdb": True}  # cpu: 1.3 * 100
    assert far["recompute_vs_load_here"]["lmdb"] == pytest.approx(gpu["lmdb"])


def test_loads_are_timed_from_the_arena_and_from_lmdb_with_its_pages_dropped() -> None:
    # measure_loads checks that every load returns the bytes stored
    loads = measure_loads(16 * KiB, 128, total_bytes=8 * MiB, reps=1)
    assert loads.dropped_by in ("drop_caches", "fadvise")
    for seconds in (loads.arena_s_per_token, loads.lmdb_cold_s_per_token):
        assert math.isfinite(seconds)
        assert 0 < seconds < 1e-3


def test_the_dropper_drops_the_page_cache_until_it_is_left(tmp_path: Path) -> None:
    data = tmp_path / "data.mdb"
    data.write_bytes(b"x" * 4096)
    with PageCacheDropper(data, interval_s=0.01) as dropper:
        deadline = time.monotonic() + 30
        while dropper.drops < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert dropper.drops >= 2
    assert dropper.dropped_by in ("drop_caches", "fadvise")
    after = dropper.drops
    time.sleep(0.05)
    assert dropper.drops == after  # its thread is gone


@pytest.fixture(scope="module")
def gpu_ratio_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("gpu-ratio-model")
    model = models.build_gpu_ratio_llama(root, tokenizer_dir=models.build_tokenizer(root))
    server = VllmServer(
        model,
        tmp_path_factory.mktemp("gpu-ratio-server"),
        kv_cache_bytes=GPU_RATIO.kv_cache_bytes,
        max_model_len=GPU_RATIO.max_model_len,
        dtype=GPU_RATIO.dtype,
    )
    with server:
        yield server.url, model


def test_the_gpu_ratio_model_keeps_16_kib_of_fp32_kv_a_token(
    gpu_ratio_server: tuple[str, Path],
) -> None:
    assert models.kv_bytes_per_token(gpu_ratio_server[1]) == 2 * 8 * 128 * 2 * 4


def test_prefill_time_per_token_comes_from_the_engine(
    gpu_ratio_server: tuple[str, Path],
) -> None:
    url, model = gpu_ratio_server
    prompts = {
        length: models.shared_prefix_prompts(
            3, prefix_len=length, suffix_len=0, num_prefixes=3, seed=length
        )
        for length in (32, 512)
    }
    prefill = measure_prefill(url, str(model), prompts)  # one prefill counted per request
    assert (prefill["short_tokens"], prefill["long_tokens"]) == (32, 512)
    assert prefill["prefill_s_short"] > 0
    assert prefill["prefill_s_long"] > 0
    assert prefill["prefill_s_per_token"] == pytest.approx(
        (prefill["prefill_s_long"] - prefill["prefill_s_short"]) / 480
    )


def test_the_document_length_is_fitted_to_the_engines_prefill_time(
    gpu_ratio_server: tuple[str, Path],
) -> None:
    url, model = gpu_ratio_server
    vocab = models.vocab_size_of(model)
    arena_s = measure_arena_load(16 * KiB, 128, total_bytes=8 * MiB, reps=1)
    found = fit_on_server(
        url, model, lambda long: prefill_prompts(vocab, long), arena_s, GPU_RATIO, 128, (128, 448)
    )
    ratio = found.arena_ratio_by_doc
    assert sorted(ratio) == [128, 448]
    assert all(math.isfinite(r) and r > 0 for r in ratio.values())
    assert found.doc_tokens == nearest(ratio, found.gpu_arena_ratio)
    assert found.arena_s_per_token == arena_s
