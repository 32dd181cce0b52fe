"""Payload checksums of dirty arena chunks, taken as they are committed.

The arena is shared memory that clients can still write after a commit, so write-back compares
what it stores with the checksum taken here; a chunk whose bytes changed is dropped, not demoted.
A thread of its own hashes committed slots, so a commit (on the engine's step) never waits.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

from kvtier.core.counters import Counters
from kvtier.core.protocol import SlotRef


class CommitChecksums:
    def __init__(
        self,
        slots: int,
        lock: AbstractContextManager[object],
        current: Callable[[SlotRef], bool],
        digest: Callable[[SlotRef], bytes],
        counters: Counters,
    ) -> None:
        """``current`` tells (under ``lock``) whether a ref still names its committed chunk;
        ``digest`` hashes a slot's payload in place (it drops the GIL)."""
        self._of_slot: list[bytes | None] = [None] * slots
        self._lock = lock
        self._current = current
        self._digest = digest
        self._counters = counters
        self._queue: queue.SimpleQueue[SlotRef | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def later(self, ref: SlotRef) -> None:
        """Queue a committed slot for the hashing thread (started with the first). Called
        under the lock."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="kvtier-commit-hash", daemon=True
            )
            self._thread.start()
        self._queue.put(ref)

    def _loop(self) -> None:
        while (ref := self._queue.get()) is not None:
            with self._lock:
                if self._closed or not self._current(ref):
                    self._counters.add("commit_checksums", 1)
                    continue  # freed or reused meanwhile: nothing to keep
            digest = self._digest(ref)  # outside the lock
            with self._lock:
                # a generation that moved while hashing means the slot was freed: drop the hash
                if self._current(ref) and self._of_slot[ref.slot] is None:
                    self._of_slot[ref.slot] = digest
                self._counters.add("commit_checksums", 1)

    def of(self, ref: SlotRef, take_now: bool) -> bytes | None:
        """The checksum taken when ``ref``'s chunk was committed; with ``take_now``, a chunk the
        thread has not reached yet is hashed now."""
        if not self._current(ref):
            return None
        digest = self._of_slot[ref.slot]
        if digest is None and take_now:
            digest = self._digest(ref)
            with self._lock:
                if self._current(ref):
                    self._of_slot[ref.slot] = digest
        return digest

    def forget(self, slot: int) -> None:
        """The slot was freed or its chunk dropped. Called under the lock."""
        self._of_slot[slot] = None

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        with self._lock:
            self._closed = True
