"""The daemon's gRPC server interceptors: errors to statuses, and admin authentication.

Servicers raise domain errors; `ErrorInterceptor` turns them into statuses through the table in
`kvtier.core.status`, so a bad request never takes a worker thread or the daemon down with it.
`TokenAuthInterceptor` checks the admin API's bearer tokens.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvtier.core.status import status_of

log = logging.getLogger(__name__)


def _abort(context: grpc.ServicerContext, exc: Exception, method: str) -> None:
    code = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    context.abort(code, str(exc) or type(exc).__name__)


Behaviour = Callable[[Any, grpc.ServicerContext], Any]
Handler = Any  # grpc's method handlers are namedtuples; _replace swaps one behaviour


def _guard_unary(fn: Behaviour, method: str) -> Behaviour:
    def guarded(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(request, context)
        except Exception as exc:
            _abort(context, exc, method)
            raise  # unreachable: abort raises

    return guarded


def _guard_stream(fn: Behaviour, method: str) -> Behaviour:
    def guarded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(request, context)
        except Exception as exc:
            _abort(context, exc, method)

    return guarded


def _with_behaviour(
    handler: Handler, wrap: Callable[[Behaviour, str], Behaviour], method: str
) -> Handler:
    if handler.unary_unary is not None:
        return handler._replace(unary_unary=wrap(handler.unary_unary, method))
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=wrap(handler.unary_stream, method))
    return handler


class ErrorInterceptor(grpc.ServerInterceptor):
    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary is not None:
            return _with_behaviour(handler, _guard_unary, method)
        return _with_behaviour(handler, _guard_stream, method)


# Health says SERVING or not, and reflection describes the public protos: neither reveals or
# changes anything, and kubelet's gRPC probes carry no token.
_UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
_MISSING = (
    "missing bearer token: `kvtier` commands send the one in kvtierd's server.admin_token_file "
    "(unset: admin.token in its state directory); run them as kvtierd's user or pass --token-file"
)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Bearer tokens: ``admin`` may call anything, ``read`` only the read-only methods.

    Health and reflection stay open so that probes and grpcurl's discovery work.
    """

    def __init__(self, admin: str | None, read: str | None, read_only: frozenset[str]) -> None:
        self._admin = admin
        self._read = read
        self._read_only = read_only

    def _verdict(self, details: grpc.HandlerCallDetails) -> tuple[grpc.StatusCode, str] | None:
        method = details.method
        if method.startswith(_UNAUTHENTICATED_PREFIXES):
            return None
        metadata = dict(details.invocation_metadata or ())
        header = str(metadata.get("authorization", ""))
        token = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        if not token:
            return grpc.StatusCode.UNAUTHENTICATED, _MISSING
        if self._admin and hmac.compare_digest(token, self._admin):
            return None
        if self._read and hmac.compare_digest(token, self._read):
            if method.rsplit("/", 1)[-1] in self._read_only:
                return None
            return grpc.StatusCode.PERMISSION_DENIED, "the read-only token cannot call this"
        return grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(details)
        verdict = self._verdict(details)
        if handler is None or verdict is None:
            return handler
        code, message = verdict

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(code, message)

        def deny_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            deny(request, context)  # raises
            return iter(())

        if handler.unary_unary is not None:
            return handler._replace(unary_unary=deny)
        return handler._replace(unary_stream=deny_stream)
