"""kvtierd and the identity it reaches the object store with: long-lived keys are refused at
start (or, when allowed, logged loudly), a key-like setting is refused as a static credential,
and an identity that hangs or fails delays neither the start nor the reaping of sessions."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.core.config import from_mapping
from kvtier.core.errors import ConfigError
from kvtier.rpc import GrpcTierClient
from kvtier.tiers.objstore.backend import open_backend
from tests.faults.test_object_store import gauge, node, wait_for
from tests.integration.daemon_harness import CHUNK, DaemonFiles, Processes, RunningDaemon, key_of
from tests.objstore.fixtures import AwsIrsa, StoreFactory
from tests.objstore.servers import FakeGceMetadata
from tests.objstore.servers import _MetadataHandler as MetadataHandler
from tests.support import target_spec

KEY_FILE = {
    "type": "service_account",
    "project_id": "test-project",
    "private_key_id": "0123456789abcdef",
    "private_key": "-----BEGIN PRIVATE KEY-----\nnot-a-key\n-----END PRIVATE KEY-----\n",
    "client_email": "kvtier@test-project.iam.gserviceaccount.com",
    "token_uri": "http://127.0.0.1:9/token",
}


def principal(daemon: RunningDaemon) -> str:
    [info] = [labels for n, labels, _ in daemon.metrics() if n == "kvtier_object_store_info"]
    return info["principal"]


# -- long-lived keys ----------------------------------------------------------------------------


@pytest.fixture
def sa_key_file(
    tmp_path: Path, gke_metadata: FakeGceMetadata, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A service-account key file named by GOOGLE_APPLICATION_CREDENTIALS, on a GKE node."""
    key_file = tmp_path / "sa-key.json"
    key_file.write_text(json.dumps(KEY_FILE))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key_file))
    return key_file


def test_a_gcs_service_account_key_file_is_refused_at_start(
    procs: Processes, tmp_path: Path, arenas: list[Path], sa_key_file: Path
) -> None:
    files = node(tmp_path, arenas, "gs://kvtier-bucket/objects")
    rc, out, err = procs.run_daemon_to_exit(files)
    assert rc == 2, (out, err)
    assert "static credentials are refused" in err
    assert f"GOOGLE_APPLICATION_CREDENTIALS={sa_key_file} is a service-account key file" in err
    assert "GKE Workload Identity" in err
    assert "external_account" in err
    assert "object.allow_static_keys" in err


@pytest.mark.parametrize("kind", ["service_account", "authorized_user"])
def test_gcloud_s_default_credentials_file_is_judged_too(
    gke_metadata: FakeGceMetadata, kind: str
) -> None:
    adc = Path(os.environ["CLOUDSDK_CONFIG"]) / "application_default_credentials.json"
    adc.write_text(json.dumps(KEY_FILE | {"type": kind}))  # google.auth reads it before metadata
    backend = open_backend("gs://kvtier-bucket/objects", timeout_s=5.0)
    try:
        found = backend.static_credentials()
    finally:
        backend.close()
    assert found is not None
    assert f"gcloud's application default credentials ({adc})" in found


def test_allow_static_keys_lets_a_key_file_through_with_a_warning(
    procs: Processes, tmp_path: Path, arenas: list[Path], sa_key_file: Path
) -> None:
    files = node(tmp_path, arenas, "gs://kvtier-bucket/objects", allow_static_keys=True)
    daemon = procs.start_daemon(files)
    assert "WARNING" in daemon.log_text()
    assert "STATIC CREDENTIALS IN USE" in daemon.log_text()
    assert procs.client(files.socket, "dp0", "--store", "0:2")["stored"] == [0, 1]
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0


