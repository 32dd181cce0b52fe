"""The admin API over mutual TLS, from a client and from the `kvtier` command (stats, health),
with certificates made by openssl for the test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import __version__
from kvtier.core.config import from_mapping
from kvtier.core.errors import KVTierError
from kvtier.rpc import AdminClient, ClientTLS
from kvtier.server.daemon import Daemon, admin_credentials
from tests.integration.daemon_harness import (
    ROOT,
    Processes,
    RunningDaemon,
    clean_env,
    write_config,
)

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _signed(pki: Path, name: str, ext: str) -> None:
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        str(pki / f"{name}.key"),
        "-out",
        str(pki / f"{name}.csr"),
    )
    (pki / f"{name}.ext").write_text(ext)
    _openssl(
        "x509",
        "-req",
        "-in",
        str(pki / f"{name}.csr"),
        "-CA",
        str(pki / "ca.crt"),
        "-CAkey",
        str(pki / "ca.key"),
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        str(pki / f"{name}.ext"),
        "-out",
        str(pki / f"{name}.crt"),
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pki = tmp_path_factory.mktemp("pki")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=kvtier-test-ca",
        "-days",
        "1",
        "-keyout",
        str(pki / "ca.key"),
        "-out",
        str(pki / "ca.crt"),
    )
    _signed(pki, "server", "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _signed(pki, "client", "extendedKeyUsage=clientAuth\n")
    return pki


@pytest.fixture
def daemon(pki: Path, shm_path: Path, tmp_path: Path) -> Iterator[Daemon]:
    cfg = from_mapping(
        {
            "arena": {"path": str(shm_path), "size_bytes": "16MiB", "extent_bytes": "2MiB"},
            "lmdb": {"path": str(tmp_path / "lmdb"), "budget_bytes": "32MiB"},
            "server": {
                "socket_path": str(tmp_path / "kvtierd.sock"),
                "admin_address": "127.0.0.1:0",
                "metrics_address": "",
                "tls_cert_file": str(pki / "server.crt"),
                "tls_key_file": str(pki / "server.key"),
                "tls_client_ca_file": str(pki / "ca.crt"),
            },
        }
    )
    d = Daemon(cfg)
    d.start()
    yield d
    d.stop()


def test_client_certificate_is_required(daemon: Daemon, pki: Path) -> None:
    address = f"127.0.0.1:{daemon.admin_port}"
    ca = (pki / "ca.crt").read_bytes()
    client = (pki / "client.key").read_bytes(), (pki / "client.crt").read_bytes()
    trusted = AdminClient(address, tls=ClientTLS(ca=ca, client=client), timeout_s=10)
    try:
        assert trusted.stats().sessions == 0
    finally:
        trusted.close()
    anonymous = AdminClient(address, tls=ClientTLS(ca=ca), timeout_s=10)
    try:
        with pytest.raises(KVTierError):
            anonymous.stats()
    finally:
        anonymous.close()
    plaintext = AdminClient(address, timeout_s=5)
    try:
        with pytest.raises(KVTierError):
            plaintext.stats()
    finally:
        plaintext.close()


def test_mtls_allows_a_non_loopback_admin_address(pki: Path) -> None:
    cfg = from_mapping(
        {
            "server": {
                "admin_address": "0.0.0.0:7461",
                "tls_cert_file": str(pki / "server.crt"),
                "tls_key_file": str(pki / "server.key"),
                "tls_client_ca_file": str(pki / "ca.crt"),
            }
        }
    ).server
    assert admin_credentials(cfg) == (None, None)


def _mtls_daemon(procs: Processes, pki: Path, tmp_path: Path, shm_path: Path) -> RunningDaemon:
    server = {
        "tls_cert_file": str(pki / "server.crt"),
        "tls_key_file": str(pki / "server.key"),
        "tls_client_ca_file": str(pki / "ca.crt"),
    }
    return procs.start_daemon(write_config(tmp_path, shm_path, {"server": server}))


def _kvtier(daemon: RunningDaemon, *args: str) -> subprocess.CompletedProcess[str]:
    """The real `kvtier` command, with the daemon's configuration and address."""
    where = ("--config", str(daemon.files.config), "--address", daemon.admin_address)
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args, *where],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _client_tls(pki: Path) -> tuple[str, ...]:
    return (
        "--tls-ca",
        str(pki / "ca.crt"),
        "--tls-cert",
        str(pki / "client.crt"),
        "--tls-key",
        str(pki / "client.key"),
    )


def test_kvtier_stats_over_mtls(
    procs: Processes, pki: Path, tmp_path: Path, shm_path: Path
) -> None:
    daemon = _mtls_daemon(procs, pki, tmp_path, shm_path)
    done = _kvtier(daemon, "stats", "--json", *_client_tls(pki))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["version"] == __version__
    # the server's CA but no client certificate: the handshake is refused
    done = _kvtier(daemon, "stats", "--tls-ca", str(pki / "ca.crt"))
    assert done.returncode == 1
    assert done.stdout == ""
    assert "over TLS a refused handshake looks the same" in done.stderr


def test_kvtier_health_over_mtls(
    procs: Processes, pki: Path, tmp_path: Path, shm_path: Path
) -> None:
    daemon = _mtls_daemon(procs, pki, tmp_path, shm_path)
    done = _kvtier(daemon, "health", *_client_tls(pki))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"kvtier.v1.AdminService at {daemon.admin_address}: SERVING"
    # the configuration says TLS: without the CA the server's certificate is not trusted
    done = _kvtier(daemon, "health")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]  # gRPC may log the failed handshake first
    assert last.startswith(f"kvtier health: kvtier.v1.AdminService at {daemon.admin_address}: ")
