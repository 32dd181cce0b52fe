"""Uploads sent and not yet recorded in the object index, one small file each beside it.

An upload writes its intent before the object is sent and removes it once the object is indexed
or the name was found taken. A process killed in between (or an upload that failed without an
answer) leaves the intent: at the next start it is an *orphan*, an object this node may have
written that no index names. Orphans count in the store budget until the tier resolves them
(`orphans.Orphans.resolve`). Files rather than the index's own map: a map full of objects
must still take an intent, and dropping one must never need room.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

import xxhash

log = logging.getLogger("kvtier.tiers.objstore.tier")


class UploadIntents:
    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._lock = threading.Lock()
        self.orphans: dict[str, int] = {}
        """Objects maybe written and never recorded: name -> bytes."""
        for file in path.iterdir():
            try:
                size, name = file.read_text().split("\n", 1)
                self.orphans[name] = int(size)
            except (OSError, ValueError) as exc:  # a torn write: the put never started
                log.warning("upload intent %s unreadable, removed: %s", file, exc)
                file.unlink(missing_ok=True)

    def _file(self, name: str) -> Path:
        return self._path / xxhash.xxh3_128_hexdigest(name.encode())

    def record(self, name: str, size: int) -> bool:
        """Record an upload about to be sent; False when the disk refuses (then untraced)."""
        try:
            self._file(name).write_text(f"{size}\n{name}")
        except OSError as exc:
            log.warning("upload intent for %s not recorded: %s", name, exc)
            return False
        return True

    def settle(self, name: str) -> None:
        """The upload of ``name`` is resolved: recorded, lost to another writer, or deleted."""
        with self._lock:
            self.orphans.pop(name, None)
        with contextlib.suppress(OSError):
            self._file(name).unlink(missing_ok=True)

    def orphaned(self, name: str, size: int) -> None:
        """An upload failed without a clear answer: maybe written, counted until resolved."""
        with self._lock:
            self.orphans[name] = size

    def orphan_bytes(self) -> int:
        with self._lock:
            return sum(self.orphans.values())
