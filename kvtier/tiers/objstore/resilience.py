"""Retries with jittered backoff behind a circuit breaker, for every object-store request.

A store that keeps failing opens the breaker: requests then fail at once (the data plane sees
misses, never a stall) until ``reset_s`` has passed and one trial request goes through.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvtier.core.counters import Counters
from kvtier.core.errors import CredentialError, ObjectNotFoundError, ObjectStoreError
from kvtier.tiers.objstore.backend import (
    ObjectExistsError,
    RequestRejectedError,
    StoreUnreachableError,
)

T = TypeVar("T")


class BreakerOpenError(ObjectStoreError):
    """The circuit breaker is open; the request was not sent."""


class CircuitBreaker:
    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(self, failures: int, reset_s: float) -> None:
        self.threshold = failures
        self.reset_s = reset_s
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at = 0.0
        self._trial = False
        self.last_error: str = ""

    @property
    def state(self) -> str:
        with self._lock:
            if self._failures < self.threshold:
                return self.CLOSED
            if time.monotonic() - self._opened_at >= self.reset_s:
                return self.HALF_OPEN
            return self.OPEN

    def admit(self) -> bool:
        """Whether a request may go now; in half-open state one trial at a time."""
        with self._lock:
            if self._failures < self.threshold:
                return True
            if time.monotonic() - self._opened_at < self.reset_s or self._trial:
                return False
            self._trial = True
            return True

    def admit_peek(self) -> bool:
        """Whether `admit` would let a request through, without taking the trial."""
        return self.state != self.OPEN

    @property
    def sound(self) -> bool:
        """Closed, and the last request that reached a verdict succeeded: a store whose last
        request failed (or whose half-open trial is still out) is not counted on."""
        with self._lock:
            return self._failures == 0

    def release(self) -> None:
        """A request ended without a verdict on the store (it was refused for itself)."""
        with self._lock:
            self._trial = False

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._trial = False
            self.last_error = ""

    def failure(self, error: BaseException, trip: bool = False) -> None:
        with self._lock:
            self._trial = False
            self._failures = self.threshold if trip else self._failures + 1
            self.last_error = f"{type(error).__name__}: {error}"
            if self._failures >= self.threshold:
                self._opened_at = time.monotonic()


class RequestGuard:
    """Runs one logical request: up to ``1 + retries`` attempts, full-jitter exponential
    backoff, no attempt past ``deadline_s`` from the start, none while the breaker is open."""

    def __init__(
        self, breaker: CircuitBreaker, retries: int, backoff_s: float, counters: Counters
    ) -> None:
        self.breaker = breaker
        self.retries = retries
        self.backoff_s = backoff_s
        self.counters = counters

    def call(self, fn: Callable[[], T], deadline_s: float | None = None) -> T:
        start = time.monotonic()
        attempt = 0
        while True:
            if not self.breaker.admit():
                self.counters.add("breaker_rejected", 1)
                raise BreakerOpenError(f"circuit breaker open: {self.breaker.last_error}")
            try:
                result = fn()
            except (ObjectNotFoundError, ObjectExistsError):
                self.breaker.success()  # the store answered
                raise
            except RequestRejectedError:
                self.counters.add("requests_rejected", 1)
                self.breaker.release()  # this request's own fault: not the store's
                raise
            except CredentialError as exc:
                self.counters.add("credential_errors", 1)
                self.breaker.failure(exc, trip=True)  # retrying cannot help
                raise
            except StoreUnreachableError as exc:
                self.counters.add("request_errors", 1)
                self.counters.add("unreachable", 1)
                self.breaker.failure(exc, trip=True)  # nothing listens: fail the rest fast
                raise
            except ObjectStoreError as exc:
                self.counters.add("request_errors", 1)
                self.breaker.failure(exc)
                delay = random.uniform(0, self.backoff_s * (2**attempt))
                elapsed = time.monotonic() - start
                out_of_time = deadline_s is not None and elapsed + delay >= deadline_s
                if attempt >= self.retries or out_of_time or not self.breaker.admit_peek():
                    raise
                attempt += 1
                self.counters.add("retries", 1)
                time.sleep(delay)
                continue
            self.breaker.success()
            return result
