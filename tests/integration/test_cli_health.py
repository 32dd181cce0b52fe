"""`kvtier health`, the images' health check, run as a command against a kvtierd process."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.daemon_harness import ROOT, DaemonFiles, Processes, clean_env


def _health(*args: str) -> tuple[int, str, str, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "health", *args],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - start


@pytest.fixture
def refusing_address() -> Iterator[str]:
    """A port that is bound but never listened on: connections to it are refused, and no other
    process can take it while the test runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def test_health_exits_0_against_a_serving_daemon(
    procs: Processes, files: DaemonFiles, tmp_path: Path
) -> None:
    daemon = procs.start_daemon(files)
    rc, out, err, _ = _health("--address", daemon.admin_address)
    assert rc == 0, err
    assert out.strip() == f"kvtier.v1.AdminService at {daemon.admin_address}: SERVING"
    # from the configuration, as the image runs it: the wildcard listen address is dialled on
    # loopback, and no token is needed
    config = yaml.safe_load(files.config.read_text())
    config["server"]["admin_address"] = f"0.0.0.0:{daemon.admin_port}"
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.safe_dump(config))
    rc, out, err, _ = _health("--config", str(path))
    assert rc == 0, err
    assert out.strip().endswith(f"127.0.0.1:{daemon.admin_port}: SERVING")
    # a service the daemon does not serve is not healthy
    rc, out, err, _ = _health("--address", daemon.admin_address, "--service", "kvtier.v1.Nope")
    assert rc == 1
    assert "NOT_FOUND" in err


def test_health_exits_1_quickly_where_nothing_listens(refusing_address: str) -> None:
    rc, out, err, elapsed = _health("--address", refusing_address, "--timeout", "2")
    assert rc == 1
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kvtier health: kvtier.v1.AdminService at {refusing_address}: ")
    assert "UNAVAILABLE" in lines[0]
    assert elapsed < 15.0  # interpreter start and imports; the call itself fails at once


def test_health_exits_1_on_a_configuration_it_cannot_read(tmp_path: Path) -> None:
    rc, _out, err, _ = _health("--config", str(tmp_path / "missing.yaml"))
    assert rc == 1  # not 2: Docker reserves 2 in health checks
    assert err.startswith("kvtier health: invalid configuration:")
