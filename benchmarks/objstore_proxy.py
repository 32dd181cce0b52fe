"""A loopback TCP proxy that delays a store's answers, for the object benchmark's lookups against a
slow store; run as ``python -m benchmarks.objstore_proxy PORT`` by `ProxyProcess`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from benchmarks.harness.sizes import KiB
from tests.fixtures.loopback import Acceptor
from tests.fixtures.processes import LOOPBACK


class _Unanswered:
    """When a connection's unanswered request (its last part) arrived: the first bytes of the
    answer wait for that moment plus the delay."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._lock = threading.Lock()

    def arrived(self) -> None:
        with self._lock:
            self._since = time.monotonic()

    def answer_after(self, delay_s: float) -> None:
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            wait = since + delay_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)


class DelayProxy:
    """A loopback TCP proxy that holds the first bytes of every response until ``delay_s``
    after the request (or its last part) reached it. ``delay_s`` may change at any time."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream = (LOOPBACK, upstream_port)
        self.delay_s = delay_s
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._acceptor = Acceptor(self._accept)
        self.port = self._acceptor.port

    @property
    def url(self) -> str:
        return self._acceptor.url

    def _accept(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5.0)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._socks.update((client, upstream))
        unanswered = _Unanswered()
        pumps = (
            (client, upstream, unanswered.arrived),
            (upstream, client, lambda: unanswered.answer_after(self.delay_s)),
        )
        for src, dst, before_sending in pumps:
            threading.Thread(
                target=self._pump, args=(src, dst, before_sending), daemon=True
            ).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, before_sending: Callable[[], None]
    ) -> None:
        try:
            while data := src.recv(256 * KiB):
                before_sending()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(src, dst)

    def _drop(self, *socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
            with self._lock:
                self._socks.discard(s)

    def close(self) -> None:
        self._acceptor.close()
        with self._lock:
            socks = list(self._socks)
        self._drop(*socks)


class ProxyProcess:
    """A `DelayProxy` in a child process (``python -m benchmarks.objstore_proxy``), so that its
    threads do not compete for the measured process's GIL. Its delay is set over a pipe."""

    def __init__(self, upstream_port: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.objstore_proxy", str(upstream_port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the proxy did not start: {line!r}")
        self.port = int(line)
        self.delay_ms = 0.0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def set_delay(self, delay_ms: float) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"{delay_ms}\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "ok":
            raise RuntimeError("the proxy did not take its new delay")
        self.delay_ms = delay_ms

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # end of input: the proxy exits
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def serve_proxy(upstream_port: int) -> int:
    """The proxy's process: print the port, then take one delay in ms per stdin line."""
    proxy = DelayProxy(upstream_port, 0.0)
    print(proxy.port, flush=True)
    try:
        for line in sys.stdin:
            proxy.delay_s = float(line) / 1e3
            print("ok", flush=True)
    finally:
        proxy.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(serve_proxy(int(sys.argv[1])))
