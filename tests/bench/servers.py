"""A real vLLM OpenAI server in a subprocess, and a proxy in front of it that fails requests."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.models import engine_env

MAX_MODEL_LEN = 512
BLOCK_SIZE = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log_tail(log: Path, n: int = 40) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(lines[-n:])


@contextmanager
def vllm_server(model: Path, tmp: Path, *, startup_s: float = 180.0) -> Iterator[str]:
    """Serve ``model`` on a free loopback port; yields the base URL. The log is at
    ``tmp / "server.log"`` and its tail is in any start-up failure."""
    port = free_port()
    env = {**os.environ, **engine_env(tmp)}
    # the API server always runs its engine in a child process
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; far more than the tests' prompts need
    log = tmp / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--block-size", str(BLOCK_SIZE),
        "--dtype", "float32",
        "--enforce-eager",
        "--seed", "0",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{_log_tail(log)}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not healthy after {startup_s:.0f} s:\n{_log_tail(log)}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)  # the group holds the engine core too
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


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
