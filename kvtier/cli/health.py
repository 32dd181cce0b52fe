"""``kvtier health``: whether kvtierd's admin API answers SERVING, for a container's health check.

It asks the standard gRPC health service, which kvtierd serves beside the admin API and leaves
open to callers without a token (as kubelet's gRPC probes are): it says SERVING or not and nothing
else, so no token is read unless ``--token-file`` names one. Over TLS (``--tls-ca``, and
``--tls-cert``/``--tls-key`` where the daemon asks for client certificates) as the admin commands.
Exit 0 when the service answers SERVING, 1 otherwise (never 2: Docker reserves it in health
checks).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.api.v1 import admin_pb2
from kvtier.cli.connect import Connection, connection
from kvtier.core.errors import ConfigError
from kvtier.rpc.admin_client import bearer, open_channel

ADMIN_SERVICE: str = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name


def check(to: Connection, service: str, timeout_s: float) -> tuple[bool, str]:
    """(serving, one line saying what was found)."""
    target = to.target
    with open_channel(target, to.tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            response = stub.Check(request, timeout=timeout_s, metadata=bearer(to.token))
        except grpc.RpcError as exc:
            what = " ".join((exc.details() or "").split())  # one line, whatever gRPC wrote
            return False, f"{service or 'kvtierd'} at {target}: {exc.code().name}: {what}"
    status: int = response.status
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    serving = status == health_pb2.HealthCheckResponse.SERVING
    return serving, f"{service or 'kvtierd'} at {target}: {name}"


def run(args: argparse.Namespace) -> int:
    try:
        to = connection(args, token=False)
    except (ConfigError, OSError) as exc:
        print(f"kvtier health: invalid configuration: {exc}", file=sys.stderr)
        return 1
    serving, line = check(to, args.service, args.timeout)
    if serving:
        print(line)
        return 0
    print(f"kvtier health: {line}", file=sys.stderr)
    return 1


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Adds ``health`` to the `kvtier` command line; ``common`` carries `connect`'s options."""
    p = sub.add_parser(
        "health",
        parents=[common],
        help="exit 0 if kvtierd's admin API answers SERVING, else 1 (needs no token)",
    )
    p.add_argument(
        "--service",
        default=ADMIN_SERVICE,
        help=f"health service name (default: {ADMIN_SERVICE}; '' for the server, "
        "kvtier.object for the object store, kvtier.lmdb for lmdb: NOT_SERVING while its disk "
        "is full)",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    p.set_defaults(func=run)
