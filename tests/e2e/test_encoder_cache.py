"""KVTierECConnector on a real vLLM engine: a tiny Idefics3 built locally, its encoder outputs
stored in kvtier's tiers and loaded back by fresh engines, with the greedy outputs of vLLM
alone.

Each image is asked about after a text the engine has not seen, so no KV covers the image and
the encoder would run: only the encoder cache spares it.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kvtier.core.blockfmt import peek_header
from kvtier.core.errors import ConfigError
from kvtier.core.keys import Pool
from kvtier.tiers.lmdb_reader import DATABASES
from tests.e2e.conftest import deploy, set_engine_env
from tests.e2e.models import BLOCK_SIZE, counter, greedy, running_llm
from tests.e2e.test_connector import NO_VERIFICATION, embedded_yaml, kvtier_config
from tests.e2e.test_connector_objstore import node_yaml
from tests.fixtures.vision_models import colour_blocks, image_prompt
from tests.integration.daemon_harness import DaemonFiles, Processes
from tests.objstore.fixtures import AwsIrsa

MAX_TOKENS = 8
MM_LIMITS = {"image": 1}
Case = tuple[str, int]
"""A question and the seed of the image asked about after it."""

FIRST: list[Case] = [("Tell me what you see here.", 1), ("A picture:", 2)]
LATER: list[Case] = [("Something else entirely, please look", 1), ("Again, now", 2)]
LONG_QUESTION = " ".join(["Look closely at the colours and the shapes in it."] * 8)
"""Whole blocks of text before the image: their KV is shared by any image after them."""
ASKED, SWAPPED = (LONG_QUESTION, 1), (LONG_QUESTION, 2)


def request(case: Case) -> dict[str, Any]:
    """The question, the image, and the question again (text on both sides of the image)."""
    question, seed = case
    return {
        "prompt": image_prompt(question, after=question),
        "multi_modal_data": {"image": colour_blocks(seed, 96)},
    }


def ask(llm: Any, cases: Sequence[Case]) -> list[list[int]]:
    """Greedy tokens for each case, one request at a time (each image is new to the request)."""
    tokens = []
    for case in cases:
        out = llm.generate([request(case)], greedy(MAX_TOKENS), use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
    return tokens


@pytest.fixture(scope="module")
def alone(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[Case, list[int]]:
    """vLLM alone: every case's tokens."""
    with pytest.MonkeyPatch.context() as mp:
        set_engine_env(mp, tmp_path_factory.mktemp("alone"))
        with running_llm(vlm, limit_mm_per_prompt=MM_LIMITS) as llm:
            cases = [*FIRST, *LATER, ASKED, SWAPPED]
            return dict(zip(cases, ask(llm, cases), strict=True))


def ec_config(extra: dict[str, Any], role: str = "ec_both") -> dict[str, Any]:
    """No hit is sampled (served as a miss) unless ``extra`` says otherwise: counts of hits
    stay exact."""
    return {
        "ec_connector": "KVTierECConnector",
        "ec_connector_module_path": "kvtier_vllm.ec_connector",
        "ec_role": role,
        "ec_connector_extra_config": {**NO_VERIFICATION, **extra},
    }


def counters(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.ec_connector._scheduler.counters


def run_engine(
    model: Path, ec: dict[str, Any], cases: Sequence[Case], **kwargs: Any
) -> tuple[list[list[int]], Any]:
    with running_llm(model, limit_mm_per_prompt=MM_LIMITS, ec_transfer_config=ec, **kwargs) as llm:
        tokens = ask(llm, cases)
        return tokens, counters(llm)


def expected(alone: dict[Case, list[int]], cases: Sequence[Case]) -> list[list[int]]:
    return [alone[case] for case in cases]


@pytest.fixture
def embedded(tmp_path: Path, shm_path: Path) -> dict[str, Any]:
    # 4 KiB parts: an output of 16 rows of 128 float32 is two parts
    return ec_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path)), "part_kib": 4})


