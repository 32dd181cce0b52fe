"""gs:// objects through google-cloud-storage, with credentials only from Application Default
Credentials: GKE Workload Identity (the metadata server), or workload identity federation (an
``external_account`` file named by ``GOOGLE_APPLICATION_CREDENTIALS``).

The JSON API endpoint is the SDK's default unless ``GCS_ENDPOINT_URL`` names another one (a
private endpoint, or a test server). ``STORAGE_EMULATOR_HOST`` is deliberately not used: it makes
the SDK send anonymous requests. The variable has no ``KVTIER_`` prefix because that prefix is
reserved for configuration keys.

The client is created on first use, because resolving the identity may need the network (the
metadata server); a failure there is a `CredentialError` for that call, and the next call tries
again.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn

import google.auth
import google.auth.credentials
import google.auth.exceptions
import google.auth.transport.requests
import requests
import requests.adapters
import urllib3.exceptions
from google.api_core import exceptions as api_exceptions
from google.cloud import storage
from google.cloud.storage import exceptions as storage_exceptions

from kvtier.core.errors import CredentialError, ObjectNotFoundError, ObjectStoreError
from kvtier.tiers.objstore.backend import (
    ObjectBackend,
    ObjectExistsError,
    ObjectInfo,
    RequestRejectedError,
    StoreLocation,
    StoreUnreachableError,
)

ENDPOINT_ENV = "GCS_ENDPOINT_URL"
_SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
_POOL_SIZE = 64

_CREDENTIAL_ERRORS: tuple[type[Exception], ...] = (
    google.auth.exceptions.RefreshError,
    google.auth.exceptions.DefaultCredentialsError,
    api_exceptions.Unauthorized,
    api_exceptions.Forbidden,
)
# What a storage call can raise besides the above; anything else is a bug and propagates.
_STORE_ERRORS: tuple[type[Exception], ...] = (
    api_exceptions.GoogleAPICallError,
    google.auth.exceptions.GoogleAuthError,
    requests.RequestException,
    storage_exceptions.InvalidResponse,
    storage_exceptions.DataCorruption,
    OSError,
)
_CALL_ERRORS = (*_CREDENTIAL_ERRORS, *_STORE_ERRORS)


# HTTP statuses GCS gives a request for what it carries (name, size): the store is fine.
_REQUEST_STATUSES = frozenset({400, 411, 413, 414})
CREDENTIALS_ENV = "GOOGLE_APPLICATION_CREDENTIALS"


def _unreachable(exc: Exception) -> bool:
    """No connection was made: refused, DNS failure, connect timeout."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    if isinstance(exc, requests.ConnectionError) and exc.args:
        reason = getattr(exc.args[0], "reason", exc.args[0])
        return isinstance(reason, urllib3.exceptions.NewConnectionError)
    return False


def _raise_mapped(exc: Exception, what: str) -> NoReturn:
    if isinstance(exc, api_exceptions.NotFound):
        raise ObjectNotFoundError(what) from exc
    if isinstance(exc, api_exceptions.PreconditionFailed):  # ifGenerationMatch=0: name taken
        raise ObjectExistsError(what) from exc
    if isinstance(exc, _CREDENTIAL_ERRORS):
        raise CredentialError(f"{what}: {exc}") from exc
    if isinstance(exc, api_exceptions.ClientError) and exc.code in _REQUEST_STATUSES:
        raise RequestRejectedError(f"{what}: {exc}") from exc
    if _unreachable(exc):
        raise StoreUnreachableError(f"{what}: {exc}") from exc
    raise ObjectStoreError(f"{what}: {exc}") from exc


def _key_file_kind(path: str) -> str | None:
    """What long-lived secret a credentials file holds, if any."""
    try:
        with open(path, "rb") as f:
            info = json.loads(f.read())
    except (OSError, ValueError):
        return None  # google.auth reports an unreadable file when it is used
    if not isinstance(info, dict):
        return None
    kind = info.get("type")
    if kind == "impersonated_service_account":
        source = info.get("source_credentials")
        kind = source.get("type") if isinstance(source, dict) else None
    if kind == "service_account":
        return "a service-account key file"
    if kind == "authorized_user":
        return "a user's refresh token"
    return None


class _TimedRequest(google.auth.transport.requests.Request):
    """google.auth's transport with a ceiling on every request's timeout: some token exchanges
    (workload identity federation) pass none and would wait two minutes."""

    def __init__(self, session: requests.Session, timeout_s: float) -> None:
        super().__init__(session)
        self._timeout_s = timeout_s

    def __call__(
        self,
        url: str,
        method: str = "GET",
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        ceiling = self._timeout_s if timeout is None else min(timeout, self._timeout_s)
        return super().__call__(url, method, body, headers, timeout=ceiling, **kwargs)


class _Connection:
    """Credentials, an authorized HTTP session and the storage client over it."""

    def __init__(self, timeout_s: float) -> None:
        self.auth_session = requests.Session()
        self.auth_request = _TimedRequest(self.auth_session, timeout_s)
        try:
            credentials, project = google.auth.default(scopes=_SCOPES, request=self.auth_request)
        except BaseException:
            self.auth_session.close()
            raise
        self.credentials: google.auth.credentials.Credentials = credentials
        self.http = google.auth.transport.requests.AuthorizedSession(
            credentials, auth_request=self.auth_request, refresh_timeout=timeout_s
        )
        # room for the tier's concurrent transfers (requests keeps 10 per host by default)
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=_POOL_SIZE)
        self.http.mount("https://", adapter)
        self.http.mount("http://", adapter)
        try:
            endpoint = os.environ.get(ENDPOINT_ENV)
            self.client: Any = storage.Client(
                # objects need no project (bucket names are global), but the SDK insists on
                # one; this is the placeholder it uses itself
                project=project or "<none>",
                credentials=credentials,
                _http=self.http,
                client_options={"api_endpoint": endpoint} if endpoint else None,
            )
        except BaseException:
            self.close()
            raise
        if project is None:
            self.client.project = None
        # The SDK fetches bucket metadata in a background thread, with its own retries and
        # outside our timeouts, only to label traces; we do not trace through it.
        if getattr(self.client, "_bucket_metadata_cache", None) is not None:
            self.client._bucket_metadata_cache = None

    def close(self) -> None:
        self.http.close()
        self.auth_session.close()


