"""The channel to kvtierd's data plane: the grpc channel and its stub, each kind of call's
deadline, the breaker that fails calls at once while kvtierd does not answer, and the client's
own call thread for calls made without waiting."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from kvtier.api.v1 import tier_pb2, tier_pb2_grpc
from kvtier.rpc.calls import (
    CHANNEL_OPTIONS,
    STALLED,
    Breaker,
    DaemonStalledError,
    Deadlines,
    Pending,
    call,
    translate,
)

R = TypeVar("R")
_TIER_SERVICE = tier_pb2.DESCRIPTOR.services_by_name["TierService"].full_name


class DaemonChannel:
    """Calls to kvtierd at ``socket_path``: each waits at most ``timeout_s``, unless
    ``deadlines`` are given, which also give it a breaker (see `Deadlines`)."""

    def __init__(
        self, socket_path: Path, timeout_s: float = 10.0, deadlines: Deadlines | None = None
    ) -> None:
        self.target = f"unix:{socket_path}"
        self.deadlines = deadlines
        self.breaker = (
            Breaker(self.target, deadlines.misses_to_open) if deadlines is not None else None
        )
        self.timeout_s = timeout_s
        self.lookup_s = deadlines.lookup_s if deadlines is not None else timeout_s
        self.store_s = deadlines.store_s if deadlines is not None else timeout_s
        self.register_s = deadlines.register_s if deadlines is not None else timeout_s
        self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self.stub = tier_pb2_grpc.TierServiceStub(self._channel)
        # key-carrying calls send requests encoded by kvtier.core.wire (see there for why)
        self.lookup = self._raw("Lookup", tier_pb2.LookupResponse)
        self.reserve = self._raw("Reserve", tier_pb2.ReserveResponse)
        self.prefetch = self._raw("Prefetch", tier_pb2.PrefetchResponse)
        self.promote = self._raw("Promote", tier_pb2.PromoteResponse)
        self._caller: ThreadPoolExecutor | None = None

    def _raw(self, name: str, response: type[Message]) -> grpc.UnaryUnaryMultiCallable[bytes, Any]:
        return self._channel.unary_unary(
            f"/{_TIER_SERVICE}/{name}", response_deserializer=response.FromString
        )

    @property
    def serving(self) -> bool:
        """False while the breaker is open: every call would fail at once."""
        return self.breaker is None or not self.breaker.why

    def check(self) -> None:
        """Raises `DaemonStalledError` while the breaker is open."""
        if self.breaker is not None:
            self.breaker.check()

    def call(self, method: Callable[..., R], request: Any, timeout: float | None = None) -> R:
        """``method(request)``, counted by the breaker: a missed deadline counts towards
        opening it, an unreachable daemon opens it at once, an answer closes the count."""
        breaker = self.breaker
        if breaker is None:
            return call(self.target, method, request, timeout=timeout or self.timeout_s)
        breaker.check()
        try:
            answer = method(request, timeout=timeout or self.store_s)
        except grpc.RpcError as exc:
            if exc.code() not in STALLED:
                raise translate(self.target, exc) from None
            code = exc.code().name.lower()
            why = f"{code} after {timeout or self.store_s:.3f} s"
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                breaker.missed(why)
            else:  # unreachable: no use waiting out more deadlines
                breaker.trip(why)
            raise DaemonStalledError(f"{self.target}: {code} ({exc.details()})") from None
        breaker.answered()
        return answer

    def call_past_breaker(
        self, method: Callable[..., R], request: Any, timeout: float, **kwargs: Any
    ) -> R:
        """``method(request)`` made while the breaker is open too, and not counted by it: a
        registration, or the heartbeat that may close it."""
        return call(self.target, method, request, timeout=timeout, **kwargs)

    def behind(
        self,
        method: Callable[..., Any],
        request: Any,
        convert: Callable[[Any], R] = lambda response: response,
    ) -> Pending[R]:
        """The call made on this client's own thread: grpc's ``future()`` starts a thread per
        call when none is spinning, which took longer here (0.9 ms) than the call itself."""
        if self.breaker is None:
            future = self.submit(method, request, timeout=self.timeout_s)
        else:
            self.breaker.check()  # nothing queues behind a daemon that does not answer
            future = self.submit(self.call, method, request, self.store_s)
        return Pending(future, convert, self.target)

    def submit(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> Future[R]:
        """``fn`` run on this client's own call thread."""
        if self._caller is None:
            self._caller = ThreadPoolExecutor(1, thread_name_prefix="kvtier-call")
        return self._caller.submit(fn, *args, **kwargs)

    def stop_calls(self) -> None:
        """Wait for the call on the call thread, cancelling those queued behind it."""
        if self._caller is not None:
            self._caller.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        self._channel.close()
