"""The multimodal workload of `kvtier bench serve` against real vLLM servers of a tiny
vision-language model with kvtier's encoder cache: users ask about a shared set of images, and
a restarted server loads the encoder outputs the first one stored."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvtier.bench import BenchConfig, WorkloadSpec
from kvtier.bench.runner import run_level
from kvtier.bench.scrape import parse_counters, total
from kvtier.bench.workloads import ChatSession
from tests.bench.servers import vllm_server
from tests.fixtures.vision_models import build_idefics3

pytestmark = pytest.mark.timeout(300)

SPEC = WorkloadSpec(
    kind="multimodal",
    doc_tokens=40,
    question_tokens=8,
    answer_tokens=4,
    rounds=3,
    images=3,
    image_side=112,
    image_tokens=16,
    seed=5,
)


def test_sessions_ask_about_a_shared_set_of_images_after_text_of_their_own() -> None:
    sessions = SPEC.sessions(7, "level/0")
    assert [s.rounds for s in sessions] == [3, 3, 1]
    assert all(isinstance(s, ChatSession) for s in sessions)
    chats = [s for s in sessions if isinstance(s, ChatSession)]
    assert {i for s in chats for i in s.images} <= set(range(SPEC.images))
    texts = [s.chat_prompt(0)[0] for s in chats]
    assert len(set(texts)) == len(texts)  # no two users share their text
    first = chats[0]
    first.record_text(0, "an answer")
    assert first.chat_prompt(1)[0].startswith(f"{texts[0]} an answer")
    again = SPEC.sessions(7, "level/0")[1]
    assert isinstance(again, ChatSession)
    assert again.chat_prompt(0) == chats[1].chat_prompt(0)  # the same seed, the same prompts
    assert SPEC.longest_request() == 40 + 2 * (8 + 4) + 8 + 16 + 4


def encoder_items(url: str, result: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        samples = parse_counters(r.read().decode())
    return total(samples, "vllm:kvtier_encoder_items_total", result=result)


def test_a_restarted_server_loads_the_outputs_the_first_one_stored(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, shm_path: Path
) -> None:
    model = build_idefics3(tmp_path_factory.mktemp("vlm"))
    config = tmp_path / "kvtier.yaml"
    arena = {"path": str(shm_path), "size_bytes": "64MiB", "extent_bytes": "2MiB"}
    tree = {"arena": {**arena, "min_slot_bytes": "4KiB"}, "lmdb": {"path": str(tmp_path / "lmdb")}}
    config.write_text(yaml.safe_dump(tree))
    ec = {
        "ec_connector": "KVTierECConnector",
        "ec_connector_module_path": "kvtier_vllm.ec_connector",
        "ec_role": "ec_both",
        "ec_connector_extra_config": {
            "kvtier_config": str(config),
            "part_kib": 4,
            "verify_sample_rate": 0,  # a sampled hit is encoded: hits stay countable
        },
    }
    args = ["--ec-transfer-config", json.dumps(ec), "--limit-mm-per-prompt", '{"image": 1}']
    for run, (requests, result) in enumerate(((6, "stored"), (6, "hit"))):
        home = tmp_path_factory.mktemp(f"mm{run}")  # short: vLLM's sockets live under it
        with vllm_server(model, home, max_model_len=2048, args=args) as url:
            level = run_level(BenchConfig(url=url, workload=SPEC, requests=requests), 2, index=run)
            assert level.ok == requests, level.error_messages
            assert level.ttft_s.p50 > 0
            # a server with kvtier's encoder cache splits its first tokens' time too (no KV
            # connector: no load wait)
            parts = level.server.ttft_parts
            assert set(parts) == {"queue", "prefill", "ttft"}
            for part in parts.values():
                assert part["requests"] == requests
                assert min(part["mean_s"] or -1.0, part["p90_s"] or -1.0) >= 0, part
            # the first server encodes each image once; the second loads from lmdb what the
            # first one stored (and stores an image of the set the first one never saw)
            assert encoder_items(url, result) >= 1
