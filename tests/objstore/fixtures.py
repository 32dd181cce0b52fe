"""Object stores for tests, a plugin of the whole suite (see tests/conftest.py): real S3 and
GCS test servers, reached through workload identity exactly as in production (no keys, no
endpoint in code), plus a fault-injecting proxy.

Servers (separate processes on free loopback ports, shared by the session):

- ``moto_server`` -> `ServerProcess`: moto's S3 and STS.
- ``gcs_emulator`` -> `ServerProcess`: gcp-storage-emulator.
- ``spawn_server(kind)`` -> a private `ServerProcess` (``"moto"`` or ``"gcs"``), stopped at
  teardown; for tests that kill or stop a server.

Identities (set through ``monkeypatch``, undone after the test):

- ``aws_irsa`` -> `AwsIrsa`: IRSA env (role ARN, web identity token file, region, endpoint at
  moto; no keys, no config files, no EC2 metadata). botocore trades the token at moto's STS for
  temporary ``ASIA...`` keys.
- ``gke_metadata`` -> `FakeGceMetadata`: GKE Workload Identity through a fake metadata server.
  google.auth reads ``GCE_METADATA_HOST`` once, when it is imported, so besides the env vars the
  fixture patches the module's copy; that keeps tests independent of import order and leaves
  nothing behind for other tests.
- ``gcp_wif`` -> `GcpWif`: workload identity federation: an ``external_account`` file whose
  token exchange goes to `FakeGoogleSts` and whose subject token is an OIDC token file. It and
  ``gke_metadata`` are alternatives: use one per test.

Stores (each a fresh bucket, so tests do not see each other's objects):

- ``store_factory(scheme, endpoint=None, prefix="objects")`` -> URL. ``scheme`` is ``"s3"``,
  ``"gs"`` or ``"file"``; ``endpoint`` overrides the server URL (a `FaultProxy`'s url, a
  spawned server), and is what backends opened afterwards talk to. S3 uses ``aws_irsa``;
  GCS uses the federation identity if ``gcp_wif`` is active, else ``gke_metadata``.
- ``s3_store``, ``gcs_store``, ``file_store`` -> URL; ``store_url`` is parametrized over the
  three (ids ``file``, ``s3``, ``gs``).
- ``opened(url, timeout_s=5.0)`` -> `open_backend`'s backend, closed at teardown.
- ``object_nodes(url, name, lmdb=None, **store)`` -> a TierManager of the three tiers on ``url``,
  closed at teardown.

Faults:

- ``fault_proxy(upstream_url)`` -> a started `FaultProxy`, closed at teardown (which fails the
  test if the proxy's threads hit an unexpected error). Typical use::

      proxy = fault_proxy(moto_server.url)
      url = store_factory("s3", endpoint=proxy.url)
      backend = open_backend(url, timeout_s=1.0)
      proxy.set_mode(FaultMode.HTTP_500)

- ``proxied_store(scheme)`` -> (URL, `FaultProxy`): those two steps for ``"s3"`` or ``"gs"``,
  the proxy in front of the session's server.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.tiering.manager import TierManager
from kvtier.tiers.objstore.backend import ObjectBackend, open_backend
from tests.fixtures.s3 import SCRUBBED_ENV
from tests.objstore.servers import (
    FakeGceMetadata,
    FakeGoogleSts,
    FaultProxy,
    ServerProcess,
    jwt_like,
)
from tests.objstore.servers import (
    gcs_emulator as make_gcs_emulator,
)
from tests.objstore.servers import (
    moto_server as make_moto_server,
)
from tests.support import object_node_config

BIN_DIR = Path(sys.executable).parent
AWS_ACCOUNT = "123456789012"  # moto's default account
AWS_ROLE_NAME = "kvtier-test-role"
GCS_ENDPOINT_ENV = "GCS_ENDPOINT_URL"  # what kvtier.tiers.objstore.gcs reads

# Env vars that would give the SDKs another identity or endpoint than the one a fixture sets.
_AWS_CLEAR = (*SCRUBBED_ENV, "AWS_ROLE_SESSION_NAME", "AWS_CA_BUNDLE")
_GCP_CLEAR = (
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_CLOUD_PROJECT",
    "GCLOUD_PROJECT",
    "GOOGLE_CLOUD_UNIVERSE_DOMAIN",
    "STORAGE_EMULATOR_HOST",
    "API_ENDPOINT_OVERRIDE",
    "NO_GCE_CHECK",
    "GCE_METADATA_ROOT",
)


# --------------------------------------------------------------------------------------------
# servers


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("objstore-server-logs")


def _spawn(kind: str, logs: Path) -> ServerProcess:
    if kind == "moto":
        return make_moto_server(logs, BIN_DIR).start()
    if kind == "gcs":
        return make_gcs_emulator(logs, BIN_DIR).start()
    raise ValueError(f"unknown server kind {kind!r}")


@pytest.fixture(scope="session")
def moto_server(server_logs: Path) -> Iterator[ServerProcess]:
    """moto's S3 and STS on a free loopback port, for the whole session."""
    server = _spawn("moto", server_logs)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_emulator(server_logs: Path) -> Iterator[ServerProcess]:
    """gcp-storage-emulator (in memory) on a free loopback port, for the whole session."""
    server = _spawn("gcs", server_logs)
    yield server
    server.stop()


