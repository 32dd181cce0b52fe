"""The kvtier exception hierarchy.

Every error kvtier raises on purpose derives from `KVTierError`. The daemon maps these classes to
gRPC status codes in one table; nothing else should need to know the mapping.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every kvtier error."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is invalid. The message names the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class UnknownPoolError(KVTierError, KeyError):
    """A key's namespace, or a pool name, was never registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown pool"


class UnknownTierError(KVTierError, ValueError):
    """A tier was named that this manager does not have."""


class PoolLayoutError(KVTierError, ValueError):
    """A pool was registered again with an incompatible chunk size or layout."""


class PayloadSizeError(KVTierError, ValueError):
    """A payload's length differs from its pool's chunk size."""


class CapacityError(KVTierError):
    """A tier cannot take more data now (budget reached, nothing evictable)."""


class TierNotConfiguredError(KVTierError):
    """The call needs a tier this daemon was not configured with (for example, no object.url)."""


class TierUnavailableError(KVTierError):
    """A tier cannot be used at all (closed, failed to open, unhealthy)."""


class ChunkFormatError(KVTierError):
    """A stored chunk failed verification. It must never be served."""


class CorruptChunkError(ChunkFormatError):
    """Magic, header checksum or payload checksum does not match."""


class TruncatedChunkError(ChunkFormatError):
    """The value is shorter than its header says."""


class WrongKeyError(ChunkFormatError):
    """The value is valid but belongs to another namespace or chunk hash."""


class UnknownVersionError(ChunkFormatError):
    """The value was written by a format version this build cannot read."""


class InvalidRequestError(KVTierError, ValueError):
    """A request is malformed, oversized or out of range."""


class SessionNotFoundError(KVTierError, LookupError):
    """The session expired or never existed (for example, the daemon restarted): register again."""


class PermissionDeniedError(KVTierError):
    """The caller's credentials do not allow this call."""


class NamespaceAccessError(KVTierError):
    """A data-plane session named a key or slot of a namespace it did not register.

    Clients see it as `PermissionDeniedError`, the client form of its status code."""


class UnsupportedError(KVTierError):
    """The call is defined but this build does not serve it yet."""


class ObjectStoreError(TierUnavailableError):
    """An object-store request failed (timeout, 5xx, connection); it may succeed if retried."""


class ObjectNotFoundError(ObjectStoreError, LookupError):
    """The object does not exist."""


class CredentialError(ObjectStoreError):
    """The workload identity could not produce credentials (for example, the token file is
    missing or the token exchange failed). The object tier is unhealthy until it recovers."""
