"""The one table between kvtier errors and gRPC status codes, used by servers and clients."""

from __future__ import annotations

import grpc

from kvtier.core.errors import (
    CapacityError,
    ChunkFormatError,
    ConfigError,
    InvalidRequestError,
    KVTierError,
    NamespaceAccessError,
    PayloadSizeError,
    PermissionDeniedError,
    PoolLayoutError,
    SessionNotFoundError,
    TierNotConfiguredError,
    TierUnavailableError,
    UnknownPoolError,
    UnknownTierError,
    UnsupportedError,
)

# Checked in order; the first matching class decides.
STATUS_OF: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (PayloadSizeError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownTierError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownPoolError, grpc.StatusCode.FAILED_PRECONDITION),
    (PoolLayoutError, grpc.StatusCode.FAILED_PRECONDITION),
    (TierNotConfiguredError, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (NamespaceAccessError, grpc.StatusCode.PERMISSION_DENIED),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TierUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (ChunkFormatError, grpc.StatusCode.DATA_LOSS),
    (UnsupportedError, grpc.StatusCode.UNIMPLEMENTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_of(exc: Exception) -> grpc.StatusCode:
    for cls, code in STATUS_OF:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_from(code: grpc.StatusCode, details: str) -> KVTierError:
    """The domain error a client raises for a failed call."""
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return PermissionDeniedError(f"not authenticated: {details}")
    for cls, status in STATUS_OF:  # the first KVTierError class of a code is its client form
        if status is code and issubclass(cls, KVTierError) and cls is not ConfigError:
            return cls(details)
    return KVTierError(f"{code.name}: {details}")
