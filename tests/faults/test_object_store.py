"""kvtierd with an S3 store (moto, through IRSA) that fails under it: the health gauge stays 0
until a trial succeeds, and a store that died answers lookups with a miss that waits on no retry
and no lookup budget."""

from __future__ import annotations

import signal
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.rpc import GrpcTierClient
from kvtier.server.daemon import OBJECT_HEALTH_SERVICE
from tests.integration.daemon_harness import (
    CHUNK,
    DaemonFiles,
    Processes,
    RunningDaemon,
    key_of,
    object_node,
)
from tests.objstore.fixtures import AwsIrsa, ProxiedStore, StoreFactory
from tests.objstore.servers import FaultMode, ServerProcess
from tests.support import target_spec

SERVING = health_pb2.HealthCheckResponse.SERVING


def node(
    root: Path, arenas: list[Path], url: str, server: dict[str, Any] | None = None, **store: Any
) -> DaemonFiles:
    files = object_node(root / uuid.uuid4().hex[:8], url, {"server": server or {}}, **store)
    arenas.append(files.arena)
    return files


def gauge(daemon: RunningDaemon, name: str, **labels: str) -> float:
    values = [v for n, got, v in daemon.metrics() if n == name and got == labels]
    assert len(values) == 1, (name, labels, values)
    return values[0]


def object_health(daemon: RunningDaemon) -> int:
    with grpc.insecure_channel(daemon.admin_address) as channel:
        request = health_pb2.HealthCheckRequest(service=OBJECT_HEALTH_SERVICE)
        return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status)


def wait_for(what: str, ok: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)


def test_the_health_gauge_reads_0_while_a_half_open_trial_is_in_flight(
    procs: Processes,
    tmp_path: Path,
    arenas: list[Path],
    aws_irsa: AwsIrsa,
    proxied_store: ProxiedStore,
) -> None:
    url, proxy = proxied_store("s3")
    files = node(
        tmp_path,
        arenas,
        url,
        breaker_failures=2,
        retries=1,
        backoff_s=0.01,
        request_timeout_s=8.0,
        breaker_reset_s=1.0,
        lookup_budget_ms=50,
    )
    daemon = procs.start_daemon(files)
    healthy = "kvtier_object_store_healthy"
    wait_for("healthy store", lambda: gauge(daemon, healthy) == 1.0)

    proxy.set_mode(FaultMode.HTTP_500)
    procs.client(files.socket, "dp0", "--lookup", "0:1")  # a probe that fails: the breaker opens
    wait_for(
        "open breaker",
        lambda: gauge(daemon, "kvtier_object_store_breaker_state", state="open") == 1,
    )
    assert gauge(daemon, healthy) == 0.0

    proxy.set_mode(FaultMode.DELAY, delay_ms=5000)  # the store answers, slowly
    proxy.clear_requests()
    half_open = "kvtier_object_store_breaker_state"
    wait_for("trial in flight", lambda: len(proxy.requests) > 0)
    samples = [
        (gauge(daemon, half_open, state="half_open"), gauge(daemon, healthy)) for _ in range(5)
    ]
    assert samples == [(1.0, 0.0)] * 5, "a trial in flight proves nothing yet"
    assert object_health(daemon) != SERVING

    proxy.set_mode(FaultMode.PASS)  # the held trial fails; the next one succeeds
    wait_for("healthy again", lambda: gauge(daemon, healthy) == 1.0)
    assert gauge(daemon, half_open, state="closed") == 1.0
    wait_for("SERVING", lambda: object_health(daemon) == SERVING, 5.0)
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0


def _miss_s(client: GrpcTierClient, index: int) -> float:
    started = time.perf_counter()
    result = client.lookup([key_of(index)])
    elapsed = time.perf_counter() - started
    assert (result.hits, result.pending) == (0, False), result
    return elapsed


@pytest.mark.serial  # holds single lookups to a few milliseconds
def test_the_first_miss_after_the_store_dies_waits_on_no_retry_nor_budget(
    procs: Processes,
    tmp_path: Path,
    arenas: list[Path],
    store_factory: StoreFactory,
    aws_irsa: AwsIrsa,
    spawn_server: Callable[[str], ServerProcess],
) -> None:
    server = spawn_server("moto")  # killed below
    url = store_factory("s3", endpoint=server.url)
    # a budget long enough that a lookup waiting on a failing probe runs it out
    files = node(tmp_path, arenas, url, lookup_budget_ms=300, breaker_reset_s=60)
    daemon = procs.start_daemon(files)
    wait_for("healthy store", lambda: gauge(daemon, "kvtier_object_store_healthy") == 1.0)
    client = GrpcTierClient(files.socket, "dp0")

    def counts() -> tuple[float, float, float]:
        """Probes sent, retried requests, and probes a lookup's budget ran out on."""
        return tuple(  # type: ignore[return-value]
            gauge(daemon, f"kvtier_object_store_{name}_total")
            for name in ("probes", "retries", "probe_timeouts")
        )

    try:
        client.register_pool(target_spec(), CHUNK)
        before = counts()
        healthy = statistics.median(_miss_s(client, 2000 + i) for i in range(9))
        probed = counts()
        assert probed[0] > before[0], "a healthy store's misses were not asked of it"
        server.kill()
        first = _miss_s(client, 3000)
        after_first = counts()
        after = statistics.median(_miss_s(client, 4000 + i) for i in range(5))
        print(
            f"miss: healthy store {healthy * 1e3:.2f} ms (median of 9), first after the store "
            f"died {first * 1e3:.2f} ms, then {after * 1e3:.2f} ms (median of 5)"
        )
        # what would make a miss wait on the dead store: a retry with backoff, or its probe
        # running out the 300 ms budget; counted, so a slow machine changes nothing
        assert after_first[1:] == probed[1:], "the first miss waited on a retry or its budget"
        errors = gauge(daemon, "kvtier_object_store_request_errors_total", result="error")
        assert errors == 1.0, "the first refused connection opened the breaker"
        assert gauge(daemon, "kvtier_object_store_healthy") == 0.0
        assert counts() == after_first, "a miss asked the dead store after its breaker opened"
    finally:
        client.close()
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0
