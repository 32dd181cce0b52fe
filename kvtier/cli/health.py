"""``kvtier health``: whether kvtierd's admin API answers SERVING, for a container's health check.

It asks the standard gRPC health service, which kvtierd serves beside the admin API and leaves
open to callers without a token (as kubelet's gRPC probes are), so no token is read. Exit 0 when
the service answers SERVING, 1 otherwise (never 2: Docker reserves it in health checks).
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.api.v1 import admin_pb2
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError

ADMIN_SERVICE: str = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name


def dial_target(address: str) -> str:
    """The address to dial for a listen address: a wildcard host (``0.0.0.0``, ``::`` or none)
    is reached on loopback, since the check runs beside the daemon."""
    host, sep, port = address.rpartition(":")
    if not sep:
        return address
    bare = host.strip("[]")
    if not bare:
        return f"127.0.0.1:{port}"
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return address  # a host name
    if not ip.is_unspecified:
        return address
    return f"[::1]:{port}" if ip.version == 6 else f"127.0.0.1:{port}"


def check(target: str, service: str, timeout_s: float) -> tuple[bool, str]:
    """(serving, one line saying what was found)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            response = stub.Check(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            what = " ".join((exc.details() or "").split())  # one line, whatever gRPC wrote
            return False, f"{service or 'kvtierd'} at {target}: {exc.code().name}: {what}"
    status: int = response.status
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    serving = status == health_pb2.HealthCheckResponse.SERVING
    return serving, f"{service or 'kvtierd'} at {target}: {name}"


def _address(args: argparse.Namespace) -> tuple[str, str]:
    """(the address to dial, a hint to add on failure)."""
    if args.address:
        return str(args.address), ""
    server = load_config(args.config).server
    hint = ""
    if server.tls_cert_file is not None:
        hint = " (the admin API is configured for TLS; kvtier health speaks plaintext)"
    return dial_target(server.admin_address), hint


def run(args: argparse.Namespace) -> int:
    try:
        target, hint = _address(args)
    except ConfigError as exc:
        print(f"kvtier health: invalid configuration: {exc}", file=sys.stderr)
        return 1
    serving, line = check(target, args.service, args.timeout)
    if serving:
        print(line)
        return 0
    print(f"kvtier health: {line}{hint}", file=sys.stderr)
    return 1


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Adds ``health`` to the `kvtier` command line."""
    p = sub.add_parser(
        "health",
        parents=[common],
        help="exit 0 if kvtierd's admin API answers SERVING, else 1 (needs no token)",
    )
    p.add_argument(
        "--address",
        help="admin API host:port (default: server.admin_address; a wildcard host is dialled "
        "on loopback)",
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
