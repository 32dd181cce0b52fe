"""What the object tier needs from a store, and how a URL picks one.

Backends are thin: one request per call, no retries (the tier retries with backoff and trips its
circuit breaker), a per-request timeout, credentials only from the SDK's default chain. Object
names passed in are relative to the URL's prefix.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvtier.core.errors import ConfigError, ObjectStoreError

PING_NAME = ".kvtier-ping"
"""Never written; `ObjectBackend.ping` asks for it and expects "not found"."""

# scheme -> "module:class"; imported on use so boto3 and google-cloud-storage stay optional
BACKENDS = {
    "s3": "kvtier.tiers.objstore.s3:S3Backend",
    "gs": "kvtier.tiers.objstore.gcs:GcsBackend",
    "file": "kvtier.tiers.objstore.localfs:LocalFsBackend",
}


MAX_NAME_BYTES = 1024
"""The longest object name S3 and GCS accept (UTF-8 bytes, prefix included)."""


class StoreUnreachableError(ObjectStoreError):
    """No connection to the store (refused, reset before an answer, DNS failure, connect
    timeout): the store, not the request, is at fault, and retrying at once cannot help."""


class ObjectExistsError(ObjectStoreError):
    """An exclusive put found the name taken (S3 and GCS answer 412): another writer won the
    race. The store is fine and the request must not be retried."""


class RequestRejectedError(ObjectStoreError):
    """The store refused this request for something in it (its name, its size, a header), not
    for its own state: it says nothing about the store's health."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    name: str
    """Relative to the backend's prefix."""
    size: int
    modified: float
    """Unix seconds of the last write."""
    metadata: Mapping[str, str] = field(default_factory=dict)
    """User metadata; listings may leave it empty."""


@dataclass(frozen=True, slots=True)
class StoreLocation:
    scheme: str
    bucket: str
    """Bucket name; for file:// the directory."""
    prefix: str
    """Without leading or trailing slashes; may be empty."""

    def join(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name


def parse_url(url: str) -> StoreLocation:
    parts = urlsplit(url)
    if parts.scheme not in BACKENDS:
        raise ConfigError("object.url", f"{url!r}: scheme must be one of {sorted(BACKENDS)}")
    if parts.username or parts.password:
        raise ConfigError(
            "object.url",
            "credentials in the URL are refused; kvtier uses workload identity "
            "(see the README's object tier section)",
        )
    if parts.query or parts.fragment:
        raise ConfigError("object.url", f"{url!r}: query strings and fragments are not supported")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ConfigError("object.url", f"{url!r}: use file:///absolute/path")
        return StoreLocation("file", parts.path.rstrip("/") or "/", "")
    if not parts.netloc:
        raise ConfigError("object.url", f"{url!r} names no bucket")
    return StoreLocation(parts.scheme, parts.netloc, parts.path.strip("/"))


class ObjectBackend(ABC):
    """One bucket (or directory) and prefix. Every method may raise `ObjectStoreError`
    (transient: retried by the tier) or `CredentialError` (identity broken: the tier turns
    unhealthy and answers misses until it recovers)."""

    def __init__(self, location: StoreLocation, timeout_s: float) -> None:
        self.location = location
        self.timeout_s = timeout_s

    @property
    def url(self) -> str:
        loc = self.location
        if loc.scheme == "file":
            return f"file://{loc.bucket}"
        return f"{loc.scheme}://{loc.bucket}/{loc.prefix}".rstrip("/")

    @abstractmethod
    def put(
        self,
        name: str,
        body: bytes | memoryview,
        metadata: Mapping[str, str],
        exclusive: bool = False,
    ) -> None:
        """Write a whole object; readers see the old object or the new one, never a part. With
        ``exclusive``, only if no object has the name (raises `ObjectExistsError` otherwise)."""

    @abstractmethod
    def get(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[start, start + length)`` of an object (to its end when length is None).
        Raises `ObjectNotFoundError` when it does not exist."""

    @abstractmethod
    def head(self, name: str) -> ObjectInfo | None:
        """Size, time and metadata of an object; None when it does not exist."""

    @abstractmethod
    def delete(self, names: Sequence[str]) -> None:
        """Delete objects; names that do not exist are ignored."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose relative name starts with ``prefix``, in no promised order."""

    @abstractmethod
    def principal(self) -> str:
        """Who the store sees us as (role ARN, service account, uid); resolves credentials, so
        it raises `CredentialError` when the identity chain is broken."""

    def ping(self) -> None:
        """One cheap request that the store answers when it and the identity work (a HEAD of
        a name kvtier never writes); raises like any other call."""
        self.head(PING_NAME)

    def sweep_temporaries(self, older_than: float) -> int:
        """Delete the backend's own temporary files last written before ``older_than`` (Unix
        seconds): puts cut short by a crash. Returns how many; stores whose puts are whole or
        absent (S3, GCS) have none."""
        return 0

    def static_credentials(self) -> str | None:
        """Where the SDK's default chain would find long-lived keys (a key file, key
        variables), or None when it would use a workload identity; reads only local files."""
        return None

    def check_name(self, name: str) -> None:
        """Refuse a name the store would refuse, before sending anything."""
        full = self.location.join(name)
        if len(full.encode()) > MAX_NAME_BYTES:
            raise RequestRejectedError(
                f"object name of {len(full.encode())} bytes, the store takes {MAX_NAME_BYTES}"
            )

    def close(self) -> None:  # noqa: B027  (most backends hold nothing to close)
        """Release connections."""


def open_backend(url: str, timeout_s: float) -> ObjectBackend:
    location = parse_url(url)
    module_name, _, class_name = BACKENDS[location.scheme].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = {"s3": "s3", "gs": "gcs"}.get(location.scheme, "")
        raise ConfigError(
            "object.url", f"{location.scheme}:// needs `pip install kvtier[{extra}]` ({exc})"
        ) from exc
    backend: ObjectBackend = getattr(module, class_name)(location, timeout_s)
    return backend