def test_embedded_a_fresh_engine_loads_what_another_stored(
    vlm: Path, alone: dict[Case, list[int]], embedded: dict[str, Any]
) -> None:
    tokens, seen = run_engine(vlm, embedded, FIRST)
    assert tokens == expected(alone, FIRST)
    assert seen.stores == 2
    assert seen.hits == 0
    assert seen.stored_bytes == 2 * 16 * 128 * 4  # two outputs of 16 rows of 128 float32
    # the arena ended with the engine: its outputs wait in lmdb, read from its map
    with running_llm(vlm, limit_mm_per_prompt=MM_LIMITS, ec_transfer_config=embedded) as llm:
        tokens = ask(llm, LATER)
        seen = counters(llm)
        hits = counter(llm, "vllm:kvtier_encoder_items", pool="encoder", result="hit")
        loaded = counter(llm, "vllm:kvtier_encoder_bytes", pool="encoder", direction="load")
        loaded_s = counter(llm, "vllm:kvtier_encoder_load_seconds", pool="encoder")
    assert tokens == expected(alone, LATER)
    assert seen.hits == 2
    assert seen.lmdb_loads == 2
    assert seen.promotions == 0  # no request waited for one
    assert seen.stores == 0
    assert hits == 2  # vLLM's own /metrics
    assert loaded == seen.loaded_bytes == 2 * 16 * 128 * 4
    assert loaded_s == pytest.approx(seen.load_seconds)  # timed with the bytes, read whole
    assert loaded_s > 0


def test_a_corrupt_part_is_never_served(
    vlm: Path, alone: dict[Case, list[int]], embedded: dict[str, Any], tmp_path: Path
) -> None:
    run_engine(vlm, embedded, FIRST[:1])
    damaged = garble_encoder_chunks(tmp_path / "lmdb")
    assert damaged == 2  # both parts of the one output
    tokens, seen = run_engine(vlm, embedded, LATER[:1])
    assert tokens == expected(alone, LATER[:1])
    assert seen.hits == 0
    assert seen.stores == 1


def garble_encoder_chunks(path: Path) -> int:
    """Flip a payload byte of every encoder chunk in lmdb; how many were flipped."""
    env = lmdb.open(str(path), max_dbs=len(DATABASES))
    chunks = env.open_db(b"chunks")
    flipped = 0
    with env.begin(write=True, db=chunks) as txn:
        for key, value in list(txn.cursor()):
            if peek_header(value).pool is not Pool.ENCODER:
                continue
            data = bytearray(value)
            data[-1] ^= 0xFF
            txn.put(key, bytes(data))
            flipped += 1
    env.close()
    return flipped


def test_another_encoder_build_under_the_same_path_misses(
    vlm: Path, vlm_other_build: Path, embedded: dict[str, Any], tmp_path: Path
) -> None:
    served = tmp_path / "served"
    deploy(vlm, served)
    run_engine(served, embedded, FIRST[:1])
    deploy(vlm_other_build, served)
    _, seen = run_engine(served, embedded, LATER[:1])
    assert seen.hits == 0
    assert seen.stores == 1


