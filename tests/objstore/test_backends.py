"""What is particular to each object-store backend, against real servers: the workload identities
s3:// (moto) and gs:// (gcp-storage-emulator) run under, and how faults surface. What every
backend does is in backend_contract.py."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.core.errors import CredentialError, ObjectStoreError
from kvtier.tiers.objstore.backend import ObjectBackend, StoreUnreachableError
from tests.objstore.fixtures import (
    AWS_ACCOUNT,
    AWS_ROLE_NAME,
    AwsIrsa,
    GcpWif,
    OpenBackend,
    ProxiedStore,
    StoreFactory,
)
from tests.objstore.servers import FakeGceMetadata, FaultMode, FaultProxy, ServerProcess

ASSUMED_ROLE = f"arn:aws:sts::{AWS_ACCOUNT}:assumed-role/{AWS_ROLE_NAME}/"

# --------------------------------------------------------------------------------------------
# S3 through IRSA


def _sts_exchanges(proxy: FaultProxy) -> list[bytes]:
    return [bytes(r.body) for r in proxy.requests if b"Action=AssumeRoleWithWebIdentity" in r.body]


def test_s3_irsa_gives_temporary_keys_for_the_role(
    s3_store: str, opened: OpenBackend, aws_irsa: AwsIrsa
) -> None:
    assert "AWS_ACCESS_KEY_ID" not in os.environ
    backend = opened(s3_store)
    backend.put("x", b"1", {})
    credentials = backend._session.get_credentials()  # type: ignore[attr-defined]
    assert credentials.method == "assume-role-with-web-identity"
    assert credentials.get_frozen_credentials().access_key.startswith("ASIA")
    assert backend.principal().startswith(ASSUMED_ROLE)


def test_s3_missing_token_file_is_a_credential_error(
    s3_store: str, opened: OpenBackend, aws_irsa: AwsIrsa
) -> None:
    aws_irsa.token_file.unlink()
    backend = opened(s3_store)
    with pytest.raises(CredentialError, match=str(aws_irsa.token_file)):
        backend.put("x", b"1", {})
    with pytest.raises(CredentialError):
        backend.head("x")
    with pytest.raises(CredentialError):
        backend.principal()
    aws_irsa.write_token()  # the kubelet writes it back: the next call works
    backend.put("x", b"1", {})
    assert backend.get("x") == b"1"


def test_s3_refresh_rereads_the_token_file(
    aws_irsa: AwsIrsa,
    proxied_store: ProxiedStore,
    opened: OpenBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import botocore.credentials

    url, proxy = proxied_store("s3")
    backend = opened(url)
    backend.put("x", b"1", {})
    credentials = backend._session.get_credentials()  # type: ignore[attr-defined]
    first_key = credentials.get_frozen_credentials().access_key
    exchanges = len(_sts_exchanges(proxy))

    rotated = aws_irsa.write_token("rotated")
    backend.put("x", b"2", {})
    assert len(_sts_exchanges(proxy)) == exchanges  # keys still fresh: no exchange

    # Move botocore's clock to 5 minutes before expiry, inside the mandatory refresh window.
    # Both clocks: the credentials' own and the one the fetcher's cache checks. moto's clock
    # does not move, so new keys look near expiry too while the shift lasts: undo it after.
    real_now = botocore.credentials._local_now  # type: ignore[attr-defined]
    shift = [credentials._expiry_time - real_now() - datetime.timedelta(minutes=5)]

    def shifted() -> Any:
        return real_now() + shift[0]

    monkeypatch.setattr(credentials, "_time_fetcher", shifted)
    monkeypatch.setattr(botocore.credentials, "_local_now", shifted)
    backend.put("x", b"3", {})
    shift[0] = datetime.timedelta(0)
    sent = _sts_exchanges(proxy)[exchanges:]
    assert sent, "no new exchange"
    assert all(f"WebIdentityToken={urllib.parse.quote(rotated)}".encode() in b for b in sent)
    new_key = credentials.get_frozen_credentials().access_key
    assert new_key.startswith("ASIA")
    assert new_key != first_key
    backend.put("x", b"4", {})  # the new keys are fresh: no further exchange
    assert len(_sts_exchanges(proxy)) == exchanges + len(sent)
    assert backend.get("x") == b"4"


@pytest.fixture
def sts_proxy(
    moto_server: ServerProcess,
    fault_proxy: Callable[[str], FaultProxy],
    monkeypatch: pytest.MonkeyPatch,
) -> FaultProxy:
    """A `FaultProxy` in front of moto that STS calls alone go through (ask for it after the
    store, whose identity sets the endpoints)."""
    proxy = fault_proxy(moto_server.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", proxy.url)
    return proxy


def test_s3_sts_failure_is_a_credential_error_without_retries(
    s3_store: str, sts_proxy: FaultProxy, opened: OpenBackend
) -> None:
    sts_proxy.set_mode(FaultMode.HTTP_500)
    backend = opened(s3_store)
    with pytest.raises(CredentialError, match="AssumeRoleWithWebIdentity: 500"):
        backend.put("x", b"1", {})
    assert len(sts_proxy.requests) == 1  # the session's config reached botocore's STS client
    sts_proxy.set_mode(FaultMode.PASS)
    backend.put("x", b"1", {})
    assert backend.get("x") == b"1"


def test_s3_principal_falls_back_when_sts_is_unreachable(
    s3_store: str, sts_proxy: FaultProxy, opened: OpenBackend
) -> None:
    backend = opened(s3_store)
    backend.put("x", b"1", {})  # the exchange happened; the keys are cached
    sts_proxy.set_mode(FaultMode.RESET)
    assert backend.principal() == "aws:assume-role-with-web-identity"
    sts_proxy.set_mode(FaultMode.PASS)
    assert backend.principal().startswith(ASSUMED_ROLE)


def test_s3_delete_goes_in_batches_of_1000(
    proxied_store: ProxiedStore, opened: OpenBackend
) -> None:
    url, proxy = proxied_store("s3")
    backend = opened(url)
    for name in ("k0", "k1500"):
        backend.put(name, b"x", {})
    backend.delete([f"k{i}" for i in range(2001)])
    batches = [r for r in proxy.requests if r.method == "POST" and r.target.endswith("?delete")]
    assert len(batches) == 3
    assert list(backend.list()) == []


# --------------------------------------------------------------------------------------------
# GCS through GKE Workload Identity and workload identity federation


def _bearers(proxy: FaultProxy) -> list[str]:
    return [r.headers.get("authorization", "") for r in proxy.requests]


def test_gcs_metadata_token_reaches_the_server(
    gke_metadata: FakeGceMetadata, proxied_store: ProxiedStore, opened: OpenBackend
) -> None:
    url, proxy = proxied_store("gs")
    backend = opened(url)
    proxy.clear_requests()
    backend.put("x", b"data", {"k": "v"})
    assert backend.get("x") == b"data"
    assert backend.head("x") is not None
    assert [info.name for info in backend.list()] == ["x"]
    backend.delete(["x"])
    assert len(proxy.requests) == 5
    assert set(_bearers(proxy)) == {f"Bearer {gke_metadata.tokens_issued[-1]}"}
    assert backend.principal() == gke_metadata.service_account


def test_gcs_expired_token_is_fetched_again(
    gke_metadata: FakeGceMetadata, proxied_store: ProxiedStore, opened: OpenBackend
) -> None:
    url, proxy = proxied_store("gs")

    def three_requests(backend: ObjectBackend) -> list[str]:
        proxy.clear_requests()
        backend.put("x", b"1", {})
        backend.get("x")
        backend.head("x")
        return _bearers(proxy)

    assert len(set(three_requests(opened(url)))) == 1  # an hour-long token is reused
    # under google.auth's refresh margin (3 min 45 s) a token counts as expired on arrival
    gke_metadata.token_lifetime_s = 60
    issued = len(gke_metadata.tokens_issued)
    bearers = three_requests(opened(url))
    assert len(set(bearers)) == 3
    assert bearers == [f"Bearer {t}" for t in gke_metadata.tokens_issued[issued:]]


def test_gcs_refused_token_is_a_credential_error(
    gke_metadata: FakeGceMetadata, gcs_store: str, opened: OpenBackend
) -> None:
    gke_metadata.token_error_status = 403
    backend = opened(gcs_store)
    with pytest.raises(CredentialError):
        backend.put("x", b"1", {})
    with pytest.raises(CredentialError):
        backend.get("x")
    with pytest.raises(CredentialError):
        backend.principal()
    gke_metadata.token_error_status = None  # recovered: the next call works
    backend.put("x", b"1", {})
    assert backend.get("x") == b"1"


def test_gcs_workload_identity_federation(
    gcp_wif: GcpWif,
    proxied_store: ProxiedStore,
    opened: OpenBackend,
    request: pytest.FixtureRequest,
) -> None:
    assert "gke_metadata" not in request.fixturenames
    url, proxy = proxied_store("gs")
    backend = opened(url)
    proxy.clear_requests()
    backend.put("x", b"federated", {})
    assert backend.get("x") == b"federated"
    assert set(_bearers(proxy)) == {f"Bearer {gcp_wif.sts.tokens_issued[-1]}"}
    assert gcp_wif.sts.subject_tokens[-1] == gcp_wif.oidc_token_file.read_text()
    assert gcp_wif.sts.audiences[-1] == gcp_wif.audience
    assert backend.principal() == f"external_account:{gcp_wif.audience}"


def test_gcs_federation_rereads_the_oidc_token(
    gcp_wif: GcpWif, gcs_store: str, opened: OpenBackend
) -> None:
    gcp_wif.sts.token_lifetime_s = 60  # expired on arrival: every request exchanges again
    backend = opened(gcs_store)
    backend.put("x", b"1", {})
    rotated = gcp_wif.write_token("rotated")
    assert gcp_wif.sts.subject_tokens[-1] != rotated
    backend.get("x")
    assert gcp_wif.sts.subject_tokens[-1] == rotated


def test_gcs_federation_without_its_token_file_is_a_credential_error(
    gcp_wif: GcpWif, gcs_store: str, opened: OpenBackend
) -> None:
    token = gcp_wif.oidc_token_file.read_text()
    gcp_wif.oidc_token_file.unlink()
    backend = opened(gcs_store)
    with pytest.raises(CredentialError, match="not found"):
        backend.put("x", b"1", {})
    with pytest.raises(CredentialError):
        backend.principal()
    gcp_wif.oidc_token_file.write_text(token)
    backend.put("x", b"1", {})


def test_gcs_metadata_env_alone_works_in_a_fresh_process(
    gke_metadata: FakeGceMetadata, gcs_store: str
) -> None:
    # the fixture also patches google.auth's import-time copy of GCE_METADATA_HOST; a fresh
    # process shows that the variables alone are enough, as in a pod
    script = (
        "import sys\n"
        "from kvtier.tiers.objstore.backend import open_backend\n"
        "b = open_backend(sys.argv[1], 5.0)\n"
        "b.put('fresh', b'process', {})\n"
        "assert b.get('fresh') == b'process'\n"
        "print(b.principal())\n"
        "b.close()\n"
    )
    issued = len(gke_metadata.tokens_issued)
    done = subprocess.run(
        [sys.executable, "-c", script, gcs_store],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == gke_metadata.service_account
    assert len(gke_metadata.tokens_issued) > issued


# --------------------------------------------------------------------------------------------
# faults


def _operations(backend: ObjectBackend) -> dict[str, Callable[[], object]]:
    return {
        "put": lambda: backend.put("y", b"small", {}),
        "get": lambda: backend.get("x"),
        "range": lambda: backend.get("x", 1, 2),
        "head": lambda: backend.head("x"),
        "list": lambda: list(backend.list()),
        "delete": lambda: backend.delete(["x"]),
    }


def _proxied(
    scheme: str, proxied_store: ProxiedStore, opened: OpenBackend, timeout_s: float
) -> tuple[ObjectBackend, FaultProxy]:
    """A backend behind a proxy, its identity already resolved (so faults hit the store)."""
    url, proxy = proxied_store(scheme)
    backend = opened(url, timeout_s=timeout_s)
    backend.put("x", b"hello", {})
    return backend, proxy


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_http_500_is_a_store_error_after_one_request(
    scheme: str,
    proxied_store: ProxiedStore,
    opened: OpenBackend,
) -> None:
    backend, proxy = _proxied(scheme, proxied_store, opened, 2.0)
    proxy.set_mode(FaultMode.HTTP_500)
    for what, operation in _operations(backend).items():
        proxy.clear_requests()
        started = time.monotonic()
        with pytest.raises(ObjectStoreError) as caught:
            operation()
        assert type(caught.value) is ObjectStoreError, what  # not NotFound, not Credential
        assert time.monotonic() - started < 2.0, what
        assert len(proxy.requests) == 1, what  # the SDK did not retry; the tier will
    proxy.set_mode(FaultMode.PASS)
    assert backend.get("x") == b"hello"


@pytest.mark.serial
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_slow_server_is_a_store_error_within_the_timeout(
    scheme: str,
    proxied_store: ProxiedStore,
    opened: OpenBackend,
) -> None:
    timeout_s = 0.5
    backend, proxy = _proxied(scheme, proxied_store, opened, timeout_s)
    proxy.set_mode(FaultMode.DELAY, delay_ms=5000)
    operations = _operations(backend)
    # botocore sends every PutObject with "Expect: 100-continue" and waits up to 1 s for the
    # interim answer before it sends the body anyway; only then does the read timeout start
    expect_wait = 1.0 if scheme == "s3" else 0.0
    for what in ("get", "head", "put"):
        started = time.monotonic()
        with pytest.raises(ObjectStoreError) as caught:
            operations[what]()
        elapsed = time.monotonic() - started
        assert type(caught.value) is ObjectStoreError, what
        limit = timeout_s + 0.5 + (expect_wait if what == "put" else 0.0)
        assert timeout_s * 0.9 <= elapsed < limit, (what, elapsed)
    proxy.set_mode(FaultMode.DELAY, delay_ms=100)  # slow but within the timeout: fine
    assert backend.get("x") == b"hello"


@pytest.mark.parametrize("mode", [FaultMode.CLOSE, FaultMode.RESET])
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_dropped_connections_are_store_errors(
    scheme: str,
    mode: FaultMode,
    proxied_store: ProxiedStore,
    opened: OpenBackend,
) -> None:
    backend, proxy = _proxied(scheme, proxied_store, opened, 2.0)
    proxy.set_mode(mode)
    # a connection reset as it is accepted may count as never made; one closed after the
    # request was read was made
    allowed = {ObjectStoreError} | ({StoreUnreachableError} if mode is FaultMode.RESET else set())
    for what, operation in _operations(backend).items():
        with pytest.raises(ObjectStoreError) as caught:
            operation()
        assert type(caught.value) in allowed, what
    proxy.set_mode(FaultMode.PASS)
    assert backend.get("x") == b"hello"


@pytest.mark.parametrize(("scheme", "kind"), [("s3", "moto"), ("gs", "gcs")])
def test_killed_server_is_a_store_error(
    scheme: str,
    kind: str,
    spawn_server: Callable[[str], ServerProcess],
    store_factory: StoreFactory,
    opened: OpenBackend,
) -> None:
    server = spawn_server(kind)
    backend = opened(store_factory(scheme, endpoint=server.url), timeout_s=2.0)
    backend.put("x", b"hello", {})
    server.kill()
    for what, operation in _operations(backend).items():
        started = time.monotonic()
        with pytest.raises(ObjectStoreError) as caught:
            operation()
        assert type(caught.value) is StoreUnreachableError, what  # connection refused
        assert time.monotonic() - started < 2.0, what
