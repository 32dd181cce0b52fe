"""kvtierd's uploads: objects a probe finds, and chunks that reach the store although the daemon
stopped before it could upload them."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.core import blockfmt
from kvtier.core.keys import NAMESPACE_BYTES, ChunkKey
from kvtier.tiers.objstore.backend import open_backend
from tests.integration.daemon_harness import (
    CHUNK,
    QUICK_TO_GIVE_UP,
    DaemonFiles,
    Processes,
    key_of,
    object_node,
)
from tests.objstore.fixtures import ProxiedStore
from tests.objstore.servers import FaultMode


def node(
    root: Path, url: str, name: str, drain_timeout_s: float = 20.0, **object_overrides: Any
) -> DaemonFiles:
    server = {"server": {"drain_timeout_s": drain_timeout_s}}
    return object_node(root / name, url, server, **{**QUICK_TO_GIVE_UP, **object_overrides})


def stored_keys(url: str) -> set[ChunkKey]:
    """Every chunk in the store, each object read whole and verified."""
    backend = open_backend(url, 10.0)
    try:
        return {
            key for info in backend.list() for key, *_ in blockfmt.split(backend.get(info.name))
        }
    finally:
        backend.close()


def wait_for(what: Callable[[], bool], timeout_s: float, why: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, why()
        time.sleep(0.2)


def test_every_prompt_drained_together_starts_an_object_a_probe_finds(
    procs: Processes, tmp_path: Path, file_store: str
) -> None:
    # a long linger: both prompts wait in the packer together, as on a drain
    files_a = node(tmp_path, file_store, "a", pack_linger_ms=3000)
    a = procs.start_daemon(files_a)
    try:
        first = procs.client(files_a.socket, "dp0", "--store", "0:6")
        second = procs.client(files_a.socket, "dp0", "--store", "100:106")
        assert first["stored"] == list(range(6))
        assert second["stored"] == list(range(100, 106))
        assert a.signal_and_wait(signal.SIGTERM, 60) == 0
    finally:
        files_a.arena.unlink(missing_ok=True)
    assert stored_keys(file_store) == {key_of(i) for i in [*range(6), *range(100, 106)]}

    files_b = node(tmp_path, file_store, "b")  # a wiped node: empty lmdb and index
    b = procs.start_daemon(files_b)
    try:
        # the second prompt first: a probe for the first would bring the second along
        for prompt in ("100:106", "0:6"):
            found = procs.client(files_b.socket, "dp0", "--lookup", prompt, "--load", prompt)
            assert found["hits"] == 6, (prompt, found)
            assert found["loaded"] == [True] * 6  # the harness checks every byte
    finally:
        assert b.signal_and_wait(signal.SIGTERM, 60) == 0
        files_b.arena.unlink(missing_ok=True)


def test_uploads_queued_at_shutdown_reach_the_store_after_a_restart(
    procs: Processes, tmp_path: Path, proxied_store: ProxiedStore
) -> None:
    url, proxy = proxied_store("s3")
    files = node(
        tmp_path,
        url,
        "a",
        drain_timeout_s=2.0,  # what uploads get of the drain
        pack_target_bytes=CHUNK,  # one chunk per object: most wait in the queue
        upload_concurrency=1,
        request_timeout_s=1.0,
        retries=0,
        breaker_failures=1000,
    )
    keys = {key_of(i) for i in range(12)}
    daemon = procs.start_daemon(files)
    try:
        # one upload first, so that the identity is resolved while the store answers
        assert procs.client(files.socket, "dp0", "--store", "100:101")["stored"] == [100]
        admin = daemon.admin()
        try:
            assert admin.drain(20.0).complete  # to lmdb, then to the store
        finally:
            admin.close()
        assert key_of(100) in stored_keys(url)
        proxy.set_mode(FaultMode.DELAY, delay_ms=60_000)  # the store hangs
        assert procs.client(files.socket, "dp0", "--store", "0:12")["stored"] == list(range(12))
        assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0
        assert "chunks not uploaded" in daemon.log_text()
        proxy.set_mode(FaultMode.PASS)
        missing = keys - stored_keys(url)
        assert missing, "every chunk was uploaded before the stop: nothing left to test"

        proxy.clear_requests()
        daemon = procs.start_daemon(files)  # the store answers again
        # the namespace is offered once it is registered: an engine starts
        assert procs.client(files.socket, "dp0", "--lookup", "0:12")["hits"] == 12
        wait_for(
            lambda: keys <= stored_keys(url),
            30.0,
            lambda: f"not in the store: {len(keys - stored_keys(url))}\n{daemon.log_text()}",
        )
        puts = [r.target for r in proxy.requests if r.method == "PUT"]
        assert puts, "the chunks came back some other way than an upload"
        indexed = key_of(100)[NAMESPACE_BYTES:].hex()  # uploaded before: never again
        assert not [t for t in puts if indexed in t], puts
    finally:
        proxy.set_mode(FaultMode.PASS)
        if daemon.proc.poll() is None:
            assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0
        files.arena.unlink(missing_ok=True)
