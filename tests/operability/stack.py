"""A live kvtierd under load, scraped by a real Prometheus, for the operability tests.

Prometheus also scrapes a stand-in for vLLM's /metrics that serves the ``vllm:spec_decode_*``
counters the dashboards show (test_prometheus checks those names against vLLM's own source).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from kvtier.observability.metric_specs import METRICS
from tests.integration.daemon_harness import Processes, RunningDaemon, write_config
from tests.operability.load import Load

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana").glob("*.json"))
RULES = ROOT / "deploy" / "prometheus" / "kvtier-alerts.yaml"
SCRAPE_INTERVAL_S = 1
RATE_WINDOW = "20s"
VLLM_MODEL = "tiny-llama"
# Dashboard variables, as Grafana substitutes them with "All" selected.
VARIABLES = {
    "$__rate_interval": RATE_WINDOW,
    "$instance": ".*",
    "$pool": ".*",
    "$replica": ".*",
    "$model_name": ".*",
}
_NAME = re.compile(r"\b(?:kvtier_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def exported_names() -> set[str]:
    """Every series name kvtierd exports, as a query names it."""
    names = set()
    for spec in METRICS:
        names.add(spec.exposed)
        if spec.kind == "histogram":
            names |= {f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count"}
    return names


def metric_names(expr: str) -> set[str]:
    return set(_NAME.findall(expr))


def check_names(expr: str, vllm_names: set[str]) -> None:
    """Fail for a query naming a metric that neither kvtierd nor vLLM exports."""
    unknown = {
        n
        for n in metric_names(expr)
        if n not in exported_names() and not (n.startswith("vllm:") and n in vllm_names)
    }
    if unknown:
        raise AssertionError(f"query names metrics nobody exports: {sorted(unknown)}: {expr}")


def panel_queries() -> Iterator[tuple[str, str, str]]:
    """(dashboard file, panel title, expression) of every panel target."""
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                yield path.name, panel["title"], target["expr"]


def substitute(expr: str) -> str:
    for name, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def dashboard_vllm_names() -> set[str]:
    return {n for _, _, e in panel_queries() for n in metric_names(e) if n.startswith("vllm:")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _FakeVllm(BaseHTTPRequestHandler):
    started = time.monotonic()

    def do_GET(self) -> None:
        n = int(100 * (time.monotonic() - self.started)) + 1
        labels = f'engine="0",model_name="{VLLM_MODEL}"'
        values = {
            "vllm:spec_decode_num_drafts_total": n,
            "vllm:spec_decode_num_draft_tokens_total": 3 * n,
            "vllm:spec_decode_num_accepted_tokens_total": 2 * n,
        }
        lines = []
        for name in sorted(dashboard_vllm_names()):
            lines.append(f"# TYPE {name} counter")
            if name.endswith("_per_pos_total"):
                for pos in range(3):
                    lines.append(f'{name}{{{labels},position="{pos}"}} {n * (3 - pos) // 3}')
            elif name == "vllm:kvtier_encoder_items_total":
                for result, share in (("hit", 3), ("miss", 1)):
                    lines.append(f'{name}{{{labels},pool="encoder",result="{result}"}} {n * share}')
            elif name.startswith("vllm:kvtier_transfer_"):  # one load in ten failed
                share = n // 10 if name.endswith("_errors_total") else n
                lines.append(f'{name}{{{labels},direction="load",pool="target"}} {share}')
            elif name.endswith("_bucket"):  # a histogram: every observation in its first bucket
                for le in ("0.001", "0.01", "+Inf"):
                    lines.append(f'{name}{{{labels},pool="target",le="{le}"}} {n}')
            else:
                lines.append(f"{name}{{{labels}}} {values.get(name, n)}")
        body = ("\n".join(lines) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Prometheus:
    def __init__(self, directory: Path, targets: dict[str, str]) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed (scripts/test.sh installs it)"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
            },
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [target]}]}
                for job, target in targets.items()
            ],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = directory / "prometheus.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={directory / 'prometheus.yml'}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait(lambda: self._get("/-/ready", raw=True) is not None, 30, "ready")
        except BaseException:
            self.close()
            raise

    def _get(self, path: str, raw: bool = False) -> Any:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                body = response.read()
        except OSError:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{self.log.read_text()}") from None
            return None
        return body if raw else json.loads(body)

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        doc = self._get(f"/api/v1/{path}?{query}")
        assert doc is not None
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def _wait(self, check: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, f"prometheus not {what} in {timeout_s} s"
            time.sleep(0.2)

    def wait_scrapes(self, jobs: list[str], samples: int) -> None:
        """Until each job was scraped ``samples`` times successfully in a row."""

        def enough() -> bool:
            for job in jobs:
                found = self.query(f'count_over_time(up{{job="{job}"}}[1m])')
                up = self.query(f'up{{job="{job}"}}')
                if not found or float(found[0]["value"][1]) < samples:
                    return False
                if not up or float(up[0]["value"][1]) != 1:
                    return False
            return True

        self._wait(enough, 60, f"scraping {jobs}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


@dataclass
class Stack:
    daemon: RunningDaemon
    load: Load
    prometheus: Prometheus
    metrics_url: str


def start(directory: Path, arena: Path, procs: Processes) -> tuple[Stack, ThreadingHTTPServer]:
    files = write_config(
        directory,
        arena,
        {
            "manager": {"demote_mode": "write_through"},
            "object": {
                "url": (directory / "objects").as_uri(),
                "index_path": str(directory / "objindex"),
                "pack_target_bytes": 0,
                "pack_linger_ms": 5.0,
            },
        },
    )
    (directory / "objects").mkdir()
    daemon = procs.start_daemon(files)
    load = Load(files.socket, daemon.admin)
    load.start()
    vllm = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    threading.Thread(target=vllm.serve_forever, name="fake-vllm", daemon=True).start()
    try:
        prometheus = Prometheus(
            directory,
            {
                "kvtier": f"127.0.0.1:{daemon.metrics_port}",
                "vllm": f"127.0.0.1:{vllm.server_address[1]}",
            },
        )
    except BaseException:
        load.stop()
        vllm.shutdown()
        vllm.server_close()
        raise
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    return Stack(daemon, load, prometheus, url), vllm
