"""The published batches, kept on disk for replay: a subscriber that missed some asks from the
sequence number it last saw, and a restarted kvtierd goes on numbering where it stopped, so no
subscriber mistakes a restart for a gap it cannot fill."""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb

_SEQ = struct.Struct(">Q")
_TOPIC_LEN = struct.Struct("<H")
_MAP_BYTES = 1 << 30
"""Reserved address space, not disk; a log that fills it keeps its newer half."""


class EventLog:
    def __init__(self, path: Path, capacity: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self._env = lmdb.open(str(path), map_size=_MAP_BYTES, max_dbs=1, subdir=True)
        self._batches = self._env.open_db(b"batches")
        self._lock = threading.Lock()
        with self._env.begin(db=self._batches) as txn:
            cursor = txn.cursor()
            self._next = _SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0
            self._count = txn.stat(self._batches)["entries"]

    @property
    def next_seq(self) -> int:
        return self._next

    def append(self, topic: bytes, payload: bytes) -> int:
        """Keep a batch; returns its sequence number. The oldest past ``capacity`` go, and half
        of those kept when the map is full."""
        value = _TOPIC_LEN.pack(len(topic)) + topic + payload
        with self._lock:
            try:
                return self._append(value, self.capacity)
            except lmdb.MapFullError:
                return self._append(value, self._count // 2)

    def _append(self, value: bytes, keep: int) -> int:
        count = self._count
        with self._env.begin(write=True, db=self._batches) as txn:  # aborted on any error
            cursor = txn.cursor()
            cursor.first()
            while count >= max(1, keep) and cursor.delete():
                count -= 1
            seq = self._next
            txn.put(_SEQ.pack(seq), value, append=True)
        self._next, self._count = seq + 1, count + 1
        return seq

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
