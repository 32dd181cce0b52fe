"""Writes the Grafana dashboards in this folder from the panel lists below.

    python deploy/grafana/dashboards.py           # rewrite the JSON files
    python deploy/grafana/dashboards.py --check   # exit 1 when a file differs from its source

Queries name only metrics kvtierd exports (and vLLM's own ``vllm:spec_decode_*`` and the
connector's ``vllm:kvtier_*``); the tests in
tests/operability evaluate each of them against a live Prometheus scraping a live kvtierd.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
INST = 'instance=~"$instance"'
RI = "$__rate_interval"
DRAFT = 'pool="draft"'


def rate(metric: str, by: str, where: str = "") -> str:
    sel = f"{INST},{where}" if where else INST
    return (
        f"sum by ({by}) (rate({metric}{{{sel}}}[{RI}]))"
        if by
        else (f"sum(rate({metric}{{{sel}}}[{RI}]))")
    )


def quantile(q: float, metric: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{INST}}}[{RI}])))"


def target(expr: str, legend: str = "", *, table: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto"}
    if table:
        out.update(format="table", instant=True, range=False)
    return out


class Board:
    def __init__(self, uid: str, title: str, variables: list[dict[str, Any]]) -> None:
        self.uid, self.title, self.variables = uid, title, variables
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = 0

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y = 0, self.y + 8
        self.panels.append(
            {
                "id": len(self.panels) + 1,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def panel(
        self,
        title: str,
        targets: list[dict[str, Any]],
        unit: str = "short",
        kind: str = "timeseries",
        width: int = 12,
        description: str = "",
    ) -> None:
        if self.x + width > 24:
            self.x, self.y = 0, self.y + 8
        for ref, t in enumerate(targets):
            t["refId"] = chr(ord("A") + ref)
        panel: dict[str, Any] = {
            "id": len(self.panels) + 1,
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"h": 8, "w": width, "x": self.x, "y": self.y},
            "targets": targets,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {},
        }
        if kind == "timeseries":
            panel["options"] = {
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "desc"},
            }
        self.panels.append(panel)
        self.x += width

    def json(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "title": self.title,
            "tags": ["kvtier"],
            "timezone": "browser",
            "schemaVersion": 39,
            "version": 1,
            "editable": True,
            "graphTooltip": 1,
            "refresh": "30s",
            "time": {"from": "now-3h", "to": "now"},
            "annotations": {"list": []},
            "links": [],
            "templating": {"list": self.variables},
            "panels": self.panels,
        }


def _datasource() -> dict[str, Any]:
    return {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "options": [],
    }


def _query_var(name: str, label: str, metric: str) -> dict[str, Any]:
    query = f"label_values({metric}, {label})"
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "current": {},
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "refresh": 2,
        "sort": 1,
        "hide": 0,
        "options": [],
    }


def overview() -> Board:
    b = Board(
        "kvtier-overview",
        "kvtier / overview",
        [
            _datasource(),
            _query_var("instance", "instance", "kvtier_build_info"),
            _query_var("model_name", "model_name", "vllm:spec_decode_num_drafts_total"),
        ],
    )
    lookups = rate("kvtier_lookup_chunks_total", "")
    b.row("Overview")
    b.panel(
        "Hit ratio per tier",
        [
            target(
                f"{rate('kvtier_hit_chunks_total', 'tier')} / ignoring (tier) group_left () "
                f"{lookups}",
                "{{tier}}",
            ),
            target(f"{rate('kvtier_hit_chunks_total', '')} / {lookups}", "all tiers"),
        ],
        "percentunit",
        description="Share of looked-up chunks found, by the fastest tier holding each.",
    )
    b.panel(
        "Bytes per second",
        [target(rate("kvtier_transfer_bytes_total", "direction"), "{{direction}}")],
        "Bps",
    )
    b.panel(
        "Data-plane latency p50 / p99",
        [
            target(quantile(0.5, "kvtier_request_duration_seconds", "op"), "p50 {{op}}"),
            target(quantile(0.99, "kvtier_request_duration_seconds", "op"), "p99 {{op}}"),
        ],
        "s",
    )
    b.panel(
        "Transfer latency p50 / p99",
        [
            target(
                quantile(0.5, "kvtier_transfer_duration_seconds", "direction"), "p50 {{direction}}"
            ),
            target(
                quantile(0.99, "kvtier_transfer_duration_seconds", "direction"), "p99 {{direction}}"
            ),
        ],
        "s",
    )
    b.panel(
        "Capacity and use per tier",
        [
            target(f"sum by (tier) (kvtier_tier_used_bytes{{{INST}}})", "used {{tier}}"),
            target(f"sum by (tier) (kvtier_tier_capacity_bytes{{{INST}}})", "capacity {{tier}}"),
        ],
        "bytes",
    )
    b.panel(
        "Chunks moved per second",
        [target(rate("kvtier_transfer_chunks_total", "direction"), "{{direction}}")],
        "ops",
    )
    b.panel(
        "Calls per second",
        [target(rate("kvtier_requests_total", "op, result"), "{{op}} {{result}}")],
        "reqps",
    )
    b.panel(
        "Sessions, leases, reservations",
        [
            target(f"sum(kvtier_sessions{{{INST}}})", "sessions"),
            target(f"sum(kvtier_leases{{{INST}}})", "leases"),
            target(f"sum(kvtier_reservations{{{INST}}})", "reservations"),
        ],
    )
    b.row("Integrity and pressure")
    b.panel(
        "Integrity failures",
        [
            target(
                f"sum by (tier) (increase(kvtier_integrity_failures_total{{{INST}}}[{RI}]))",
                "{{tier}}",
            )
        ],
        description="Chunks that failed verification, kvtierd's own checks and the engines' "
        "reports it confirmed; each was deleted and served as a miss.",
    )
    b.panel(
        "Tier health",
        [target(f"min by (tier) (kvtier_tier_healthy{{{INST}}})", "{{tier}}")],
        kind="stat",
        width=6,
        description="0 while a tier's integrity failures within manager.integrity_window_s "
        "reach manager.integrity_unhealthy_failures: a disk corrupting chunks.",
    )
    b.panel(
        "Engines' reports of failed verification",
        [
            target(
                f"sum by (tier, result) (increase(kvtier_integrity_reports_total{{{INST}}}[{RI}]))",
                "{{tier}} {{result}}",
            )
        ],
        description="confirmed: dropped; refused: the chunk verifies (kept); gone: no longer "
        "held; foreign: of pools the engine has not registered; unchecked: the queue was full.",
    )
    served = 'direction="load", model_name=~"$model_name"'
    b.panel(
        "Loads served and failed (vLLM)",
        [
            target(
                f"sum(rate(vllm:kvtier_transfer_chunks_total{{{served}}}[{RI}])) - "
                f"sum(rate(vllm:kvtier_transfer_errors_total{{{served}}}[{RI}]))",
                "served",
            ),
            target(f"sum(rate(vllm:kvtier_transfer_errors_total{{{served}}}[{RI}]))", "failed"),
        ],
        "ops",
        description="The served hit rate: chunks loaded into vLLM, less those whose load failed "
        "(recomputed). vLLM's num_cached_tokens counts a hit when its load is promised, failed "
        "loads included.",
    )
    b.panel(
        "Evictions per second",
        [target(rate("kvtier_evictions_total", "tier, reason"), "{{tier}} {{reason}}")],
        "ops",
    )
    b.panel(
        "Queue depth and bound",
        [
            target(f"sum by (queue) (kvtier_queue_depth_chunks{{{INST}}})", "depth {{queue}}"),
            target(f"sum by (queue) (kvtier_queue_capacity_chunks{{{INST}}})", "bound {{queue}}"),
        ],
    )
    b.panel(
        "Dropped, failed and refused work",
        [
            target(rate("kvtier_queue_dropped_chunks_total", "queue"), "dropped {{queue}}"),
            target(rate("kvtier_transfer_failures_total", "direction"), "failed {{direction}}"),
            target(rate("kvtier_store_rejected_chunks_total", "tier"), "refused {{tier}}"),
        ],
        "ops",
    )
    b.panel(
        "Use against high-water",
        [
            target(
                f"sum without (pool) (kvtier_tier_used_bytes{{{INST}}}) / "
                f"(kvtier_tier_capacity_bytes{{{INST}}} > 0)",
                "use {{instance}} {{tier}}",
            ),
            target(f"kvtier_tier_high_water_ratio{{{INST}}}", "high-water {{instance}} {{tier}}"),
        ],
        "percentunit",
    )
    b.panel(
        "vLLM's time inside kvtier's hooks (vLLM)",
        [
            target(
                "sum by (hook) (rate(vllm:kvtier_hook_seconds_total"
                f'{{model_name=~"$model_name"}}[{RI}]))',
                "{{hook}}",
            )
        ],
        "percentunit",
        description="Seconds per second vLLM's engine loop waited on kvtier's connector hooks: "
        "the share of serving time kvtier took (summed over tensor-parallel workers, an upper "
        "bound there).",
    )
    b.panel(
        "Load or recompute (vLLM)",
        [
            target(
                "sum by (tier, decision) (rate(vllm:kvtier_load_decisions_total"
                f'{{model_name=~"$model_name"}}[{RI}]))',
                "{{decision}} {{tier}}",
            ),
            target(
                "sum by (decision) (rate(vllm:kvtier_load_decision_saved_seconds_total"
                f'{{model_name=~"$model_name"}}[{RI}]))',
                "seconds saved by {{decision}}",
            ),
            target(
                "sum by (mode) (rate(vllm:kvtier_load_modes_total"
                f'{{model_name=~"$model_name"}}[{RI}]))',
                "{{mode}} loads",
            ),
        ],
        description="load_policy: measured. Runs of hits per second, per tier, loaded or "
        "recomputed (a run is recomputed where loading it is measured to take longer), and "
        "the seconds per second those decisions are expected to save: load against "
        "recomputing, recompute against loading; and loads per second by mode (load_mode: "
        "auto loads inside the step where that holds its requests up less than a step).",
    )
    b.row("Object store")
    b.panel(
        "Healthy",
        [target(f"min(kvtier_object_store_healthy{{{INST}}})", "healthy")],
        kind="stat",
        width=6,
    )
    b.panel(
        "Circuit breaker",
        [target(f"max by (state) (kvtier_object_store_breaker_state{{{INST}}})", "{{state}}")],
        kind="stat",
        width=6,
    )
    b.panel(
        "Identity in use",
        [target(f"kvtier_object_store_info{{{INST}}}", table=True)],
        kind="table",
    )
    b.panel(
        "Requests and errors per second",
        [
            target(rate("kvtier_object_store_uploads_total", ""), "uploads"),
            target(rate("kvtier_object_store_probes_total", ""), "probes"),
            target(rate("kvtier_object_store_probe_timeouts_total", ""), "probes over budget"),
            target(rate("kvtier_object_store_probe_misses_total", ""), "probe misses"),
            target(rate("kvtier_object_store_retries_total", ""), "retries"),
            target(rate("kvtier_object_store_request_errors_total", "result"), "errors {{result}}"),
        ],
        "reqps",
    )
    b.panel(
        "Upload and download bytes per second",
        [
            target(
                rate("kvtier_transfer_bytes_total", "direction", 'direction=~"upload|download"'),
                "{{direction}}",
            ),
            target(
                f"{rate('kvtier_object_store_upload_seconds_total', '')} / "
                f"{rate('kvtier_object_store_uploads_total', '')}",
                "mean upload seconds",
            ),
            target(
                f"{rate('kvtier_object_store_probe_miss_seconds_total', '')} / "
                f"{rate('kvtier_object_store_probe_misses_total', '')}",
                "mean seconds a probe miss is waited for",
            ),
        ],
        "Bps",
    )
    b.row("Draft models and speculative decoding")
    b.panel(
        "Draft revisions registered",
        [target(f"kvtier_draft_revision_info{{{INST}}}", table=True)],
        kind="table",
    )
    b.panel(
        "Draft swaps",
        [target(f"sum(kvtier_draft_swaps_total{{{INST}}})", "swaps")],
        kind="stat",
        width=6,
    )
    b.panel(
        "Draft pool hit ratio",
        [
            target(
                f"{rate('kvtier_hit_chunks_total', '', DRAFT)} / "
                f"{rate('kvtier_lookup_chunks_total', '', DRAFT)}",
                "draft hit ratio",
            )
        ],
        "percentunit",
        kind="stat",
        width=6,
    )
    m = 'model_name=~"$model_name"'
    accepted = f"sum(rate(vllm:spec_decode_num_accepted_tokens_total{{{m}}}[{RI}]))"
    b.panel(
        "Acceptance (vLLM)",
        [
            target(
                f"{accepted} / sum(rate(vllm:spec_decode_num_draft_tokens_total{{{m}}}[{RI}]))",
                "acceptance rate",
            ),
        ],
        "percentunit",
        description="From vLLM's own spec-decode counters, next to kvtier's draft revisions.",
    )
    b.panel(
        "Mean acceptance length (vLLM)",
        [
            target(
                f"1 + {accepted} / sum(rate(vllm:spec_decode_num_drafts_total{{{m}}}[{RI}]))",
                "tokens per draft",
            )
        ],
    )
    b.panel(
        "Acceptance per draft position (vLLM)",
        [
            target(
                "sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total"
                f"{{{m}}}[{RI}])) / ignoring (position) group_left () "
                f"sum(rate(vllm:spec_decode_num_drafts_total{{{m}}}[{RI}]))",
                "position {{position}}",
            )
        ],
        "percentunit",
    )
    b.row("Verified reuse")
    b.panel(
        "Sampled chunks compared",
        [
            target(
                f"sum by (pool, result) (rate(vllm:kvtier_verify_chunks_total{{{m}}}[{RI}]))",
                "{{pool}} {{result}}",
            )
        ],
        "cps",
        description="Chunks of sampled hits compared with the KV vLLM recomputed. Any "
        "mismatch quarantines its namespace (alert KVTierWrongKV).",
    )
    b.panel(
        "Relative error of compared chunks (p99)",
        [
            target(
                "histogram_quantile(0.99, sum by (le, pool) "
                f"(rate(vllm:kvtier_verify_relative_error_bucket{{{m}}}[{RI}])))",
                "{{pool}}",
            )
        ],
        description="Right chunks sit far below verify_max_error (0.05 by default).",
    )
    b.row("Encoder cache (multimodal)")
    items = "vllm:kvtier_encoder_items_total"
    b.panel(
        "Encoder outputs by result",
        [target(f"sum by (result) (rate({items}{{{m}}}[{RI}]))", "{{result}}")],
        "ops",
        description="hit: loaded instead of encoded; miss: encoded; promoted: read back from "
        "lmdb or the object store while its request waited; stored; sampled: a hit encoded "
        "anyway and compared; load_failed: its request failed.",
    )
    b.panel(
        "Encoder cache hit ratio",
        [
            target(
                f'sum(rate({items}{{{m},result="hit"}}[{RI}])) / '
                f'sum(rate({items}{{{m},result=~"hit|miss"}}[{RI}]))',
                "hit ratio",
            )
        ],
        "percentunit",
        description="Of the items vLLM would have encoded, the share loaded from kvtier.",
    )
    b.panel(
        "Encoder output bytes",
        [
            target(
                f"sum by (direction) (rate(vllm:kvtier_encoder_bytes_total{{{m}}}[{RI}]))",
                "{{direction}}",
            )
        ],
        "Bps",
    )
    b.panel(
        "Encoder output load time per hit",
        [
            target(
                f"sum(rate(vllm:kvtier_encoder_load_seconds_total{{{m}}}[{RI}])) / "
                f'sum(rate({items}{{{m},result="hit"}}[{RI}]))',
                "seconds per hit",
            )
        ],
        "s",
        description="What a hit costs the worker; an encoder's forward is what it spares.",
    )
    return b


def breakdown() -> Board:
    b = Board(
        "kvtier-breakdown",
        "kvtier / replicas and pools",
        [
            _datasource(),
            _query_var("instance", "instance", "kvtier_build_info"),
            _query_var("pool", "pool", "kvtier_lookup_chunks_total"),
            _query_var("replica", "replica", "kvtier_lookup_chunks_total"),
        ],
    )
    sel = 'pool=~"$pool",replica=~"$replica"'
    b.row("Per replica")
    b.panel(
        "Hit ratio per replica",
        [
            target(
                f"{rate('kvtier_hit_chunks_total', 'replica', sel)} / "
                f"{rate('kvtier_lookup_chunks_total', 'replica', sel)}",
                "{{replica}}",
            )
        ],
        "percentunit",
    )
    b.panel(
        "Looked-up chunks per second per replica",
        [target(rate("kvtier_lookup_chunks_total", "replica", sel), "{{replica}}")],
        "ops",
    )
    b.panel(
        "Arena use per replica against its quota",
        [
            target(
                f'sum by (replica, pool) (kvtier_replica_used_bytes{{{INST},tier="cpu",{sel}}})',
                "used {{replica}} {{pool}}",
            ),
            target(
                f"sum by (replica, pool) (kvtier_replica_quota_bytes{{{INST},{sel}}})",
                "quota {{replica}} {{pool}}",
            ),
        ],
        "bytes",
    )
    b.panel(
        "Bytes per replica and tier",
        [
            target(
                f"sum by (tier, replica) (kvtier_replica_used_bytes{{{INST},{sel}}})",
                "{{tier}} {{replica}}",
            )
        ],
        "bytes",
    )
    b.panel(
        "Hit ratio per kvtierd",
        [
            target(
                f"{rate('kvtier_hit_chunks_total', 'instance')} / "
                f"{rate('kvtier_lookup_chunks_total', 'instance')}",
                "{{instance}}",
            )
        ],
        "percentunit",
    )
    b.row("Per pool")
    b.panel(
        "Hit ratio per pool and tier",
        [
            target(
                f"{rate('kvtier_hit_chunks_total', 'pool, tier', sel)} / ignoring (tier) "
                f"group_left () {rate('kvtier_lookup_chunks_total', 'pool', sel)}",
                "{{pool}} {{tier}}",
            )
        ],
        "percentunit",
    )
    b.panel(
        "Bytes per pool and tier",
        [
            target(
                f'sum by (tier, pool) (kvtier_tier_used_bytes{{{INST},pool=~"$pool"}})',
                "used {{tier}} {{pool}}",
            ),
            target(
                f'sum by (pool) (kvtier_pool_capacity_bytes{{{INST},pool=~"$pool"}})',
                "arena share {{pool}}",
            ),
        ],
        "bytes",
    )
    b.panel(
        "Chunks per pool and tier",
        [
            target(
                f'sum by (tier, pool) (kvtier_tier_chunks{{{INST},pool=~"$pool"}})',
                "{{tier}} {{pool}}",
            )
        ],
    )
    return b


BOARDS = {"kvtier-overview.json": overview, "kvtier-breakdown.json": breakdown}


def render() -> dict[str, str]:
    return {name: json.dumps(make().json(), indent=2) + "\n" for name, make in BOARDS.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)}; run python {Path(__file__).name}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
