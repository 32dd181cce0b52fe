from __future__ import annotations

import grpc
import pytest

from kvtier.core import errors
from kvtier.core.status import STATUS_OF, error_from, status_of


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.InvalidRequestError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.PayloadSizeError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.UnknownPoolError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.SessionNotFoundError("x"), grpc.StatusCode.NOT_FOUND),
        (errors.NamespaceAccessError("x"), grpc.StatusCode.PERMISSION_DENIED),
        (errors.CapacityError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.CorruptChunkError("x"), grpc.StatusCode.DATA_LOSS),
        (errors.UnsupportedError("x"), grpc.StatusCode.UNIMPLEMENTED),
        (ValueError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_each_error_has_one_status(exc: Exception, code: grpc.StatusCode) -> None:
    assert status_of(exc) is code


def test_every_kvtier_error_class_is_mapped() -> None:
    classes = [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.KVTierError) and c is not errors.KVTierError
    ]
    unmapped = [c.__name__ for c in classes if status_of(_instance(c)) is grpc.StatusCode.INTERNAL]
    assert not unmapped


def test_clients_get_the_domain_error_back() -> None:
    for cls, code in STATUS_OF:
        err = error_from(code, "details")
        assert isinstance(err, errors.KVTierError)
        assert "details" in str(err)
        if issubclass(cls, errors.KVTierError) and cls is not errors.ConfigError:
            assert status_of(err) is code
    assert isinstance(
        error_from(grpc.StatusCode.UNAUTHENTICATED, "no"), errors.PermissionDeniedError
    )
    # a session's namespace refusal and a token's share one client form
    assert type(error_from(grpc.StatusCode.PERMISSION_DENIED, "no")) is errors.PermissionDeniedError


def _instance(cls: type[errors.KVTierError]) -> errors.KVTierError:
    return cls("key", "message") if cls is errors.ConfigError else cls("message")
