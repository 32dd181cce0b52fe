"""How a `kvtier` command reaches kvtierd's admin API: the address, the bearer token and TLS, one
set of options that every admin command and `kvtier health` take.

Without options, a command reads the daemon's configuration (``--config`` and ``KVTIER_``
variables, as ``kvtier serve`` does): it dials ``server.admin_address`` (a wildcard host on
loopback), sends the token in the file `kvtier.core.admin_token.token_path` names (the one kvtierd
wrote at its first start, for its own user), and speaks TLS where the daemon is configured for it.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.admin_token import TOKEN_KEY, read_token, token_path
from kvtier.core.config import ServerConfig, load_config
from kvtier.core.errors import ConfigError
from kvtier.rpc.admin_client import AdminClient, ClientTLS


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options of reaching kvtierd, on the parent parser of the commands that call it."""
    group = parser.add_argument_group("reaching kvtierd's admin API")
    group.add_argument(
        "--address",
        help="host:port (default: server.admin_address; a wildcard host is dialled on loopback)",
    )
    group.add_argument(
        "--token-file",
        type=Path,
        help="bearer token file (default: server.admin_token_file, else the admin.token kvtierd "
        "wrote in its state directory)",
    )
    group.add_argument(
        "--tls-ca",
        type=Path,
        help="CA of the server's certificate (PEM); speaks TLS (default: plaintext, or TLS with "
        "the system's CAs where server.tls_cert_file is set)",
    )
    group.add_argument("--tls-cert", type=Path, help="client certificate (PEM), for mTLS")
    group.add_argument("--tls-key", type=Path, help="client key (PEM), for mTLS")
    group.add_argument(
        "--tls-server-name", help="name the server's certificate carries, if not the host dialled"
    )


def dial_target(address: str) -> str:
    """The address to dial for a listen address: a wildcard host (``0.0.0.0``, ``::`` or none)
    is reached on loopback, since the command runs beside the daemon."""
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


@dataclass(frozen=True)
class Connection:
    target: str
    token: str | None
    tls: ClientTLS | None

    def admin(self) -> AdminClient:
        return AdminClient(self.target, token=self.token, tls=self.tls)


def _token(args: argparse.Namespace, server: ServerConfig, daemons: bool) -> str | None:
    if args.token_file is not None:
        return read_token(args.token_file, "--token-file")
    path = token_path(server) if daemons else None
    if path is None or not os.path.exists(path):  # False too where a directory is closed to us
        return None  # mTLS alone, or not kvtierd's user: kvtierd says what it lacks
    try:
        return read_token(path, TOKEN_KEY)
    except ConfigError as exc:
        raise ConfigError(TOKEN_KEY, f"{exc}; run as kvtierd's user, or pass --token-file") from exc


def _tls(args: argparse.Namespace, server: ServerConfig) -> ClientTLS | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert", "--tls-cert and --tls-key go together")
    flags = (args.tls_ca, args.tls_cert, args.tls_server_name)
    if all(flag is None for flag in flags) and server.tls_cert_file is None:
        return None
    client = None
    if args.tls_cert is not None and args.tls_key is not None:
        client = args.tls_key.read_bytes(), args.tls_cert.read_bytes()
    ca = args.tls_ca.read_bytes() if args.tls_ca is not None else None
    return ClientTLS(ca=ca, client=client, server_name=args.tls_server_name)


def connection(args: argparse.Namespace, *, token: bool = True) -> Connection:
    """Where and how to call kvtierd, from the options and the configuration; ``token=False``
    leaves the daemon's own token file unread, sending a token only where ``--token-file`` names
    one (health needs none)."""
    server = load_config(args.config).server
    target = args.address or dial_target(server.admin_address)
    return Connection(target, _token(args, server, daemons=token), _tls(args, server))