@pytest.fixture
def spawn_server(server_logs: Path) -> Iterator[Callable[[str], ServerProcess]]:
    """``spawn_server("moto" | "gcs")`` starts a private server; all are stopped at teardown."""
    started: list[ServerProcess] = []

    def spawn(kind: str) -> ServerProcess:
        server = _spawn(kind, server_logs)
        started.append(server)
        return server

    yield spawn
    for server in started:
        server.stop()


# --------------------------------------------------------------------------------------------
# identities


@dataclass
class AwsIrsa:
    role_arn: str
    token_file: Path
    monkeypatch: pytest.MonkeyPatch

    def use_endpoint(self, url: str) -> None:
        """Send S3 and STS requests of clients created from now on to ``url``."""
        self.monkeypatch.setenv("AWS_ENDPOINT_URL", url)

    def write_token(self, subject: str = "system:serviceaccount:kvtier:kvtierd") -> str:
        """Write a new projected token, as the kubelet does when it rotates one."""
        token = jwt_like({"sub": subject, "aud": "sts.amazonaws.com", "jti": uuid.uuid4().hex})
        self.token_file.write_text(token)
        return token


@pytest.fixture
def aws_irsa(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moto_server: ServerProcess
) -> AwsIrsa:
    """IRSA as the EKS pod identity webhook sets it up, with the endpoint at moto."""
    for name in _AWS_CLEAR:
        monkeypatch.delenv(name, raising=False)
    token_dir = tmp_path / "eks.amazonaws.com-serviceaccount"
    token_dir.mkdir()
    irsa = AwsIrsa(
        f"arn:aws:iam::{AWS_ACCOUNT}:role/{AWS_ROLE_NAME}", token_dir / "token", monkeypatch
    )
    irsa.write_token()
    monkeypatch.setenv("AWS_ROLE_ARN", irsa.role_arn)
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(irsa.token_file))
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    irsa.use_endpoint(moto_server.url)
    return irsa


def _clear_gcp_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in _GCP_CLEAR:
        monkeypatch.delenv(name, raising=False)
    gcloud = tmp_path / "gcloud-config"  # an empty gcloud config: no user credentials
    gcloud.mkdir(exist_ok=True)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(gcloud))


@pytest.fixture
def gke_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGceMetadata]:
    """GKE Workload Identity: ADC finds the (fake) metadata server and gets its tokens."""
    from google.auth.compute_engine import _metadata

    _clear_gcp_env(monkeypatch, tmp_path)
    server = FakeGceMetadata()
    monkeypatch.setenv("GCE_METADATA_HOST", server.host)
    monkeypatch.setenv("GCE_METADATA_IP", server.host)
    # read once at import (see the module docstring); raising=True: fail loudly if it moves
    monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", server.host)
    yield server
    server.close()


@dataclass
class GcpWif:
    sts: FakeGoogleSts
    credentials_file: Path
    oidc_token_file: Path
    audience: str

    def write_token(self, subject: str = "system:serviceaccount:kvtier:kvtierd") -> str:
        token = jwt_like({"sub": subject, "aud": self.audience, "jti": uuid.uuid4().hex})
        self.oidc_token_file.write_text(token)
        return token


@pytest.fixture
def gcp_wif(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[GcpWif]:
    """Workload identity federation from a (fake) OIDC issuer, without impersonation."""
    _clear_gcp_env(monkeypatch, tmp_path)
    sts = FakeGoogleSts()
    audience = (
        "//iam.googleapis.com/projects/123456789/locations/global/"
        "workloadIdentityPools/kvtier-pool/providers/kvtier-oidc"
    )
    wif = GcpWif(sts, tmp_path / "wif-credentials.json", tmp_path / "oidc-token", audience)
    wif.write_token()
    wif.credentials_file.write_text(
        json.dumps(
            {
                "type": "external_account",
                "audience": audience,
                "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
                "token_url": sts.token_url,
                "credential_source": {"file": str(wif.oidc_token_file)},
            }
        )
    )
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(wif.credentials_file))
    # without it, ADC asks Cloud Resource Manager (on the internet) for the project
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "test-project")
    yield wif
    sts.close()


# --------------------------------------------------------------------------------------------
# stores


def _bucket_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _create_s3_bucket(bucket: str) -> None:
    import boto3.session

    s3 = boto3.session.Session().client("s3")
    try:
        s3.create_bucket(Bucket=bucket)
    finally:
        s3.close()