class GcsBackend(ObjectBackend):
    """One bucket and prefix. Each call is one request (or one page), with the SDK's retries off
    and `timeout_s` on every request, token exchanges included."""

    def __init__(self, location: StoreLocation, timeout_s: float) -> None:
        super().__init__(location, timeout_s)
        self._prefix = f"{location.prefix}/" if location.prefix else ""
        self._conn: _Connection | None = None
        self._lock = threading.Lock()

    def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None:
            return conn
        with self._lock:
            if self._conn is None:
                try:
                    self._conn = _Connection(self.timeout_s)
                except _CALL_ERRORS as exc:
                    # nothing here talks to the store yet: every failure is the identity's
                    raise CredentialError(f"no usable Google credentials: {exc}") from exc
            return self._conn

    def _bucket(self) -> Any:
        return self._connection().client.bucket(self.location.bucket)

    def _key(self, name: str) -> str:
        return self._prefix + name

    def static_credentials(self) -> str | None:
        """The files google.auth's default chain reads before the metadata server."""
        path = os.environ.get(CREDENTIALS_ENV)
        if path:
            kind = _key_file_kind(path)
            return f"{CREDENTIALS_ENV}={path} is {kind}" if kind else None
        from google.auth import _cloud_sdk

        adc = _cloud_sdk.get_application_default_credentials_path()
        kind = _key_file_kind(adc) if os.path.exists(adc) else None
        return f"gcloud's application default credentials ({adc}) are {kind}" if kind else None

    def put(
        self,
        name: str,
        body: bytes | memoryview,
        metadata: Mapping[str, str],
        exclusive: bool = False,
    ) -> None:
        self.check_name(name)
        data = body if isinstance(body, bytes) else bytes(body)
        try:
            blob = self._bucket().blob(self._key(name))
            blob.metadata = dict(metadata)
            blob.upload_from_string(
                data,
                content_type="application/octet-stream",
                timeout=self.timeout_s,
                retry=None,
                # generation 0: only if no live object has the name
                if_generation_match=0 if exclusive else None,
            )
        except _CALL_ERRORS as exc:
            _raise_mapped(exc, f"put {self._key(name)}")

    def get(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        self.check_name(name)
        key = self._key(name)
        if length == 0:
            if self.head(name) is None:
                raise ObjectNotFoundError(key)
            return b""
        end = None if length is None else start + length - 1  # inclusive, as in HTTP ranges
        try:
            data: bytes = (
                self._bucket()
                .blob(key)
                .download_as_bytes(start=start or None, end=end, timeout=self.timeout_s, retry=None)
            )
            return data
        except api_exceptions.RequestRangeNotSatisfiable:
            return b""  # starts at or past the end, as a file read would
        except _CALL_ERRORS as exc:
            _raise_mapped(exc, f"get {key}")

    def head(self, name: str) -> ObjectInfo | None:
        self.check_name(name)
        key = self._key(name)
        try:
            blob = self._bucket().get_blob(key, timeout=self.timeout_s, retry=None)
        except _CALL_ERRORS as exc:
            _raise_mapped(exc, f"head {key}")
        if blob is None:
            return None
        return ObjectInfo(name, int(blob.size), blob.updated.timestamp(), dict(blob.metadata or {}))

    def delete(self, names: Sequence[str]) -> None:
        # One request per object: batch requests are a separate protocol many GCS-compatible
        # servers lack, and deletes are off the hot path.
        bucket = None
        for name in names:
            try:
                bucket = bucket or self._bucket()
                bucket.delete_blob(self._key(name), timeout=self.timeout_s, retry=None)
            except api_exceptions.NotFound:
                continue
            except _CALL_ERRORS as exc:
                _raise_mapped(exc, f"delete {self._key(name)}")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        cut = len(self._prefix)
        try:
            blobs = self._connection().client.list_blobs(
                self.location.bucket,
                prefix=self._key(prefix),
                fields="items(name,size,updated),nextPageToken",
                timeout=self.timeout_s,
                retry=None,
            )
            for blob in blobs:
                yield ObjectInfo(blob.name[cut:], int(blob.size), blob.updated.timestamp())
        except _CALL_ERRORS as exc:
            _raise_mapped(exc, f"list {self._key(prefix)}*")

    def principal(self) -> str:
        try:
            conn = self._connection()
            conn.credentials.refresh(conn.auth_request)
        except _CALL_ERRORS as exc:
            raise CredentialError(f"resolving Google credentials: {exc}") from exc
        creds: Any = conn.credentials
        email = getattr(creds, "service_account_email", None)
        if email and email != "default":
            return str(email)
        info = getattr(creds, "info", None) or {}
        if info.get("type") == "external_account":
            return f"external_account:{info.get('audience', '')}"
        return f"google:{type(creds).__name__}"

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.client.close()
            conn.close()
