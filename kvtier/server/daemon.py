"""kvtierd wiring: the TierManager behind a unix-socket data plane, a TCP admin API, health,
reflection and an HTTP port (Prometheus ``/metrics``, ``/healthz`` for probes); and the lifecycle
around them."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from concurrent import futures
from pathlib import Path
from types import FrameType
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtier.api.v1 import admin_pb2, admin_pb2_grpc, tier_pb2, tier_pb2_grpc
from kvtier.core.admin_token import TOKEN_KEY, read_token, token_path, write_new_token
from kvtier.core.config import KVTierConfig, ServerConfig
from kvtier.core.cpus import pin_process
from kvtier.core.errors import ConfigError
from kvtier.core.memory import keep_freed_pages
from kvtier.core.priority import enter_background, name_this_thread
from kvtier.observability.metrics import build_registry
from kvtier.server.admin import READ_ONLY_METHODS, AdminServicer
from kvtier.server.dataplane import TierServicer
from kvtier.server.http_port import start_http_port
from kvtier.server.interceptors import ErrorInterceptor, TokenAuthInterceptor
from kvtier.server.peers import TenantPolicy, TicketOffice
from kvtier.server.sessions import SessionRegistry
from kvtier.tiering.manager import TierManager
from kvtier.tiers.arena import resolve_group

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
_GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
_TIER_SERVICE = tier_pb2.DESCRIPTOR.services_by_name["TierService"].full_name
_ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
OBJECT_HEALTH_SERVICE = "kvtier.object"
"""Health service name of the object store: NOT_SERVING while its identity or the store fails."""
LMDB_HEALTH_SERVICE = "kvtier.lmdb"
"""Health service name of lmdb: NOT_SERVING from a write refused for want of space until one
commits again, and while its chunks fail verification past ``manager.integrity_unhealthy_failures``
within ``manager.integrity_window_s`` (then it is neither read nor written:
`kvtier.tiering.health`)."""


def split_address(address: str, key: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(key, f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_credentials(cfg: ServerConfig) -> tuple[str | None, str | None]:
    """The admin and read-only tokens, the admin token's file written first where there is none
    (`kvtier.core.admin_token`); refuses a token that would cross the network in clear."""
    host, _ = split_address(cfg.admin_address, "server.admin_address")
    path = token_path(cfg)
    if path is None and cfg.read_token_file is not None:
        raise ConfigError("server.read_token_file", "needs server.admin_token_file as well")
    if path is not None and not is_loopback(host) and cfg.tls_cert_file is None:
        clear = f"a token on non-loopback {host!r} would cross the network in clear"
        if not cfg.allow_insecure_token:
            raise ConfigError(
                TOKEN_KEY if cfg.admin_token_file is not None else "server.admin_address",
                f"refusing to start: {clear}; configure TLS (server.tls_cert_file and "
                "server.tls_key_file, with server.tls_client_ca_file for mTLS), or bind "
                "server.admin_address to 127.0.0.1, or set server.allow_insecure_token: true",
            )
        log.warning("%s (server.allow_insecure_token is set); configure TLS to protect it", clear)
    if path is None:
        return None, None
    if write_new_token(path):
        log.info(
            "wrote a new admin token to %s (mode 0600): kvtier commands run as this user read "
            "it from there",
            path,
        )
    read = cfg.read_token_file
    return read_token(path, TOKEN_KEY), read_token(read, "server.read_token_file") if read else None


def _give_group(path: Path, gid: int) -> None:
    try:
        os.chown(path, -1, gid)
    except OSError as exc:
        raise ConfigError(
            "server.group",
            f"cannot give {path} group {gid}: {exc.strerror} (a non-root kvtierd must be a "
            "member of the group)",
        ) from exc


def _take_socket_path(path: Path) -> None:
    """Remove a socket left by a dead daemon; refuse to start next to a live one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
        log.info("removed stale socket %s", path)
        return
    finally:
        probe.close()
    raise ConfigError("server.socket_path", f"a kvtier daemon is already serving at {path}")