def _create_gcs_bucket(bucket: str) -> None:
    import google.auth
    import google.auth.transport.requests
    from google.cloud import storage

    credentials, project = google.auth.default()
    with google.auth.transport.requests.AuthorizedSession(credentials) as http:
        client = storage.Client(
            project=project,
            credentials=credentials,
            _http=http,
            client_options={"api_endpoint": os.environ[GCS_ENDPOINT_ENV]},
        )
        client._bucket_metadata_cache = None  # no background bucket lookups in tests
        client.create_bucket(bucket, retry=None, timeout=10)
        client.close()


StoreFactory = Callable[..., str]


@pytest.fixture
def store_factory(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> StoreFactory:
    """``store_factory(scheme, endpoint=None, prefix="objects")`` -> a store URL with a fresh
    bucket, the environment set so that backends opened afterwards reach it."""

    def make(scheme: str, endpoint: str | None = None, prefix: str = "objects") -> str:
        if scheme == "file":
            root = tmp_path / _bucket_name("store")
            return f"file://{root}"
        if scheme == "s3":
            irsa: AwsIrsa = request.getfixturevalue("aws_irsa")
            if endpoint is not None:
                irsa.use_endpoint(endpoint)
            bucket = _bucket_name("kvtier")
            _create_s3_bucket(bucket)
            return f"s3://{bucket}/{prefix}".rstrip("/")
        if scheme == "gs":
            # federation if the test asked for it (set up first, whatever the argument order)
            if "gcp_wif" in request.fixturenames:
                request.getfixturevalue("gcp_wif")
            else:
                request.getfixturevalue("gke_metadata")
            server: ServerProcess = request.getfixturevalue("gcs_emulator")
            monkeypatch.setenv(GCS_ENDPOINT_ENV, endpoint or server.url)
            bucket = _bucket_name("kvtier")
            _create_gcs_bucket(bucket)
            return f"gs://{bucket}/{prefix}".rstrip("/")
        raise ValueError(f"unknown scheme {scheme!r}")

    return make


@pytest.fixture
def s3_store(store_factory: StoreFactory) -> str:
    """``s3://<fresh bucket>/objects`` on moto, reached through IRSA."""
    return store_factory("s3")


@pytest.fixture
def gcs_store(store_factory: StoreFactory) -> str:
    """``gs://<fresh bucket>/objects`` on the emulator, reached through GKE Workload Identity
    (or federation, when the test also uses ``gcp_wif``)."""
    return store_factory("gs")


@pytest.fixture
def file_store(store_factory: StoreFactory) -> str:
    """``file:///<tmp_path>/store-...``."""
    return store_factory("file")


OpenBackend = Callable[..., ObjectBackend]


@pytest.fixture
def opened() -> Iterator[OpenBackend]:
    """``opened(url, timeout_s=5.0)``: `open_backend`, closed at teardown."""
    backends: list[ObjectBackend] = []

    def make(url: str, timeout_s: float = 5.0) -> ObjectBackend:
        backend = open_backend(url, timeout_s)
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        backend.close()


@pytest.fixture(params=["file", "s3", "gs"])
def store_url(request: pytest.FixtureRequest, store_factory: StoreFactory) -> str:
    """Each of the three stores in turn."""
    return store_factory(request.param)


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[str], FaultProxy]]:
    """``fault_proxy(upstream_url)`` starts a `FaultProxy` in PASS mode in front of it."""
    proxies: list[FaultProxy] = []

    def make(upstream: str) -> FaultProxy:
        proxy = FaultProxy(upstream)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.close()
    errors = [e for p in proxies for e in p.errors]
    assert not errors, f"fault proxy failed: {errors!r}"


ProxiedStore = Callable[[str], tuple[str, FaultProxy]]


@pytest.fixture
def proxied_store(
    request: pytest.FixtureRequest,
    fault_proxy: Callable[[str], FaultProxy],
    store_factory: StoreFactory,
) -> ProxiedStore:
    """``proxied_store(scheme)`` -> a store URL of ``scheme`` ("s3": moto, "gs": the emulator)
    with a fresh bucket, reached through a `FaultProxy` in PASS mode, and that proxy."""

    def make(scheme: str) -> tuple[str, FaultProxy]:
        server: ServerProcess = request.getfixturevalue(
            "moto_server" if scheme == "s3" else "gcs_emulator"
        )
        proxy = fault_proxy(server.url)
        return store_factory(scheme, endpoint=proxy.url), proxy

    return make


ObjectNodes = Callable[..., TierManager]


@pytest.fixture
def object_nodes(tmp_path: Path) -> Iterator[ObjectNodes]:
    """``object_nodes(url, name, lmdb=None, **store)`` -> a TierManager of the three tiers
    (`tests.support.object_node_config`) under ``tmp_path / name``; closed at teardown, with
    5 s to write back, and its arena removed."""
    made: list[TierManager] = []

    def make(
        url: str, name: str, lmdb: dict[str, object] | None = None, **store: object
    ) -> TierManager:
        manager = TierManager(object_node_config(tmp_path / name, url, lmdb, **store))
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.close(flush_timeout=5.0)
        manager.config.arena.path.unlink(missing_ok=True)
