"""Clients of kvtierd's gRPC APIs: the data plane (`GrpcTierClient`) and the admin API
(`AdminClient`), with the deadlines and breaker that keep a caller from stalling."""

from kvtier.rpc.admin_client import AdminClient, ClientTLS
from kvtier.rpc.calls import DaemonStalledError, Deadlines, Pending
from kvtier.rpc.tier_client import GrpcTierClient

__all__ = [
    "AdminClient",
    "ClientTLS",
    "DaemonStalledError",
    "Deadlines",
    "GrpcTierClient",
    "Pending",
]
