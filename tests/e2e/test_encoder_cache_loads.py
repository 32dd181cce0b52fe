"""KVTierECConnector's loads and the tiers' figures of them, on a real vLLM engine (the tiny
Idefics3 of tests/e2e/test_encoder_cache.py): outputs lmdb holds load from its map, the hits the
arena's index answers reach kvtierd, and a sampled hit is counted as verified, not as a hit."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from tests.e2e.models import running_llm
from tests.e2e.test_connector import embedded_yaml
from tests.e2e.test_encoder_cache import FIRST, LATER, MM_LIMITS, ask, counters, ec_config
from tests.integration.daemon_harness import DaemonFiles, Processes, RunningDaemon, wait_for

ITEMS = len(LATER)
"""Each output is one part (64 KiB parts; 4 KiB parts in embedded mode: two each)."""


def daemon_counts(daemon: RunningDaemon) -> Counter[str]:
    """kvtierd's encoder-pool lookups, as its /metrics page shows them."""
    out: Counter[str] = Counter()
    for name, labels, value in daemon.metrics():
        if labels.get("pool") != "encoder":
            continue
        if name == "kvtier_hit_chunks_total":
            out["hits"] += int(value)
        elif name == "kvtier_verified_chunks_total":
            out["verified"] += int(value)
    return out


def sidecar(daemon_files: DaemonFiles, **extra: Any) -> dict[str, Any]:
    socket = str(daemon_files.socket)
    return ec_config({"mode": "sidecar", "socket_path": socket, "part_kib": 64, **extra})


def served_by_kvtierd(
    vlm: Path, procs: Processes, daemon_files: DaemonFiles, **extra: Any
) -> tuple[Any, Counter[str]]:
    """A fresh engine asking about images another stored through kvtierd, whose arena still
    holds them: its counters, and what kvtierd counted of its lookups."""
    daemon = procs.start_daemon(daemon_files)
    stores = sidecar(daemon_files)
    with running_llm(vlm, limit_mm_per_prompt=MM_LIMITS, ec_transfer_config=stores) as llm:
        ask(llm, FIRST)
    before = daemon_counts(daemon)

    def counted() -> Counter[str]:
        now = daemon_counts(daemon)
        now.subtract(before)
        return now

    config = sidecar(daemon_files, **extra)
    with running_llm(vlm, limit_mm_per_prompt=MM_LIMITS, ec_transfer_config=config) as llm:
        ask(llm, LATER)
        seen = counters(llm)
        # hits the index answered reach kvtierd with a report, at the latest a heartbeat later
        wait_for(lambda: sum(counted().values()) >= ITEMS, 15.0, "encoder lookups reported")
    return seen, counted()


def test_hits_the_arenas_index_answered_are_counted_by_kvtierd(
    vlm: Path, procs: Processes, daemon_files: DaemonFiles
) -> None:
    seen, counted = served_by_kvtierd(vlm, procs, daemon_files)
    assert seen.hits == ITEMS
    assert seen.promotions == 0  # the arena held them: answered from its index
    assert counted["hits"] == ITEMS  # once each
    assert counted["verified"] == 0


def test_sampled_hits_are_counted_as_verified_not_as_hits(
    vlm: Path, procs: Processes, daemon_files: DaemonFiles
) -> None:
    seen, counted = served_by_kvtierd(vlm, procs, daemon_files, verify_sample_rate=1.0)
    assert seen.sampled == ITEMS
    assert seen.hits == 0
    assert counted["verified"] == ITEMS
    assert counted["hits"] == 0


PARTS = 2 * ITEMS
"""Embedded mode's 4 KiB parts: an output of 16 rows of 128 float32 is two."""


def fresh_engine_on_lmdb(
    vlm: Path, tmp_path: Path, shm_path: Path, **extra: Any
) -> tuple[Any, Counter[str]]:
    """Embedded engines on one lmdb: the first stores the images, a fresh one (its arena new:
    the outputs wait in lmdb) asks about them. Its counters, and its tiers' counts of it."""
    path = str(embedded_yaml(tmp_path, shm_path))
    stores = ec_config({"kvtier_config": path, "part_kib": 4})
    with running_llm(vlm, limit_mm_per_prompt=MM_LIMITS, ec_transfer_config=stores) as llm:
        ask(llm, FIRST)
    config = ec_config({"kvtier_config": path, "part_kib": 4, **extra})
    with running_llm(vlm, limit_mm_per_prompt=MM_LIMITS, ec_transfer_config=config) as llm:
        ask(llm, LATER)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.ec_connector._scheduler
        tiers = Counter(scheduler.session.client.stats().counters)
        return scheduler.counters, tiers


def test_a_fresh_engine_loads_what_lmdb_holds_from_its_map(
    vlm: Path, tmp_path: Path, shm_path: Path
) -> None:
    seen, tiers = fresh_engine_on_lmdb(vlm, tmp_path, shm_path)
    assert seen.hits == ITEMS
    assert seen.lmdb_loads == ITEMS
    assert seen.promotions == 0  # nothing waited for a promotion
    assert seen.loaded_bytes == ITEMS * 16 * 128 * 4
    assert tiers["hit_chunks_lmdb"] == PARTS
    assert tiers["verified_chunks"] == 0


def test_without_lmdb_loads_outputs_in_lmdb_are_promoted(
    vlm: Path, tmp_path: Path, shm_path: Path
) -> None:
    seen, _ = fresh_engine_on_lmdb(vlm, tmp_path, shm_path, lmdb_loads=False)
    assert seen.hits == ITEMS
    assert seen.promotions == ITEMS
    assert seen.lmdb_loads == 0


def test_sampled_lookups_of_lmdb_are_counted_as_verified(
    vlm: Path, tmp_path: Path, shm_path: Path
) -> None:
    seen, tiers = fresh_engine_on_lmdb(vlm, tmp_path, shm_path, verify_sample_rate=1.0)
    assert seen.sampled == ITEMS
    assert seen.compared == ITEMS  # read from lmdb's map and compared with the encoder's
    assert seen.mismatched == 0
    assert tiers["verified_chunks"] == PARTS
    assert sum(n for name, n in tiers.items() if name.startswith("hit_chunks_")) == 0