def test_a_second_engine_on_kvtierd_hits_the_first_ones_outputs(
    vlm: Path, alone: dict[Case, list[int]], procs: Processes, daemon_files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(daemon_files)
    sidecar = ec_config(
        {"mode": "sidecar", "socket_path": str(daemon_files.socket), "part_kib": 64}
    )
    tokens, seen = run_engine(vlm, sidecar, FIRST)
    assert tokens == expected(alone, FIRST)
    assert seen.stores == 2
    # what `kvtier stats` shows: the pool, in the arena
    (cpu,) = [tier for tier in daemon.stats().tiers if tier.tier == "cpu"]
    pools = {pool.pool: pool.usage.chunks for pool in cpu.pools}
    assert pools["encoder"] == 2  # one 64 KiB part per output
    # the daemon's arena outlived the first engine: straight hits, nothing to promote
    tokens, seen = run_engine(vlm, sidecar, LATER)
    assert tokens == expected(alone, LATER)
    assert seen.hits == 2
    assert seen.promotions == 0


def test_without_kvtierd_the_encoder_runs(
    vlm: Path, alone: dict[Case, list[int]], daemon_files: DaemonFiles
) -> None:
    sidecar = ec_config({"mode": "sidecar", "socket_path": str(daemon_files.socket)})
    tokens, seen = run_engine(vlm, sidecar, FIRST)
    assert tokens == expected(alone, FIRST)
    assert seen.hits == 0
    assert seen.stores == 0


@pytest.mark.slow
def test_a_node_with_lmdb_wiped_gets_outputs_from_the_object_store(
    vlm: Path,
    alone: dict[Case, list[int]],
    tmp_path: Path,
    shm_path: Path,
    s3_store: str,
    aws_irsa: AwsIrsa,
) -> None:
    first = ec_config(
        {"kvtier_config": str(node_yaml(tmp_path / "a", shm_path, s3_store)), "part_kib": 4}
    )
    run_engine(vlm, first, FIRST)
    shutil.rmtree(tmp_path / "a" / "lmdb")
    other = ec_config(
        {"kvtier_config": str(node_yaml(tmp_path / "b", shm_path, s3_store)), "part_kib": 4}
    )
    with running_llm(vlm, limit_mm_per_prompt=MM_LIMITS, ec_transfer_config=other) as llm:
        tokens = ask(llm, LATER)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.ec_connector._scheduler
        seen, tiers = scheduler.counters, scheduler.session.client.stats().counters
    assert tokens == expected(alone, LATER)
    assert seen.hits == 2
    # each output came from the store by one of two routes, as the store's catalog learns of
    # the other node's uploads in the background: a probe brought its parts into lmdb (loaded
    # from its map), or the catalog held them already and they were promoted through lmdb
    assert seen.lmdb_loads + seen.promotions == 2
    assert seen.misses == 0
    assert tiers["hit_chunks_object"] == 4  # two parts each, counted as the store's


def test_the_same_text_with_another_image_never_hits_the_first_images_kv(
    vlm: Path, tmp_path: Path, shm_path: Path, alone: dict[Case, list[int]]
) -> None:
    kv = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    with running_llm(vlm, limit_mm_per_prompt=MM_LIMITS, kv_transfer_config=kv) as llm:
        assert ask(llm, [ASKED]) == [alone[ASKED]]
    for case in (SWAPPED, ASKED):  # a fresh engine each: every hit is kvtier's
        with running_llm(vlm, limit_mm_per_prompt=MM_LIMITS, kv_transfer_config=kv) as llm:
            out = llm.generate([request(case)], greedy(MAX_TOKENS), use_tqdm=False)[0]
            image_token = llm.get_tokenizer().convert_tokens_to_ids("<image>")
            image_at = out.prompt_token_ids.index(image_token)
            cached = out.num_cached_tokens or 0
        assert list(out.outputs[0].token_ids) == alone[case]
        if case == SWAPPED:  # the text's whole blocks hit, nothing from the image on
            assert BLOCK_SIZE <= cached <= image_at
        else:  # the same image: the hit runs past it
            assert cached > image_at


def test_a_wrong_setting_is_named(vlm: Path, tmp_path: Path, shm_path: Path) -> None:
    bad = ec_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path)), "parts_kib": 4})
    with pytest.raises(Exception, match=r"ec_connector_extra_config\.parts_kib"):
        run_engine(vlm, bad, [])
    with pytest.raises(ValueError, match="ec_sender"):
        run_engine(vlm, ec_config({}, role="ec_sender"), [])


def test_config_errors_are_config_errors() -> None:
    from kvtier_vllm.encoder.settings import parse

    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.part_kib"):
        parse({"part_kib": 1})


