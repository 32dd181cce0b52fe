"""kvtierd's HTTP port (``server.metrics_address``): Prometheus ``/metrics``, and ``/healthz``
for kubelet's liveness, readiness and startup probes.

``/healthz`` takes no token, reads nothing and changes nothing: it answers 200 ``ok`` while
kvtierd serves and 503 once it is stopping. Probes ask it here, so the admin API need not
listen where kubelet reaches it, nor take bearer tokens in clear for kubelet's sake.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.registry import Collector

__all__ = ["HEALTH_PATH", "start_http_port"]

HEALTH_PATH = "/healthz"

StartResponse = Callable[..., Any]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds up a stop


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds and every scrape would flood the log."""


def _app(
    registry: Collector, serving: Callable[[], bool]
) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        ok = serving()
        body = b"ok\n" if ok else b"stopping\n"
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    return app


def start_http_port(
    host: str, port: int, registry: Collector, serving: Callable[[], bool]
) -> WSGIServer:
    """Serve ``/metrics`` from ``registry`` and ``/healthz`` from ``serving()`` on a thread of
    its own; ``shutdown()`` on the returned server stops it. Raises OSError when the address
    cannot be bound."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server_class = type("HttpPort", (_ThreadingServer,), {"address_family": family})
    server: WSGIServer = make_server(
        str(sockaddr[0]), port, _app(registry, serving), server_class, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="kvtier-http", daemon=True).start()
    return server