@pytest.mark.parametrize(
    "source", ["env", "credentials-file", "config-file", "assume-role-from-keys"]
)
def test_s3_long_lived_keys_are_refused_at_start(
    procs: Processes,
    tmp_path: Path,
    arenas: list[Path],
    aws_irsa: AwsIrsa,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
) -> None:
    if source == "env":  # the first source of botocore's chain, ahead of IRSA
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEEXAMPLE01")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
        named = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment"
    else:
        monkeypatch.delenv("AWS_ROLE_ARN")
        monkeypatch.delenv("AWS_WEB_IDENTITY_TOKEN_FILE")
        keys = "aws_access_key_id = AKIAEXAMPLEEXAMPLE01\naws_secret_access_key = s\n"
        if source == "credentials-file":
            credentials = tmp_path / "aws-credentials"
            credentials.write_text(f"[default]\n{keys}")
            monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
            named = "aws_access_key_id in the shared credentials file"
        elif source == "config-file":  # read after credential_process, which is not set
            config = tmp_path / "aws-config"
            config.write_text(f"[default]\n{keys}")
            monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
            named = "aws_access_key_id in the AWS config file"
        else:  # a role assumed with a profile's keys
            config = tmp_path / "aws-config"
            role = "role_arn = arn:aws:iam::123456789012:role/r\nsource_profile = keys\n"
            config.write_text(f"[default]\n{role}[profile keys]\n{keys}")
            monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
            named = "profile keys: role_arn assumed with long-lived keys"
    files = node(tmp_path, arenas, "s3://kvtier-bucket/objects")
    rc, out, err = procs.run_daemon_to_exit(files)
    assert rc == 2, (out, err)
    assert f"static credentials are refused: {named}" in err
    assert "IRSA (AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE)" in err
    assert "object.allow_static_keys" in err


