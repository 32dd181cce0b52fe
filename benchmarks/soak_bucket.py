"""One moto bucket shared by several nodes, each reaching it through a recording proxy of its
own: which node wrote and which deleted each object is seen on the wire, not asked of kvtierd.

A node's ``AWS_ENDPOINT_URL`` is its proxy; the proxy forwards every request to moto unchanged
(signatures included) and records successful PUTs and DELETEs (single and ``?delete`` batches).
`Ledger.check` then lists the bucket and compares: an object that vanished although no node
that uploaded it deleted it, or that a node deleted without ever uploading it, is a foreign
delete.
"""

from __future__ import annotations

import http.client
import re
import threading
import urllib.parse
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import boto3

LOOPBACK = "127.0.0.1"
_DELETE_KEY = re.compile(rb"<Key>(.*?)</Key>", re.S)
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection"}


@dataclass
class Ledger:
    """What each node wrote and deleted, by object name (the key within the bucket)."""

    bucket: str
    uploaded: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    """node -> name -> bytes of its last successful PUT."""
    deleted: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    overwritten: int = 0
    """PUTs that replaced an object another node had uploaded and nobody had deleted."""
    foreign: dict[str, str] = field(default_factory=dict)
    """Objects deleted by a node that did not upload them, or gone with none of their
    uploaders having deleted them, with what was seen of each; once seen, kept."""
    _puts: int = 0
    _put_at: dict[str, int] = field(default_factory=dict)
    """name -> the number of the PUT that wrote it last (`mark`)."""
    _live: dict[str, str] = field(default_factory=dict)
    """name -> the node whose PUT wrote it last, while no one has deleted it."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, node: str, name: str, nbytes: int) -> None:
        with self._lock:
            writer = self._live.get(name)
            if writer is not None and writer != node:
                self.overwritten += 1
            self._live[name] = node
            self.uploaded[node][name] = nbytes
            self._puts += 1
            self._put_at[name] = self._puts

    def mark(self) -> int:
        """Taken before listing the bucket: what is written after it may be missing from the
        listing without having gone."""
        with self._lock:
            return self._puts

    def delete(self, node: str, names: list[str]) -> None:
        with self._lock:
            for name in names:
                writer = self._live.pop(name, None)
                if writer is not None and name not in self.uploaded[node]:
                    # another node's, and never this one's
                    self.foreign[name] = f"written by {writer}, deleted by {node}"
                self.deleted[node].add(name)

    def check(self, listed: dict[str, int], budgets: dict[str, int], mark: int) -> BucketCheck:
        """Compare the bucket's listing (name -> bytes), taken after `mark`, with what the
        nodes did."""
        with self._lock:
            owners: dict[str, set[str]] = defaultdict(set)
            for node, names in self.uploaded.items():
                for name in names:
                    owners[name].add(node)
            for name, by in owners.items():
                if self._put_at[name] > mark:
                    continue  # written while the listing ran
                if name not in listed and not any(name in self.deleted[o] for o in by):
                    deleters = sorted(n for n, names in self.deleted.items() if name in names)
                    self.foreign.setdefault(
                        name, f"uploaded by {sorted(by)}, gone; deleted by {deleters}"
                    )
            # an object is the node's whose PUT wrote it last: a name a node deleted and
            # another wrote again is the other's, counted once
            held: dict[str, int] = defaultdict(int)
            for name, writer in self._live.items():
                held[writer] += listed.get(name, 0)
            above = {
                node: max(0, held[node] - budgets[node])
                for node in self.uploaded
                if node in budgets
            }
            return BucketCheck(
                foreign_deleted=len(self.foreign),
                foreign_examples=[f"{n}: {why}" for n, why in list(self.foreign.items())[:5]],
                bytes_above_budget=above,
                bucket_bytes=sum(listed.values()),
                overwritten=self.overwritten,
            )


@dataclass(frozen=True)
class BucketCheck:
    foreign_deleted: int
    foreign_examples: list[str]
    bytes_above_budget: dict[str, int]
    bucket_bytes: int
    overwritten: int


class RecordingProxy:
    """An HTTP proxy in front of moto for one node, recording into a `Ledger`."""

    def __init__(self, node: str, upstream: str, ledger: Ledger) -> None:
        parts = urllib.parse.urlsplit(upstream)
        assert parts.hostname is not None
        assert parts.port is not None
        target = (parts.hostname, parts.port)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a request log line per S3 call would swamp the benchmark's output

            def handle_expect_100(self) -> bool:
                self.send_response_only(100)
                self.end_headers()
                return True

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                host = self.headers.get("Host", "")
                if self.command in ("DELETE", "POST"):  # before the object can be seen gone
                    proxy.record(self.command, host, self.path, body)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                upstream = http.client.HTTPConnection(*target, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    payload = response.read()
                    if self.command == "PUT" and response.status < 300:  # it exists now
                        proxy.record(self.command, host, self.path, body)
                    self.send_response_only(response.status, response.reason)
                    for key, value in response.getheaders():
                        if key.lower() not in _HOP_HEADERS and key.lower() != "content-length":
                            self.send_header(key, value)
                    head = self.command == "HEAD"
                    length_header = response.getheader("Content-Length")
                    self.send_header(
                        "Content-Length",
                        length_header if head and length_header else str(len(payload)),
                    )
                    self.end_headers()
                    if not head:
                        try:
                            self.wfile.write(payload)
                        except OSError:  # a node SIGKILLed while its request ran
                            self.close_connection = True
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.node = node
        self.ledger = ledger
        self.server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.server.server_address[1]}"

    def record(self, method: str, host: str, target: str, body: bytes) -> None:
        path, _, query = target.partition("?")
        name = self._object_name(host, urllib.parse.unquote(path))
        if method == "PUT" and name and "uploadId" not in query:
            self.ledger.put(self.node, name, len(body))
        elif method == "DELETE" and name:
            self.ledger.delete(self.node, [name])
        elif method == "POST" and "delete" in urllib.parse.parse_qs(query, True):
            names = [urllib.parse.unquote(k.decode()) for k in _DELETE_KEY.findall(body)]
            self.ledger.delete(self.node, names)

    def _object_name(self, host: str, path: str) -> str:
        bucket = self.ledger.bucket
        if host.startswith(bucket + "."):  # virtual-hosted style
            return path.lstrip("/")
        head = f"/{bucket}/"
        return path[len(head) :] if path.startswith(head) else ""

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _s3(endpoint: str) -> Any:
    # the benchmark's own view of the bucket: moto takes any keys
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="soak",
        aws_secret_access_key="soak",
    )


def listing(endpoint: str, bucket: str) -> dict[str, int]:
    """Every object in the bucket, name -> bytes."""
    s3 = _s3(endpoint)
    out: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents", []):
            out[item["Key"]] = int(item["Size"])
    return out


def create_bucket(endpoint: str, bucket: str) -> None:
    _s3(endpoint).create_bucket(Bucket=bucket)
