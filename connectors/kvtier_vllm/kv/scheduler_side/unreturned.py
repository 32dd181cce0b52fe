"""References the tiers still hold for this engine because the call that handed them back failed.

A failed release, commit or abort (a timeout, a daemon paused for a moment) would otherwise leave
its leases and reservations held for the engine's lifetime: the session stays alive, so kvtierd
never reclaims them. They are kept here and handed back on a later step, a bounded number of
times, and once more at shutdown. A retried call is safe: kvtierd ends each lease once (leases
carry their id) and ignores a commit or abort of what it no longer holds.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from kvtier.core.errors import KVTierError
from kvtier.core.protocol import SlotRef, TierClient

log = logging.getLogger(__name__)

RETRY_EVERY_S = 1.0
MAX_TRIES = 30
MAX_REFS = 1 << 16  # beyond it the oldest are given up: kvtierd reclaims them at session end


class Handback(StrEnum):
    """The call that hands a kept batch of references back."""

    RELEASE = "release"
    COMMIT = "commit"
    ABORT = "abort"


@dataclass
class _Batch:
    kind: Handback
    refs: list[SlotRef]
    tries: int = 0


class Unreturned:
    """Batches of refs to hand back, oldest first."""

    def __init__(
        self,
        every_s: float = RETRY_EVERY_S,
        max_tries: int = MAX_TRIES,
        max_refs: int = MAX_REFS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_s = every_s
        self.max_tries = max_tries
        self.max_refs = max_refs
        self._clock = clock
        self._batches: deque[_Batch] = deque()
        self._refs = 0
        self._next_try = 0.0
        self.given_up = 0
        """Refs dropped after their last try, or to stay under ``max_refs``."""

    def __len__(self) -> int:
        return self._refs

    def keep(self, kind: Handback, refs: list[SlotRef]) -> None:
        if not refs:
            return
        if not self._batches:
            self._next_try = self._clock() + self.every_s  # not in the step that just failed
        self._batches.append(_Batch(kind, list(refs)))
        self._refs += len(refs)
        while self._refs > self.max_refs:
            self._give_up(self._batches.popleft(), "too many are waiting")

    def _give_up(self, batch: _Batch, why: str) -> None:
        self._refs -= len(batch.refs)
        self.given_up += len(batch.refs)
        log.error(
            "kvtier: giving up handing back %d refs (%s) after %d tries, %s; kvtierd reclaims "
            "them when this engine's session ends or its reservations time out",
            len(batch.refs),
            batch.kind,
            batch.tries,
            why,
        )

    def retry(self, client: TierClient, force: bool = False) -> int:
        """Hand back what is due (everything with ``force``, as at shutdown); returns how many
        refs went back. Stops at the first failure: the tiers are not answering."""
        if not self._batches:
            return 0
        now = self._clock()
        if not force and (now < self._next_try or not client.serving):
            return 0
        self._next_try = now + self.every_s
        returned = 0
        while self._batches:
            batch = self._batches[0]
            try:
                self._call(client, batch)
            except KVTierError as exc:
                batch.tries += 1
                if force:  # the last chance: a daemon that fails now gets no more calls
                    while self._batches:
                        self._give_up(self._batches.popleft(), f"at shutdown: {exc}")
                elif batch.tries >= self.max_tries:
                    self._give_up(self._batches.popleft(), f"the last failed: {exc}")
                return returned
            self._batches.popleft()
            self._refs -= len(batch.refs)
            returned += len(batch.refs)
        return returned

    @staticmethod
    def _call(client: TierClient, batch: _Batch) -> None:
        if batch.kind is Handback.RELEASE:
            client.release(batch.refs)
        elif batch.kind is Handback.COMMIT:
            client.commit(batch.refs)
        else:
            client.abort(batch.refs)
