"""The admin API of a kvtierd with the default configuration takes only callers holding the token
it wrote at its first start, and the `kvtier` command run as the daemon's user finds that token
with no flag."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from contextlib import closing
from pathlib import Path

import pytest

from kvtier import __version__
from kvtier.core.errors import PermissionDeniedError
from kvtier.server.http_port import HEALTH_PATH
from tests.integration.daemon_harness import (
    ROOT,
    Processes,
    RunningDaemon,
    clean_env,
    write_config,
)

N = 8
DEFAULT_ADMIN_PORT = 7461


def _objects(bucket: Path) -> list[Path]:
    return [meta for meta in bucket.rglob("*.meta") if meta.with_suffix("").exists()]


def _uploaded(daemon: RunningDaemon, procs: Processes, bucket: Path) -> None:
    """``N`` chunks stored by an engine, written to lmdb and uploaded to ``bucket``."""
    out = procs.client(daemon.files.socket, "dp0", "--store", f"0:{N}")
    assert out["stored"] == list(range(N))
    with closing(daemon.admin()) as admin:
        assert admin.drain(20.0).complete
    deadline = time.monotonic() + 20.0
    while not _objects(bucket):
        assert time.monotonic() < deadline, f"nothing uploaded:\n{daemon.log_text()}"
        time.sleep(0.05)


def test_the_default_admin_api_refuses_an_unauthenticated_gc_and_evict(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    state = tmp_path / "state"
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    # nothing about authentication configured: only where the tiers keep their files
    files = write_config(
        tmp_path,
        shm_path,
        {"object": {"url": bucket.as_uri(), "index_path": str(tmp_path / "objindex")}},
    )
    daemon = procs.start_daemon(files, env={"XDG_STATE_HOME": str(state)})
    _uploaded(daemon, procs, bucket)
    uploaded = _objects(bucket)

    with closing(daemon.admin("")) as anonymous:
        with pytest.raises(PermissionDeniedError, match="not authenticated: missing bearer"):
            list(anonymous.gc(retention_s=0))
        with pytest.raises(PermissionDeniedError, match="not authenticated: missing bearer"):
            anonymous.evict(tier="cpu")
    with (
        closing(daemon.admin("not-the-token")) as guessing,
        pytest.raises(PermissionDeniedError, match="not authenticated: invalid bearer"),
    ):
        list(guessing.gc(retention_s=0))
    assert _objects(bucket) == uploaded  # nothing was deleted
    # the token kvtierd wrote at its start, in its state directory, for its own user only
    token = state / "kvtier" / "admin.token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert daemon.admin_token == token.read_text().strip()
    with closing(daemon.admin()) as admin:
        cpu = next(t for t in admin.stats().tiers if t.tier == "cpu")
        assert cpu.usage.chunks == N, "the arena was evicted"
        assert admin.evict(tier="cpu") == {"cpu": N}


def test_probes_get_healthz_without_a_token_while_the_admin_api_still_refuses_one(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    files = write_config(tmp_path, shm_path)
    daemon = procs.start_daemon(files, env={"XDG_STATE_HOME": str(tmp_path / "state")})
    assert daemon.admin_token  # the admin API is token-only
    # as kubelet asks: a plain GET, no header of any kind
    url = f"http://127.0.0.1:{daemon.metrics_port}{HEALTH_PATH}"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.read() == b"ok\n"  # nothing of the daemon's state
    with (
        closing(daemon.admin("")) as anonymous,
        pytest.raises(PermissionDeniedError, match="not authenticated: missing bearer"),
    ):
        anonymous.stats()
    with closing(daemon.admin()) as admin:
        assert admin.stats().tiers


def _kvtier(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        cwd=ROOT,
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_kvtier_stats_finds_the_default_daemon_and_its_token_without_flags(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", DEFAULT_ADMIN_PORT))
        except OSError:
            pytest.skip(f"port {DEFAULT_ADMIN_PORT}, the admin API's default, is taken here")
    state = {"XDG_STATE_HOME": str(tmp_path / "state")}
    files = write_config(
        tmp_path, shm_path, {"server": {"admin_address": f"127.0.0.1:{DEFAULT_ADMIN_PORT}"}}
    )
    daemon = procs.start_daemon(files, env=state)
    assert daemon.admin_port == DEFAULT_ADMIN_PORT
    # the same user and state directory as the daemon, and nothing else: no flag, no config
    done = _kvtier("stats", "--json", env=state)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["version"] == __version__

    # another state directory (another user's, say) has no token: refused, and told why
    other = {"XDG_STATE_HOME": str(tmp_path / "elsewhere")}
    done = _kvtier("stats", env=other)
    assert done.returncode == 1
    assert "not authenticated: missing bearer token" in done.stderr
    assert "--token-file" in done.stderr
