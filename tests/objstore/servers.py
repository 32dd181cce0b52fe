"""Real servers for object-store tests, on loopback only.

- `ServerProcess` runs moto's S3/STS server or gcp-storage-emulator as a separate process on a
  free port, waits until it answers HTTP, and stops it (or kills it, for fault tests).
- `FakeGceMetadata` is the GCE/GKE metadata server google.auth talks to for Workload Identity.
- `FakeGoogleSts` is the token-exchange endpoint of workload identity federation.
- `FaultProxy` is an HTTP/1.1-aware TCP proxy that sits in front of any of them and injects
  faults: added latency, HTTP 500 answers, closed or reset connections. It records the requests
  it forwards, so a test can see what a server received (headers, the start of the body).
"""

from __future__ import annotations

import base64
import contextlib
import enum
import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO

from tests.fixtures.loopback import Acceptor
from tests.fixtures.processes import LOOPBACK, free_port, http_ready


def jwt_like(claims: dict[str, Any]) -> str:
    """An unsigned JWT-shaped token (header.payload.signature); the fake servers and moto do not
    verify signatures, but SDKs check the shape."""

    def b64(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    now = int(time.time())
    body = {"iat": now, "exp": now + 3600, **claims}
    return f"{b64({'alg': 'RS256', 'typ': 'JWT'})}.{b64(body)}.c2lnbmF0dXJl"


# --------------------------------------------------------------------------------------------
# server processes


class ServerProcess:
    """A server run as a child process on a free loopback port.

    ``argv(port)`` builds its command line; ``ready_path`` is fetched until it answers (any HTTP
    status counts: the server is up). The log goes to ``log_dir/<name>-<port>.log``.
    """

    def __init__(
        self,
        name: str,
        argv: Callable[[int], Sequence[str]],
        ready_path: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 20.0,
    ) -> None:
        self.name = name
        self._argv = argv
        self._ready_path = ready_path
        self._log_dir = log_dir
        self._env = env
        self._start_timeout_s = start_timeout_s
        self.port = 0
        self.log_path = log_dir / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> ServerProcess:
        for _attempt in range(3):  # another process may take the port between probe and bind
            self.port = free_port()
            self.log_path = self._log_dir / f"{self.name}-{self.port}.log"
            with open(self.log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    list(self._argv(self.port)),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._env,
                    start_new_session=True,  # a Ctrl-C of pytest must not reach it first
                )
            if self._wait_ready():
                return self
            self.stop()
        raise RuntimeError(f"{self.name} did not start; log:\n{self.log_tail()}")

    def _wait_ready(self) -> bool:
        assert self._proc is not None
        return http_ready(self.url + self._ready_path, self._proc, self._start_timeout_s)

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL, as a crash would: no goodbye on open connections."""
        self._signal_and_reap(signal.SIGKILL, 5.0)

    def stop(self) -> None:
        self._signal_and_reap(signal.SIGTERM, 5.0)

    def _signal_and_reap(self, sig: int, wait_s: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._proc = None


def moto_server(log_dir: Path, bin_dir: Path) -> ServerProcess:
    """moto's S3+STS server (not started). It accepts any signature and does not verify web
    identity tokens."""
    return ServerProcess(
        "moto",
        lambda port: [str(bin_dir / "moto_server"), "-H", LOOPBACK, "-p", str(port)],
        "/moto-api/",
        log_dir,
    )


def gcs_emulator(log_dir: Path, bin_dir: Path) -> ServerProcess:
    """gcp-storage-emulator (not started). Single-threaded and HTTP/1.0: one request at a time,
    a new connection per request; it ignores the Authorization header."""
    return ServerProcess(
        "gcs-emulator",
        lambda port: [
            str(bin_dir / "gcp-storage-emulator"),
            "start",
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--in-memory",
        ],
        "/",
        log_dir,
    )


# --------------------------------------------------------------------------------------------
# in-process fake identity servers


class _LoopbackHttp:
    """A threaded HTTP server on a free loopback port, run in a background thread."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self._server = ThreadingHTTPServer((LOOPBACK, 0), handler)
        self._server.daemon_threads = True
        self._server.owner = self  # type: ignore[attr-defined]
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def host(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def close(self) -> None:
        """Stop serving; idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5.0)
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def reply(
        self, status: int, body: bytes | str, ctype: str, extra: dict[str, str] | None = None
    ) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def reply_json(self, status: int, obj: Any) -> None:
        self.reply(status, json.dumps(obj), "application/json")


class FakeGceMetadata(_LoopbackHttp):
    """The parts of the GCE metadata server google.auth uses for GKE Workload Identity.

    Point ``GCE_METADATA_HOST`` and ``GCE_METADATA_IP`` at `host`. Tokens are ``gke-token-<n>``,
    a new one per fetch, valid for `token_lifetime_s`; google.auth treats a token with less than
    about 4 minutes left as expired, so a short lifetime makes every request fetch a new one.
    Set `token_error_status` to make token fetches fail with that HTTP status (403: the identity
    is refused; google.auth retries 5xx for several seconds before giving up).
    """

    def __init__(
        self,
        service_account: str = "kvtier@test-project.iam.gserviceaccount.com",
        project_id: str = "test-project",
        token_lifetime_s: int = 3600,
    ) -> None:
        self.service_account = service_account
        self.project_id = project_id
        self.token_lifetime_s = token_lifetime_s
        self.token_error_status: int | None = None
        self.tokens_issued: list[str] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        super().__init__(_MetadataHandler)

    def _issue_token(self) -> dict[str, Any]:
        with self._lock:
            token = f"gke-token-{len(self.tokens_issued) + 1}"
            self.tokens_issued.append(token)
        return {"access_token": token, "expires_in": self.token_lifetime_s, "token_type": "Bearer"}


class _MetadataHandler(_Handler):
    def do_GET(self) -> None:
        owner: FakeGceMetadata = self.server.owner  # type: ignore[attr-defined]
        path, _, _query = self.path.partition("?")
        owner.paths.append(self.path)
        flavor = {"Metadata-Flavor": "Google"}
        if path == "/":
            self.reply(200, "computeMetadata/\n", "application/text", flavor)
            return
        if self.headers.get("Metadata-Flavor") != "Google":
            self.reply(403, "Missing Metadata-Flavor header", "text/plain", flavor)
            return
        base = "/computeMetadata/v1/"
        rel = path[len(base) :] if path.startswith(base) else None
        sa_prefix = "instance/service-accounts/"
        if rel == "project/project-id":
            self.reply(200, owner.project_id, "application/text", flavor)
        elif rel == "universe/universe-domain":
            self.reply(200, "googleapis.com", "application/text", flavor)
        elif rel is not None and rel.startswith(sa_prefix):
            account, _, what = rel[len(sa_prefix) :].partition("/")
            if account not in ("default", owner.service_account):
                self.reply(404, "no such service account", "text/plain", flavor)
            elif what == "":
                info = {
                    "aliases": ["default"],
                    "email": owner.service_account,
                    "scopes": ["https://www.googleapis.com/auth/cloud-platform"],
                }
                self.reply(200, json.dumps(info), "application/json", flavor)
            elif what == "token" and owner.token_error_status is not None:
                self.reply(owner.token_error_status, "token refused", "text/plain", flavor)
            elif what == "token":
                self.reply(200, json.dumps(owner._issue_token()), "application/json", flavor)
            else:
                self.reply(404, "not found", "text/plain", flavor)
        else:
            self.reply(404, "not found", "text/plain", flavor)


class FakeGoogleSts(_LoopbackHttp):
    """The token exchange (RFC 8693) of workload identity federation, at ``/v1/token``.

    Every exchange returns a new ``sts-token-<n>``; `subject_tokens` records the OIDC tokens it
    was given, so a test sees that the credential file was read again.
    """

    def __init__(self, token_lifetime_s: int = 3600) -> None:
        self.token_lifetime_s = token_lifetime_s
        self.subject_tokens: list[str] = []
        self.audiences: list[str] = []
        self.tokens_issued: list[str] = []
        self._lock = threading.Lock()
        super().__init__(_StsHandler)

    @property
    def token_url(self) -> str:
        return f"{self.url}/v1/token"


class _StsHandler(_Handler):
    def do_POST(self) -> None:
        owner: FakeGoogleSts = self.server.owner  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        form = urllib.parse.parse_qs(self.rfile.read(length).decode())
        if self.path != "/v1/token" or form.get("grant_type") != [
            "urn:ietf:params:oauth:grant-type:token-exchange"
        ]:
            self.reply_json(400, {"error": "invalid_request"})
            return
        with owner._lock:
            owner.subject_tokens.append(form.get("subject_token", [""])[0])
            owner.audiences.append(form.get("audience", [""])[0])
            token = f"sts-token-{len(owner.tokens_issued) + 1}"
            owner.tokens_issued.append(token)
        self.reply_json(
            200,
            {
                "access_token": token,
                "issued_token_type": "urn:ietf:params:oauth:token-type:access_token",
                "token_type": "Bearer",
                "expires_in": owner.token_lifetime_s,
            },
        )


# --------------------------------------------------------------------------------------------
# fault-injecting proxy


class FaultMode(enum.Enum):
    PASS = "pass"
    """Forward everything unchanged."""
    DELAY = "delay"
    """Forward, but hold the first bytes of every response for ``delay_ms``."""
    HTTP_500 = "http_500"
    """Answer every request with ``500 Internal Server Error``, no body, and close; nothing
    reaches the server."""
    CLOSE = "close"
    """Read the request, then close the connection without an answer."""
    RESET = "reset"
    """Reset (RST) every connection as soon as it is accepted."""


@dataclass(eq=False)
class SeenRequest:
    method: str
    target: str
    headers: dict[str, str]
    """Names lower-cased."""
    body: bytearray
    """The first `FaultProxy.BODY_RECORD_BYTES` bytes of the body, as framed on the wire.
    Filled before each part is forwarded, so it is complete once the server has answered."""


@dataclass(eq=False)  # identity, so that connections can be kept in a set
class _Conn:
    client: socket.socket
    upstream: socket.socket | None = None
    requests_sent: int = 0
    responses_started: int = 0
    threads: list[threading.Thread] = field(default_factory=list)

    def abort(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class FaultProxy:
    """A loopback TCP proxy in front of one HTTP server, with switchable faults.

    Point a client at `url` instead of the server. `set_mode` switches the fault; it also closes
    the connections open at that moment, so the new mode applies from the next request on (a
    request in flight then fails, and pooled keep-alive connections are reopened). `requests`
    lists what was forwarded or answered. HTTP/1.1 (and 1.0) only: it parses request framing
    (Content-Length, chunked, ``Expect: 100-continue``) to count and record requests.
    """

    BODY_RECORD_BYTES = 64 << 10

    def __init__(self, upstream: str | tuple[str, int]) -> None:
        if isinstance(upstream, str):
            parts = urllib.parse.urlsplit(upstream)
            if not (parts.hostname and parts.port):
                raise ValueError(f"{upstream!r}: want http://host:port")
            upstream = (parts.hostname, parts.port)
        self.upstream = upstream
        self._mode = FaultMode.PASS
        self._delay_s = 0.0
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._seen: list[SeenRequest] = []
        self.errors: list[BaseException] = []
        """Unexpected exceptions in the proxy's threads; a working proxy leaves it empty."""
        self.connections_accepted = 0
        self._acceptor = Acceptor(self._accept, self._guard)
        self.port = self._acceptor.port

    @property
    def url(self) -> str:
        return self._acceptor.url

    @property
    def mode(self) -> FaultMode:
        return self._mode

    @property
    def requests(self) -> list[SeenRequest]:
        with self._lock:
            return list(self._seen)

    def clear_requests(self) -> None:
        with self._lock:
            self._seen.clear()

    def set_mode(self, mode: FaultMode, delay_ms: float = 0.0) -> None:
        if mode is FaultMode.DELAY and delay_ms <= 0:
            raise ValueError("DELAY needs delay_ms > 0")
        with self._lock:
            self._mode = mode
            self._delay_s = delay_ms / 1000.0
            conns = list(self._conns)
        for conn in conns:
            conn.abort()

    def close(self) -> None:
        self._acceptor.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.abort()
        for conn in conns:
            for t in conn.threads:
                t.join(5.0)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except OSError:
                pass  # peers going away, or abort(): expected in a fault proxy
            except Exception as exc:  # surfaced through `errors`, never as a thread crash
                self.errors.append(exc)

        return run

    def _accept(self, client: socket.socket) -> None:
        self.connections_accepted += 1
        if self._mode is FaultMode.RESET:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            return
        conn = _Conn(client)
        with self._lock:
            self._conns.add(conn)
        t = threading.Thread(target=self._guard(lambda c=conn: self._serve(c)), daemon=True)
        conn.threads.append(t)
        t.start()

    def _serve(self, conn: _Conn) -> None:
        reader = conn.client.makefile("rb")
        try:
            while True:
                head = _read_head(reader)
                if head is None:
                    return
                method, target, headers, raw = head
                # recorded before it is forwarded: a client that has its answer finds it listed
                seen = SeenRequest(method, target, headers, bytearray())
                with self._lock:
                    self._seen.append(seen)
                mode = self._mode
                if mode is FaultMode.CLOSE:
                    return
                if mode is FaultMode.HTTP_500:
                    if "100-continue" not in headers.get("expect", "").lower():
                        _read_body(reader, headers, None, seen.body, self.BODY_RECORD_BYTES)
                    _send_500(conn.client)
                    return
                if conn.upstream is None:
                    conn.upstream = socket.create_connection(self.upstream, timeout=10.0)
                    conn.upstream.settimeout(None)
                    pump = threading.Thread(
                        target=self._guard(lambda: self._pump_responses(conn)), daemon=True
                    )
                    conn.threads.append(pump)
                    pump.start()
                conn.requests_sent += 1
                conn.upstream.sendall(raw)
                _read_body(reader, headers, conn.upstream, seen.body, self.BODY_RECORD_BYTES)
        finally:
            reader.close()
            conn.abort()
            conn.client.close()
            with self._lock:
                self._conns.discard(conn)

    def _pump_responses(self, conn: _Conn) -> None:
        upstream = conn.upstream
        assert upstream is not None
        try:
            while True:
                data = upstream.recv(1 << 16)
                if not data:
                    return
                if conn.responses_started < conn.requests_sent:
                    conn.responses_started = conn.requests_sent
                    if self._mode is FaultMode.DELAY and self._acceptor.closing.wait(self._delay_s):
                        return
                conn.client.sendall(data)
        finally:
            conn.abort()  # the server closed: so do we, so the client reconnects
            upstream.close()


def _read_head(reader: BinaryIO) -> tuple[str, str, dict[str, str], bytes] | None:
    lines: list[bytes] = []
    while True:
        line = reader.readline(65537)
        if not line:
            return None  # the client closed
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            break
        if len(lines) > 200:
            raise ValueError("request head too long")
    method, target, _version = lines[0].decode("latin-1").split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:-1]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return method, target, headers, b"".join(lines)


def _read_body(
    reader: BinaryIO,
    headers: dict[str, str],
    sink: socket.socket | None,
    kept: bytearray,
    keep: int,
) -> None:
    """Read one request body, forwarding it to `sink` if given; its first `keep` bytes go to
    `kept`, each part before it is forwarded."""

    def copy(data: bytes) -> None:
        if len(kept) < keep:
            kept.extend(data[: keep - len(kept)])
        if sink is not None:
            sink.sendall(data)

    def copy_exact(n: int) -> None:
        while n > 0:
            data = reader.read(min(n, 1 << 16))
            if not data:
                raise ConnectionError("client closed inside a body")
            copy(data)
            n -= len(data)

    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = reader.readline(1024)
            if not size_line:
                raise ConnectionError("client closed inside a chunked body")
            copy(size_line)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = reader.readline(65537)
                    copy(trailer)
                    if trailer in (b"\r\n", b"\n", b""):
                        return
            copy_exact(size + 2)
    copy_exact(int(headers.get("content-length") or 0))


def _send_500(client: socket.socket) -> None:
    # no body: what a load balancer in trouble sends, and neutral between XML and JSON APIs
    client.sendall(
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