def test_sampled_hits_are_encoded_and_compared(
    vlm: Path, alone: dict[Case, list[int]], tmp_path: Path, shm_path: Path
) -> None:
    path = str(embedded_yaml(tmp_path, shm_path))
    run_engine(vlm, ec_config({"kvtier_config": path, "part_kib": 4}), FIRST)
    checked = ec_config({"kvtier_config": path, "part_kib": 4, "verify_sample_rate": 1.0})
    with running_llm(vlm, limit_mm_per_prompt=MM_LIMITS, ec_transfer_config=checked) as llm:
        tokens = ask(llm, LATER)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.ec_connector._scheduler
        seen, quarantined = scheduler.counters, dict(scheduler.quarantined)
    assert tokens == expected(alone, LATER)
    assert seen.sampled == 2  # every hit encoded anyway and compared: the same output
    assert seen.compared == 2
    assert seen.hits == 0
    assert quarantined == {}


def test_both_connectors_embedded_share_one_arena(
    vlm: Path, alone: dict[Case, list[int]], tmp_path: Path, shm_path: Path
) -> None:
    path = str(embedded_yaml(tmp_path, shm_path))
    both = {
        "kv_transfer_config": kvtier_config({"kvtier_config": path}),
        "ec_transfer_config": ec_config({"kvtier_config": path, "part_kib": 4}),
    }
    for cases, stores in ((FIRST, 2), (LATER, 0)):
        with running_llm(vlm, limit_mm_per_prompt=MM_LIMITS, **both) as llm:
            tokens = ask(llm, cases)
            seen = counters(llm)
        assert tokens == expected(alone, cases)
        assert seen.stores == stores
    assert seen.hits == 2  # the encoder cache's tiers opened beside the KV connector's


def test_a_consumer_loads_and_stores_nothing_a_producer_on_this_runner_stores_nothing(
    vlm: Path, alone: dict[Case, list[int]], tmp_path: Path, shm_path: Path
) -> None:
    extra = {"kvtier_config": str(embedded_yaml(tmp_path, shm_path)), "part_kib": 4}
    # vLLM's V1 model runner (the CPU build's) drops an encode-only engine's worker reports:
    # what it wrote is never committed unseen, so it stores nothing (and says so)
    with running_llm(
        vlm, limit_mm_per_prompt=MM_LIMITS, ec_transfer_config=ec_config(extra, "ec_producer")
    ) as llm:
        for case in FIRST:
            llm.generate([request(case)], greedy(MAX_TOKENS), use_tqdm=False)
        produced = counters(llm)
    assert produced.stored_bytes == 0
    _, seen = run_engine(vlm, ec_config(extra, "ec_consumer"), FIRST[:1])
    assert seen.hits == 0
    assert seen.stores == 0  # a consumer never stores
    run_engine(vlm, ec_config(extra), FIRST)  # ec_both stores
    tokens, seen = run_engine(vlm, ec_config(extra, "ec_consumer"), LATER)
    assert tokens == expected(alone, LATER)
    assert seen.hits == 2


def test_a_sampled_hit_of_other_weights_quarantines_the_namespace(
    vlm: Path, vlm_other_build: Path, tmp_path: Path, shm_path: Path
) -> None:
    served = tmp_path / "served"
    path = str(embedded_yaml(tmp_path, shm_path))
    # an operator names the encoder and forgets to rename it when its weights change
    named = {"kvtier_config": path, "part_kib": 4, "encoder_revision": "vision-r1"}
    deploy(vlm, served)
    run_engine(served, ec_config(named), FIRST)
    deploy(vlm_other_build, served)
    with running_llm(vlm_other_build, limit_mm_per_prompt=MM_LIMITS) as llm:
        alone = ask(llm, LATER)
    checked = ec_config({**named, "verify_sample_rate": 1.0})
    with running_llm(served, limit_mm_per_prompt=MM_LIMITS, ec_transfer_config=checked) as llm:
        tokens = ask(llm, LATER)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.ec_connector._scheduler
        seen, quarantined = scheduler.counters, dict(scheduler.quarantined)
    assert tokens == alone  # sampled: encoded, never served
    assert seen.compared >= 1
    assert seen.mismatched >= 1
    assert len(quarantined) == 1
    assert seen.hits == 0  # past the first mismatch, nothing more is loaded from it
