"""The real vLLM OpenAI server (from tests/fixtures/servers.py), its counters, and a proxy in front
of it that fails requests."""

from __future__ import annotations

import http.client
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.processes import free_port
from tests.fixtures.servers import BLOCK_SIZE, MAX_MODEL_LEN, vllm_server

__all__ = ["BLOCK_SIZE", "MAX_MODEL_LEN", "FaultProxy", "counters", "free_port", "vllm_server"]


def counters(url: str) -> dict[str, float]:
    """vLLM's counters at ``url``, each summed over its label sets."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


class FaultProxy:
    """Forwards every request to ``upstream``; answers every ``every``-th completion with
    HTTP 500 instead (never, when 0). Counts the completions it saw."""

    def __init__(self, upstream: str, every: int = 0) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.every = every
        self.completions = 0
        self.failed = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command == "POST" and self.path.endswith("/completions"):
                    with proxy._lock:
                        proxy.completions += 1
                        fail = proxy.every and proxy.completions % proxy.every == 0
                        proxy.failed += bool(fail)
                    if fail:
                        self._reply(500, b'{"error": {"message": "injected fault"}}')
                        return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                try:
                    headers = {"Content-Type": self.headers.get("Content-Type", "")}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    self._reply(
                        response.status, response.read(), response.getheader("Content-Type")
                    )
                finally:
                    conn.close()

            def _reply(self, status: int, data: bytes, kind: str | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind or "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