def _server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    if cfg.tls_cert_file is None or cfg.tls_key_file is None:
        return None
    key, cert = cfg.tls_key_file.read_bytes(), cfg.tls_cert_file.read_bytes()
    ca = cfg.tls_client_ca_file.read_bytes() if cfg.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


class Daemon:
    def __init__(self, config: KVTierConfig) -> None:
        self.config = config
        self.admin_port = 0
        self.metrics_port = 0
        self._stopped = threading.Event()
        self._servers: list[tuple[grpc.Server, health.HealthServicer, str]] = []
        self._metrics: WSGIServer | None = None
        self._owns_socket = False  # never remove the socket of another live daemon
        self._socket_gid: int | None = None
        self._tickets: TicketOffice | None = None

    def start(self) -> None:
        cfg = self.config.server
        if cfg.cpus is not None:
            pin_process(cfg.cpus)  # first: every thread started below inherits the mask
        keep_freed_pages()  # see kvtier.core.memory: requests of thousands of keys
        admin_token, read_token = admin_credentials(cfg)  # before anything is created
        admin_host, admin_port = split_address(cfg.admin_address, "server.admin_address")
        self._socket_gid = resolve_group(cfg.group, "server.group")
        if cfg.group is not None and self.config.arena.group is None:
            # the arena goes to the socket's group: whoever may call may map it
            arena = self.config.arena.model_copy(update={"group": cfg.group})
            self.config = self.config.model_copy(update={"arena": arena})
        if cfg.group is not None and self.config.lmdb.group is None:
            # and lmdb's files, read by engines that load from its map
            lmdb = self.config.lmdb.model_copy(update={"group": cfg.group})
            self.config = self.config.model_copy(update={"lmdb": lmdb})
        self.manager = TierManager(self.config)
        try:
            self.sessions = SessionRegistry(self.manager, cfg.session_timeout_s)
            if self.manager.writeback is not None:
                self.manager.writeback.write_all_when(self.sessions.idle)
            self._start_data_plane(cfg)
            self._start_admin(cfg, admin_host, admin_port, admin_token, read_token)
            self._start_metrics(cfg)
        except BaseException:
            self.stop()
            raise
        for _server, health_servicer, service in self._servers:
            for name in ("", service):
                health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._report_tier_health()
        self._reaper = threading.Thread(target=self._reap_loop, name="kvtier-reaper", daemon=True)
        self._reaper.start()

    def _grpc_server(
        self, service: str, interceptors: list[grpc.ServerInterceptor], threads: str
    ) -> grpc.Server:
        """A server for one kvtier service, with health and reflection that name only it; its
        threads are named ``threads`` and keep the process's priority (they answer calls)."""
        server = grpc.server(
            futures.ThreadPoolExecutor(
                self.config.server.workers, threads, initializer=name_this_thread
            ),
            interceptors=interceptors,
            options=_GRPC_OPTIONS,
        )
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (service, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        self._servers.append((server, health_servicer, service))
        return server

    def _start_data_plane(self, cfg: ServerConfig) -> None:
        _take_socket_path(cfg.socket_path)
        self._owns_socket = True
        self._tickets = TicketOffice(cfg.socket_path, self._socket_gid)
        self._tickets.start()
        server = self._grpc_server(_TIER_SERVICE, [ErrorInterceptor()], "kvtier-data")
        tenants = TenantPolicy.of(cfg, self._socket_gid)
        tier_pb2_grpc.add_TierServiceServicer_to_server(
            TierServicer(self.manager, self.sessions, cfg, tickets=self._tickets, tenants=tenants),
            server,
        )
        old_umask = os.umask(0o117)  # the socket is born 0660: no window with wider access
        try:
            server.add_insecure_port(f"unix:{cfg.socket_path}")
            if self._socket_gid is not None:
                _give_group(cfg.socket_path, self._socket_gid)  # bound, not yet listening
            server.start()
        finally:
            os.umask(old_umask)
        os.chmod(cfg.socket_path, 0o660)

    def _start_admin(
        self,
        cfg: ServerConfig,
        host: str,
        port: int,
        admin_token: str | None,
        read_token: str | None,
    ) -> None:
        interceptors: list[grpc.ServerInterceptor] = []
        if admin_token is not None:
            interceptors.append(TokenAuthInterceptor(admin_token, read_token, READ_ONLY_METHODS))
        interceptors.append(ErrorInterceptor())
        server = self._grpc_server(_ADMIN_SERVICE, interceptors, "kvtier-admin")
        admin_pb2_grpc.add_AdminServiceServicer_to_server(
            AdminServicer(self.manager, self.sessions), server
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        creds = _server_credentials(cfg)
        try:
            if creds is None:
                self.admin_port = server.add_insecure_port(address)
            else:
                self.admin_port = server.add_secure_port(address, creds)
        except RuntimeError as exc:
            raise ConfigError("server.admin_address", f"cannot listen on {address}: {exc}") from exc
        server.start()

    def _start_metrics(self, cfg: ServerConfig) -> None:
        if not cfg.metrics_address:
            return
        host, port = split_address(cfg.metrics_address, "server.metrics_address")
        registry = build_registry(self.manager, self.sessions.counts)
        try:
            server = start_http_port(host, port, registry, lambda: not self._stopped.is_set())
        except OSError as exc:
            raise ConfigError("server.metrics_address", f"cannot listen: {exc.strerror}") from exc
        self._metrics = server
        self.metrics_port = server.server_port

    def _reap_loop(self) -> None:
        enter_background()
        interval = min(1.0, self.config.server.session_timeout_s / 4)
        while not self._stopped.wait(interval):
            self.sessions.reap()
            self._report_tier_health()

    def _report_tier_health(self) -> None:
        """The object store's and lmdb's health under service names of their own; the daemon
        itself stays SERVING, since without either it still serves the tiers above. Reads what
        the tiers found (the store's check thread, lmdb's last write: NOT_SERVING while its disk
        is full): no request here, so reaping never waits on them."""
        healthy: dict[str, bool] = {}
        # too many chunks failing verification (each change is logged as it is seen here)
        corrupting = self.manager.health.shunned()
        if self.manager.object is not None:
            healthy[OBJECT_HEALTH_SERVICE] = (
                self.manager.object.healthy and "object" not in corrupting
            )
        if self.manager.lmdb is not None:
            healthy[LMDB_HEALTH_SERVICE] = (
                not self.manager.lmdb.space.full and "lmdb" not in corrupting
            )
        for service, ok in healthy.items():
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if ok
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for _server, health_servicer, _service in self._servers:
                health_servicer.set(service, status)

    def stop(self) -> None:
        """Stop taking calls, hand back what sessions hold, write the arena back, sync, close."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for _server, health_servicer, _service in self._servers:
            health_servicer.enter_graceful_shutdown()
        for server, _health, _service in self._servers:
            server.stop(grace=2.0).wait()
        if self._metrics is not None:
            self._metrics.shutdown()
        if self._tickets is not None:
            self._tickets.close()
        if hasattr(self, "sessions"):
            self.sessions.close_all()
        if hasattr(self, "manager"):
            self.manager.close(self.config.server.drain_timeout_s)
        if self._owns_socket:
            with contextlib.suppress(FileNotFoundError):
                self.config.server.socket_path.unlink()
        log.info("kvtierd stopped")


def serve(config: KVTierConfig) -> int:
    """Run until SIGTERM or SIGINT; exit 0 after a clean drain."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s: draining", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon = Daemon(config)
    daemon.start()
    cfg = config.server
    token = token_path(cfg)
    print(
        f"kvtierd ready: data=unix:{cfg.socket_path} admin_port={daemon.admin_port} "
        f"metrics_port={daemon.metrics_port} arena={daemon.manager.cpu.memory.path} "
        f"admin_token={token or '-'}",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            pass
    finally:
        daemon.stop()
    sys.stdout.flush()
    return 0
