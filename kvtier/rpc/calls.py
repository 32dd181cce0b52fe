"""How a call to kvtierd waits and fails: channel options, deadlines, the breaker, grpc errors as
kvtier errors, and a call in flight."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from kvtier.core.errors import KVTierError, TierUnavailableError
from kvtier.core.status import error_from

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # a restarted daemon is found again within a second, not after minutes of backoff
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
R = TypeVar("R")
STALLED = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


@dataclass(frozen=True)
class Deadlines:
    """How long each kind of call may wait, for a caller that must never stall (an engine's
    scheduler). A client given deadlines also has a breaker: once ``misses_to_open`` calls in a
    row miss their deadline, or a call finds the daemon unreachable or its session gone, every
    call fails at once (`DaemonStalledError`) until a heartbeat on the client's own thread,
    every ``probe_every_s``, is answered (in a new session if need be)."""

    lookup_s: float = 0.05
    """Lookup, Prefetch (leases) and Promote: the calls that answer a lookup."""
    store_s: float = 0.1
    """Reserve, Commit, Abort, Release, ChunkEvents, hit reports and asked-for heartbeats."""
    register_s: float = 2.0
    """RegisterSession: only at start and on the client's own thread, never in a step."""
    probe_s: float = 0.1
    probe_every_s: float = 0.5
    misses_to_open: int = 3
    """Missed deadlines in a row that open the breaker: on a busy host one call can run late
    while the daemon is well, and each miss costs no more than its deadline."""


class DaemonStalledError(TierUnavailableError):
    """kvtierd missed a deadline or cannot be reached: no call is made until it answers."""


class Breaker:
    """Open while kvtierd does not answer in time; logs once on each change."""

    def __init__(self, target: str, misses_to_open: int = 1) -> None:
        self._target = target
        self._misses_to_open = misses_to_open
        self._lock = threading.Lock()
        self.why = ""
        """Why it is open; empty while closed."""
        self.opened = 0
        """Times it opened."""
        self.misses = 0
        """Deadlines missed in a row."""

    def check(self) -> None:
        why = self.why
        if why:
            raise DaemonStalledError(f"kvtierd at {self._target} is not answering ({why})")

    def missed(self, why: str) -> None:
        """A call missed its deadline: opens after ``misses_to_open`` in a row."""
        self.misses += 1
        if self.misses >= self._misses_to_open:
            self.trip(why)

    def answered(self) -> None:
        self.misses = 0

    def trip(self, why: str) -> None:
        with self._lock:
            if self.why:
                return
            self.why = why
            self.opened += 1
        log.warning(
            "kvtierd at %s is not answering (%s): serving without it until it does",
            self._target,
            why,
        )

    def reset(self) -> None:
        with self._lock:
            if not self.why:
                return
            self.why = ""
        log.warning("kvtierd at %s answers again: serving with it", self._target)


def translate(target: str, exc: grpc.RpcError) -> KVTierError:
    """A failed call as a kvtier error that says what to do."""
    code, details = exc.code(), exc.details() or ""
    if code is grpc.StatusCode.UNAVAILABLE:
        if "Permission denied" in details:  # the daemon runs; this user may not call it
            return TierUnavailableError(
                f"no access to the socket {target} ({details}): run the engine as a member of"
                " the daemon's group (`server.group`), the socket is mode 0660"
            )
        return TierUnavailableError(
            f"daemon not running at {target}: start it with `kvtier serve` ({details})"
        )
    return error_from(code, details)


def call(target: str, fn: Callable[..., R], request: Any, **kwargs: Any) -> R:
    try:
        return fn(request, **kwargs)
    except grpc.RpcError as exc:
        raise translate(target, exc) from None


class Pending(Generic[R]):
    """A call in flight; `result` waits for it and converts the response."""

    def __init__(self, future: Any, convert: Callable[[Any], R], target: str) -> None:
        self._future = future
        self._convert = convert
        self._target = target

    def done(self) -> bool:
        return bool(self._future.done())

    def wait(self, timeout_s: float | None) -> bool:
        if timeout_s == 0:
            return self.done()
        return not futures.wait([self._future], timeout_s).not_done

    def result(self) -> R:
        try:
            response = self._future.result()
        except grpc.RpcError as exc:
            raise translate(self._target, exc) from None
        except futures.CancelledError:
            closed = f"{self._target}: the client closed before it answered"
            raise TierUnavailableError(closed) from None
        return self._convert(response)
