"""kvtierd refuses to start with an admin secret that others could read or that would cross the
network in clear, and says what to change."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.daemon_harness import Processes, write_config


def _token(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "admin.token"
    path.write_text("admin-secret\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
@pytest.mark.parametrize("key", ["admin_token_file", "read_token_file"])
def test_a_token_file_open_to_group_or_others_is_refused(
    procs: Processes, tmp_path: Path, shm_path: Path, key: str, mode: int
) -> None:
    admin = _token(tmp_path, 0o600 if key == "read_token_file" else mode)
    server = {"admin_token_file": str(admin)}
    if key == "read_token_file":
        read = tmp_path / "read.token"
        read.write_text("read-secret\n")
        read.chmod(mode)
        server[key] = str(read)
    files = write_config(tmp_path, shm_path, {"server": server})
    rc, out, err = procs.run_daemon_to_exit(files)
    assert rc == 2, err
    assert f"server.{key}" in err
    assert f"chmod 600 {server[key]}" in err, err
    assert "kvtierd ready" not in out
    assert not files.socket.exists()
    assert not files.arena.exists()


def test_a_token_on_a_non_loopback_address_without_tls_is_refused(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    server = {"admin_address": "0.0.0.0:0", "admin_token_file": str(_token(tmp_path, 0o600))}
    files = write_config(tmp_path, shm_path, {"server": server})
    rc, out, err = procs.run_daemon_to_exit(files)
    assert rc == 2, err
    assert "would cross the network in clear" in err, err
    assert "configure TLS (server.tls_cert_file and server.tls_key_file" in err, err
    assert "kvtierd ready" not in out
    assert not files.arena.exists()


def test_allow_insecure_token_starts_with_a_warning(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    server = {
        "admin_address": "0.0.0.0:0",
        "admin_token_file": str(_token(tmp_path, 0o400)),
        "allow_insecure_token": True,
    }
    files = write_config(tmp_path, shm_path, {"server": server})
    daemon = procs.start_daemon(files)
    assert daemon.signal_and_wait(signal.SIGTERM, 30) == 0
    log = daemon.log_text()
    warned = [line for line in log.splitlines() if "would cross the network in clear" in line]
    assert warned, log
    assert " WARNING " in warned[0], warned
