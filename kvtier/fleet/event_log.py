"""The published batches, kept on disk for replay: a subscriber that missed some asks from the
sequence number it last saw, and a restarted kvtierd goes on numbering where it stopped, so no
subscriber mistakes a restart for a gap it cannot fill.

The log is bounded by bytes (``events.log_bytes``): the oldest batches go first. A map or disk
that fills anyway is met as every lmdb environment of kvtier meets it (`kvtier.core.lmdb_space`):
half of the log is dropped in a transaction of its own and the batch tried again; one that still
finds no space is not kept (counted), and the log keeps the next once space returns.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb

from kvtier.core.counters import Counters
from kvtier.core.lmdb_space import Space, restrict_files

_SEQ = struct.Struct(">Q")
_TOPIC_LEN = struct.Struct("<H")
_MAP_HEADROOM = 16 << 20
"""Address space past twice the log's bytes: LMDB's branch pages and freed pages not yet reused."""


class EventLog:
    def __init__(self, path: Path, capacity_bytes: int, counters: Counters | None = None) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._env = lmdb.open(
            str(path),
            map_size=2 * capacity_bytes + _MAP_HEADROOM,
            max_dbs=1,
            subdir=True,
            mode=0o600,
        )
        try:  # only kvtierd reads it; files an older kvtier left open to others are closed
            restrict_files(path, ("data.mdb", "lock.mdb"), 0o600, None, "events.log_path")
            self._env.reader_check()
        except BaseException:
            self._env.close()
            raise
        self._batches = self._env.open_db(b"batches")
        self._lock = threading.Lock()
        self._space = Space(
            lambda: self._env, f"event log {path}", counters or Counters(), prefix="event_log_"
        )
        with self._env.begin(db=self._batches) as txn:
            cursor = txn.cursor()
            self._bytes = sum(_SEQ.size + len(value) for value in cursor.iternext(keys=False))
            self._next = _SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0

    @property
    def next_seq(self) -> int:
        return self._next

    @property
    def kept_bytes(self) -> int:
        """Bytes of the batches kept (keys and values)."""
        return self._bytes

    @property
    def full(self) -> str:
        """Why the last batch found no space; "" once one is kept again."""
        return self._space.full

    def append(self, topic: bytes, payload: bytes) -> int | None:
        """Keep a batch; returns its sequence number, or None where no space was found for it
        (counted as ``event_log_disk_full``). The oldest go past ``capacity_bytes``."""
        value = _TOPIC_LEN.pack(len(topic)) + topic + payload
        with self._lock:
            return self._space.write(lambda: self._append(value), self._drop_half)

    def _append(self, value: bytes) -> int:
        kept = self._bytes
        size = _SEQ.size + len(value)
        with self._env.begin(write=True, db=self._batches) as txn:  # aborted on any error
            cursor = txn.cursor()
            positioned = cursor.first()
            while positioned and kept + size > self.capacity_bytes:
                kept -= _SEQ.size + len(cursor.value())
                cursor.delete()
                positioned = bool(cursor.key())  # on the next batch, if any
            seq = self._next
            txn.put(_SEQ.pack(seq), value, append=True)
        self._next, self._bytes = seq + 1, kept + size
        return seq

    def _drop_half(self, _tries: int) -> None:
        """Drop the older half of the kept batches, committed on their own (see `Space`)."""
        kept = self._bytes
        with self._env.begin(write=True, db=self._batches) as txn:
            drop = txn.stat(self._batches)["entries"] // 2
            cursor = txn.cursor()
            cursor.first()
            for _ in range(drop):
                kept -= _SEQ.size + len(cursor.value())
                cursor.delete()
        self._bytes = kept

    def since(self, start: int) -> Iterator[tuple[int, bytes, bytes]]:
        """``(seq, topic, payload)`` of every kept batch from ``start`` on, in order."""
        with self._env.begin(db=self._batches) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(_SEQ.pack(max(0, start))):
                return
            for key, value in cursor:
                (size,) = _TOPIC_LEN.unpack_from(value)
                end = _TOPIC_LEN.size + size
                yield _SEQ.unpack(key)[0], bytes(value[_TOPIC_LEN.size : end]), bytes(value[end:])

    def close(self) -> None:
        self._env.close()
