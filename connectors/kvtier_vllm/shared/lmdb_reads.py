"""Chunks leased in lmdb (`kvtier.core.protocol.in_lmdb`), read from lmdb's map by the process
that loads them: both connectors' loads of hits held in lmdb (``lmdb_loads``).

Every read is verified: in place in lmdb's map (a chunk stored as it is, read within `holding`:
the caller copies it from there), or decoded into a buffer of the caller's. A chunk gone from
lmdb or failing verification is not read; a corrupt one is kept to be reported to the tiers
(`kvtier.core.protocol.TierClient.report_failed`), which check it and drop it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvtier.client import LmdbReader, LmdbSnapshot, failure_of, reader_at, release_reader
from kvtier.core.errors import ChunkFormatError, TierUnavailableError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import FailedChunk, TierClient, TierCode

log = logging.getLogger(__name__)
HOLD_S = 0.05
"""The longest one read transaction is held (then begun again): its pages stay pinned, and
lmdb's writer cannot reuse them, for that long."""


def readable_lmdb(client: TierClient, wanted: bool) -> str:
    """lmdb's path, where loads may be leased there: ``wanted`` (``lmdb_loads``), the tiers have
    lmdb, and it opens here (else why not is logged, and hits below the arena are promoted)."""
    path = client.lmdb_path
    if not wanted or path is None:
        return ""
    try:
        reader_at(path)
    except TierUnavailableError as exc:
        log.warning(
            "kvtier: %s; hits held there are promoted into the arena before they load (mount "
            "it here to load them straight from it)",
            exc,
        )
        return ""
    release_reader(path)  # the readers open their own
    return str(path)


class LmdbReads:
    """Verified reads of the chunks leased in one lmdb, its reader opened once."""

    def __init__(self) -> None:
        self._reader: LmdbReader | None = None
        self._path = ""
        self._snapshot: LmdbSnapshot | None = None
        self._holding = False
        self.failed: list[FailedChunk] = []

    def read_ahead(self, path: str, keys: Sequence[ChunkKey]) -> None:
        """A step's chunks read from disk at once, not one fault after another."""
        reader = self._open(path) if keys else None
        if reader is not None:
            reader.read_ahead(keys)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """`read` calls in this block share read transactions (each held at most ``HOLD_S``,
        begun at the first read); the last ends when the block exits, so none outlives the
        step's loads."""
        if self._holding:
            yield
            return
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            self._end_snapshot()

    def read(
        self,
        path: str,
        key: ChunkKey,
        nbytes: int,
        buffer: Callable[[], memoryview],
        in_place: bool,
    ) -> memoryview | None:
        """``key``'s chunk (``nbytes`` long), verified: with ``in_place`` within `holding`, a
        chunk stored as it is is a view of lmdb's map, valid until the next read or the
        block's end; any other is decoded into ``buffer()``. None where lmdb cannot be read
        here, no longer holds it, or it is corrupt (kept in ``failed``)."""
        reader = self._open(path)
        if reader is None:
            return None
        if self._holding:
            if self._snapshot is None:
                self._snapshot = LmdbSnapshot(reader, HOLD_S)
            outcome = self._snapshot.read(key, nbytes, buffer, in_place)
        else:
            with reader.snapshot() as snapshot:
                outcome = snapshot.read(key, nbytes, buffer, in_place=False)
        read = self._outcome(key, outcome)
        return read if isinstance(read, memoryview) else None

    def _outcome(
        self, key: ChunkKey, outcome: memoryview | ChunkFormatError | bool
    ) -> memoryview | bool:
        """A read's outcome; a chunk failing verification is logged, kept to report, and False."""
        if not isinstance(outcome, ChunkFormatError):
            return outcome
        log.error(
            "kvtier: chunk %s in lmdb failed verification (%s): not served, and reported",
            key.hex(),
            outcome,
        )
        self.failed.append(FailedChunk(key, TierCode.LMDB, failure_of(outcome)))
        return False

    def take_failed(self) -> list[FailedChunk]:
        """The chunks found failing verification since the last call, to report."""
        failed, self.failed = self.failed, []
        return failed

    def close(self) -> None:
        """Give the reader back (the engine shuts down): the last user in this process closes
        lmdb's environment and its reader slots, so the process can open it again."""
        self._end_snapshot()
        if self._reader is not None:
            release_reader(self._path)
        self._reader = None
        self._path = ""

    def _end_snapshot(self) -> None:
        if self._snapshot is not None:
            self._snapshot.end()
            self._snapshot = None

    def _open(self, path: str) -> LmdbReader | None:
        """The reader of ``path``, opened once: a path that fails to open is not tried again."""
        if path != self._path:
            self.close()
            self._path = path
            try:
                self._reader = reader_at(Path(path)) if path else None
            except TierUnavailableError as exc:
                log.error("kvtier: %s; its loads are not served from it", exc)
        return self._reader
