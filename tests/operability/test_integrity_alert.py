"""The integrity alerts fire in a real Prometheus, evaluating deploy/prometheus's rules against a
live kvtierd, once an engine reports chunks it read from lmdb and found corrupt."""

from __future__ import annotations

from pathlib import Path

from kvtier.rpc import GrpcTierClient
from tests.integration.daemon_harness import CHUNK, Processes, key_of, wait_for
from tests.integration.test_integrity_reports import (
    CORRUPT,
    STORED,
    corrupted_daemon,
    read_in_lmdb,
)
from tests.operability.stack import Prometheus
from tests.support import target_spec

ALERTS = {"KVTierIntegrityFailures", "KVTierTierCorrupting"}


def _firing(prometheus: Prometheus) -> set[tuple[str, str]]:
    """(alert, tier) of every alert firing now."""
    alerts = prometheus.api("alerts")["alerts"]
    return {
        (a["labels"]["alertname"], a["labels"].get("tier", ""))
        for a in alerts
        if a["state"] == "firing"
    }


def test_an_engines_report_of_corrupt_chunks_fires_the_integrity_alerts(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    daemon = corrupted_daemon(procs, tmp_path, shm_path)
    prometheus = Prometheus(tmp_path, {"kvtier": f"127.0.0.1:{daemon.metrics_port}"})
    try:
        prometheus.wait_scrapes(["kvtier"], 3)  # the counters' zero is on record first
        assert not {name for name, _ in _firing(prometheus)} & ALERTS
        engine = GrpcTierClient(daemon.files.socket, "r1")
        try:
            engine.register_pool(target_spec(), CHUNK)
            served, failed = read_in_lmdb(engine, [key_of(i) for i in range(STORED)])
            assert served.count(False) == len(failed) == len(CORRUPT)
            engine.report_failed(failed)
            wait_for(
                lambda: {(name, "lmdb") for name in ALERTS} <= _firing(prometheus),
                60,
                "both integrity alerts fire for lmdb",
            )
        finally:
            engine.close()
    finally:
        prometheus.close()
