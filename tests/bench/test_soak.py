"""The soak benchmark's short schedule, run as a user runs it (``--quick --json``): three real
kvtierd nodes on one moto bucket through model switches, side pools, killed lmdb readers, a full
disk and a SIGKILLed kvtierd. After it, no tier takes no new chunks and no node has deleted an
object another node uploaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EVENTS = {
    "model_switch",
    "draft_revision",
    "hidden_on",
    "hidden_off",
    "encoder_on",
    "encoder_off",
    "reader_kill",
    "kvtierd_kill",
}
EVENT_FIELDS = {
    "count",
    "recovery_s_max",
    "recovery_s_median",
    "not_recovered",
    "refused_stores_with_room",
    "refused_stores",
    "lmdb_store_rejected",
    "disk_full_errors",
    "stale_readers_cleared",
    "foreign_objects_deleted",
    "bytes_above_budget_max",
    "wedged",
}
VITALS = {
    "rss_bytes",
    "own_bytes",
    "open_files",
    "lmdb_map_bytes",
    "event_log_bytes",
    "namespaces",
    "slot_classes",
    "free_extents",
}
TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def quick_run() -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "connectors"), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--quick", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    figures: dict[str, Any] = json.loads(done.stdout)
    return figures


@pytest.mark.slow  # about a minute: three kvtierd, moto, a dozen events
def test_quick_soak_reports_every_event_and_each_nodes_vitals(quick_run: dict) -> None:
    assert quick_run["mode"] == "quick"
    events = quick_run["events"]
    expected = EVENTS | ({"disk_full"} if quick_run["tmpfs"] else set())
    assert set(events) == expected
    for name, row in events.items():
        assert set(row) == EVENT_FIELDS, name
        assert row["count"] >= 1, name
    assert quick_run["model_switches"] == events["model_switch"]["count"] >= 4
    assert 0 < quick_run["steady_hit_rate"] <= 1
    for when in ("start", "end"):
        nodes = quick_run["vitals"][when]
        assert set(nodes) == {"node0", "node1", "node2"}
        for vitals in nodes.values():
            assert set(vitals) == VITALS
            assert vitals["rss_bytes"] > 0
            assert vitals["open_files"] > 0
            assert vitals["namespaces"] >= 1  # the probe model's, at least
            assert vitals["slot_classes"] >= 1
    assert quick_run["vitals"]["end"]["node0"]["event_log_bytes"] > 0
    assert set(quick_run["targets"]) >= {"wedged_tiers", "foreign_objects_deleted"}


@pytest.mark.slow
def test_no_tier_is_left_wedged(quick_run: dict) -> None:
    wedged = list(quick_run["wedged"])
    wedged += [
        f"after {event}: {tier}"
        for event, row in quick_run["events"].items()
        for tier in row["wedged"]
    ]
    assert quick_run["wedged_tiers"] == 0, wedged


@pytest.mark.slow
def test_no_node_deletes_an_object_another_node_uploaded(quick_run: dict) -> None:
    per_event = {k: v["foreign_objects_deleted"] for k, v in quick_run["events"].items()}
    assert quick_run["foreign_objects_deleted"] == 0, (per_event, quick_run["foreign_examples"])


@pytest.mark.slow
def test_no_node_keeps_more_in_the_bucket_than_its_budget_and_one_pack(quick_run: dict) -> None:
    per_node = quick_run["bytes_above_budget_by_node"]
    assert quick_run["targets"]["bytes_above_budget_max"]["met"], per_node