def test_s3_keys_with_allow_static_keys_are_used_with_a_warning(
    procs: Processes,
    tmp_path: Path,
    arenas: list[Path],
    s3_store: str,
    aws_irsa: AwsIrsa,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEEXAMPLE01")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    files = node(tmp_path, arenas, s3_store, allow_static_keys=True)
    daemon = procs.start_daemon(files)
    assert "STATIC CREDENTIALS IN USE: AWS_ACCESS_KEY_ID" in daemon.log_text()
    wait_for("healthy store", lambda: gauge(daemon, "kvtier_object_store_healthy") == 1.0)
    assert "assumed-role" not in principal(daemon), "the keys, not IRSA"
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0


@pytest.mark.parametrize("identity", ["irsa", "irsa-beside-a-credentials-file", "gke", "wif"])
def test_workload_identities_pass(
    request: pytest.FixtureRequest,
    store_factory: StoreFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    identity: str,
) -> None:
    if identity.startswith("irsa"):
        url = store_factory("s3")
        if identity == "irsa-beside-a-credentials-file":  # botocore takes IRSA first
            credentials = tmp_path / "aws-credentials"
            credentials.write_text("[default]\naws_access_key_id = A\naws_secret_access_key = s\n")
            monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    else:
        if identity == "wif":
            request.getfixturevalue("gcp_wif")
        url = store_factory("gs")
    backend = open_backend(url, timeout_s=5.0)
    try:
        assert backend.static_credentials() is None
        backend.ping()
    finally:
        backend.close()


# -- key-like settings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["private_key", "service_account_key", "aws_secret_access_key", "session_token", "password"],
)
def test_a_key_like_object_setting_is_refused_as_a_static_credential(key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping({"object": {"url": "s3://bucket/prefix", key: "value"}})
    assert f"static credentials ({key}) are refused" in str(caught.value)
    assert "Extra inputs" not in str(caught.value)


def test_kvtierd_refuses_a_private_key_in_its_config(
    procs: Processes, tmp_path: Path, arenas: list[Path]
) -> None:
    files = node(tmp_path, arenas, f"file://{tmp_path / 'store'}", private_key="-----BEGIN")
    rc, out, err = procs.run_daemon_to_exit(files)
    assert rc == 2, (out, err)
    assert "static credentials (private_key) are refused" in err
    assert "Extra inputs are not permitted" not in err


# -- an identity that hangs or fails ------------------------------------------------------------


@pytest.fixture
def metadata_fault(gke_metadata: FakeGceMetadata) -> Iterator[Callable[[str], threading.Event]]:
    """``metadata_fault("hang" | "500")`` makes token requests hang or answer 500 until the
    returned event is set."""
    healed = threading.Event()

    def make(fault: str) -> threading.Event:
        if fault == "500":
            gke_metadata.token_error_status = 500
            threading.Thread(target=lambda: _heal_500(healed, gke_metadata), daemon=True).start()
            return healed

        class Hanging(MetadataHandler):
            def do_GET(self) -> None:
                if self.path.partition("?")[0].endswith("/token"):
                    healed.wait(120)
                super().do_GET()

        server = gke_metadata._server
        server.RequestHandlerClass = Hanging
        return healed

    yield make
    healed.set()


def _heal_500(healed: threading.Event, server: FakeGceMetadata) -> None:
    healed.wait(120)
    server.token_error_status = None


def _start_timed(procs: Processes, files: DaemonFiles) -> tuple[RunningDaemon, float, float]:
    """The daemon, how long it took to say it was ready, and how long from its spawn until
    it answered a registration and a lookup."""
    spawned = time.monotonic()
    daemon = procs.start_daemon(files)
    started_s = time.monotonic() - spawned
    client = GrpcTierClient(files.socket, "probe")
    try:
        client.register_pool(target_spec(), CHUNK)
        assert client.lookup([key_of(0)]).hits == 0
    finally:
        client.close()
    return daemon, started_s, time.monotonic() - spawned


@pytest.mark.serial
@pytest.mark.parametrize("fault", ["hang", "500"])
def test_the_data_plane_is_ready_whatever_the_identity_does(
    procs: Processes,
    tmp_path: Path,
    arenas: list[Path],
    gcs_store: str,
    gke_metadata: FakeGceMetadata,
    metadata_fault: Callable[[str], threading.Event],
    fault: str,
) -> None:
    settings: dict[str, Any] = {"request_timeout_s": 5.0, "breaker_reset_s": 0.5}
    control_files = node(tmp_path, arenas, gcs_store, **settings)
    control, control_s, control_ready_s = _start_timed(procs, control_files)
    wait_for("principal", lambda: principal(control) == gke_metadata.service_account)
    assert control.signal_and_wait(signal.SIGTERM, 60) == 0

    healed = metadata_fault(fault)
    files = node(tmp_path, arenas, gcs_store, **settings)
    daemon, start_s, ready_s = _start_timed(procs, files)
    print(
        f"spawn to ready line / to a served lookup: identity fine {control_s:.2f} / "
        f"{control_ready_s:.2f} s, identity {fault}: {start_s:.2f} / {ready_s:.2f} s"
    )
    stored = procs.client(files.socket, "dp0", "--store", "0:4", "--lookup", "0:4", "--load", "0:4")
    assert stored["stored"] == [0, 1, 2, 3]
    assert stored["hits"] == 4
    assert stored["loaded"] == [True] * 4
    assert start_s <= control_s + 1.0, "the start waited on the identity"
    assert ready_s <= control_ready_s + 1.0, "the data plane waited on the identity"
    assert principal(daemon) == "unknown"
    assert gauge(daemon, "kvtier_object_store_healthy") == 0.0, "no identity yet"

    healed.set()
    wait_for("principal", lambda: principal(daemon) == gke_metadata.service_account, 60.0)
    wait_for("healthy store", lambda: gauge(daemon, "kvtier_object_store_healthy") == 1.0)
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0


@pytest.mark.serial
def test_a_slow_store_check_never_delays_reaping(
    procs: Processes,
    tmp_path: Path,
    arenas: list[Path],
    gcs_store: str,
    gke_metadata: FakeGceMetadata,
) -> None:
    # google.auth retries a metadata server that answers 500 for seconds: every identity
    # check (the first, then each trial) is slow
    gke_metadata.token_error_status = 500
    timeout_s = 2.0
    files = node(
        tmp_path,
        arenas,
        gcs_store,
        server={"session_timeout_s": timeout_s},
        request_timeout_s=5.0,
        breaker_reset_s=0.2,
    )
    daemon = procs.start_daemon(files)
    holder, held = procs.holding_client(files.socket, "dp0", "--store", "0:2", "--load", "0:2")
    assert held["loaded"] == [True, True]
    assert gauge(daemon, "kvtier_sessions") == 1.0
    asked = len(gke_metadata.paths)
    holder.kill()  # stops heartbeating, holding two leases
    killed = time.monotonic()
    wait_for("reaped session", lambda: gauge(daemon, "kvtier_sessions") == 0.0, 30.0)
    reaped_s = time.monotonic() - killed
    print(f"a session that stopped heartbeating was reaped after {reaped_s:.2f} s")
    assert len(gke_metadata.paths) > asked, "identity checks were running meanwhile"
    assert gauge(daemon, "kvtier_leases") == 0.0
    assert reaped_s <= timeout_s + 1.5
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0
