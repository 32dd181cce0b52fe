"""kvtierd with an S3 object store (moto) reached through IRSA: a second node finds what the
first uploaded, reports the identity it runs as, and a broken identity costs only the store."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.server.daemon import OBJECT_HEALTH_SERVICE
from tests.integration.daemon_harness import (
    QUICK_TO_GIVE_UP,
    DaemonFiles,
    Processes,
    RunningDaemon,
    object_node,
)
from tests.objstore.fixtures import AwsIrsa

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def node(root: Path, url: str, name: str) -> DaemonFiles:
    return object_node(root / name, url, **QUICK_TO_GIVE_UP)


def object_health(daemon: RunningDaemon) -> int:
    with grpc.insecure_channel(daemon.admin_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=OBJECT_HEALTH_SERVICE)
        return int(stub.Check(request, timeout=10).status)


def metric(daemon: RunningDaemon, name: str) -> list[tuple[dict[str, str], float]]:
    return [(labels, value) for n, labels, value in daemon.metrics() if n == name]


def wait_serving(daemon: RunningDaemon, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while object_health(daemon) != SERVING:
        assert time.monotonic() < deadline, daemon.log_text()
        time.sleep(0.05)


def test_a_second_node_finds_what_the_first_uploaded(
    procs: Processes, tmp_path: Path, s3_store: str, aws_irsa: AwsIrsa
) -> None:
    files_a = node(tmp_path, s3_store, "a")
    a = procs.start_daemon(files_a)
    try:
        assert procs.client(files_a.socket, "dp0", "--store", "0:6")["stored"] == list(range(6))
        # SIGTERM drains the arena to lmdb and the upload queue to the store
        assert a.signal_and_wait(signal.SIGTERM, 60) == 0
    finally:
        files_a.arena.unlink(missing_ok=True)

    files_b = node(tmp_path, s3_store, "b")
    b = procs.start_daemon(files_b)
    try:
        wait_serving(b)  # the identity is resolved in the background
        [(info, _)] = metric(b, "kvtier_object_store_info")
        assert info["url"] == s3_store
        assert info["principal"].startswith("arn:aws:sts::")
        assert "assumed-role" in info["principal"]
        assert metric(b, "kvtier_object_store_healthy") == [({}, 1.0)]
        found = procs.client(files_b.socket, "dp0", "--lookup", "0:6", "--load", "0:6")
        assert found["hits"] == 6
        assert found["tiers"] == ["lmdb"] * 6  # probed in the store, then kept on disk
        assert found["loaded"] == [True] * 6  # the harness checks every byte
        probes = [
            v
            for labels, v in metric(b, "kvtier_tier_events_total")
            if labels == {"tier": "object", "event": "probes"}
        ]
        assert probes == [1.0], "one probe found the whole pack"
    finally:
        b.signal_and_wait(signal.SIGTERM, 60)
        files_b.arena.unlink(missing_ok=True)


def test_a_broken_identity_makes_only_the_store_unhealthy(
    procs: Processes, tmp_path: Path, s3_store: str, aws_irsa: AwsIrsa
) -> None:
    aws_irsa.token_file.unlink()
    files = node(tmp_path, s3_store, "a")
    daemon = procs.start_daemon(files)
    try:
        assert object_health(daemon) == NOT_SERVING
        assert metric(daemon, "kvtier_object_store_healthy") == [({}, 0.0)]
        # the arena and lmdb serve as ever
        assert procs.client(files.socket, "dp0", "--store", "0:4")["stored"] == list(range(4))
        found = procs.client(files.socket, "dp1", "--lookup", "0:6", "--load", "0:4")
        assert found["hits"] == 4
        assert found["loaded"] == [True] * 4
        time.sleep(1.5)  # past breaker_reset_s: the health loop's trials still fail
        assert object_health(daemon) == NOT_SERVING
        aws_irsa.write_token()  # the token is projected again: the store comes back, idle
        deadline = time.monotonic() + 10
        while object_health(daemon) != SERVING and time.monotonic() < deadline:
            time.sleep(0.2)
        assert object_health(daemon) == SERVING
        [(info, _)] = metric(daemon, "kvtier_object_store_info")
        assert "assumed-role" in info["principal"]
    finally:
        assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0
        files.arena.unlink(missing_ok=True)
