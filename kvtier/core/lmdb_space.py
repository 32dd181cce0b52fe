"""Writes to an LMDB environment that a dead reader, a full map or a full disk never stops for
good, shared by every environment kvtier writes (lmdb's chunks, the event log, the object index).

A reader killed inside its read transaction leaves its slot in the lock file, and LMDB keeps
every page its snapshot could see: freed pages are not reused and the map fills. Such slots are
cleared (`Space.reap`) when due and at once after a map-full. Pages freed by a transaction are
reused only once it has committed, so room is made (old entries deleted) in a transaction of its
own before the write is tried again. A disk with no space left (ENOSPC), or a map still full after
that, refuses the write: counted, shown as `Space.full`, and cleared by the next commit, so the
environment recovers by itself once space returns.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import lmdb

from kvtier.core.counters import Counters
from kvtier.core.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")

ROOM_TRIES = 4
"""Tries of one write: the first, then after each reap and room made."""


class Space:
    """The write path of one environment: stale readers reaped, room made, no space counted.

    Counters (prefixed with ``prefix``): ``stale_readers`` (slots of dead readers cleared),
    ``map_full`` (writes that found the map full, retried), ``disk_full`` (writes refused: no
    space on the disk, or a map that stayed full)."""

    def __init__(
        self,
        env: Callable[[], lmdb.Environment],
        name: str,
        counters: Counters,
        prefix: str = "",
        reap_interval_s: float = 0.0,
    ) -> None:
        self._env = env
        self._name = name
        self._counters = counters
        self._prefix = prefix
        self._reap_interval_s = reap_interval_s
        self._reaped_at = time.monotonic()
        self._lock = threading.Lock()
        self.full = ""
        """Why the last write found no space ("" once one commits again)."""

    def reap(self) -> int:
        """Clear the reader slots of dead processes; how many were cleared."""
        with self._lock:
            self._reaped_at = time.monotonic()
            stale: int = self._env().reader_check()
        if stale:
            log.warning("%s: cleared %d reader slots of dead processes", self._name, stale)
            self._counters.add(self._prefix + "stale_readers", stale)
        return stale

    def reap_if_due(self) -> int:
        """`reap` when ``reap_interval_s`` (> 0) has passed since the last one."""
        due = self._reap_interval_s > 0
        if due and time.monotonic() - self._reaped_at >= self._reap_interval_s:
            return self.reap()
        return 0

    def write(
        self,
        attempt: Callable[[], T],
        make_room: Callable[[int], object],
        resized: Callable[[], object] | None = None,
    ) -> T | None:
        """``attempt()`` (one write transaction). After a map-full, stale readers are reaped, or
        where there were none ``make_room(try)`` commits deletions of its own (``try`` counts
        from 1; more each time: LMDB reuses the pages a transaction freed from the second commit
        after it); then it is tried again. None when no space was found (counted; `full` says
        why); other LMDB errors are raised. ``resized``: adopt a map another process grew
        (default: its size)."""
        why = "the map is full and nothing more can be freed"
        for tries in range(1, ROOM_TRIES + 1):
            try:
                result = attempt()
            except lmdb.MapResizedError:
                (resized or self._adopt_size)()
                continue
            except lmdb.MapFullError:
                self._counters.add(self._prefix + "map_full", 1)
                if tries == ROOM_TRIES:
                    break
                if self.reap():  # what dead readers pinned is free now: nothing to delete
                    continue
                try:
                    make_room(tries)
                except lmdb.MapFullError:  # deleting needs pages too: none were free yet
                    pass
                except lmdb.DiskError as exc:
                    why = f"no space left on the disk: {exc}"
                    break
                continue
            except lmdb.DiskError as exc:
                why = f"no space left on the disk: {exc}"
                break
            if self.full:
                log.warning("%s: writes commit again", self._name)
                self.full = ""
            return result
        if not self.full:
            log.error("%s: writes are refused until space returns (%s)", self._name, why)
        self.full = why
        self._counters.add(self._prefix + "disk_full", 1)
        return None

    def _adopt_size(self) -> None:
        self._env().set_mapsize(0)


def restrict_files(
    path: Path, names: tuple[str, ...], mode: int, gid: int | None, key: str
) -> None:
    """Give the environment's files ``gid`` (first: group access never goes to the wrong group)
    and then ``mode``; the lock file gets group write where the group may read, since a reader
    takes its slot there. ``key`` names the setting an error points at."""
    for name in names:
        file = path / name
        file_mode = mode | (mode & 0o040) >> 1 if name == "lock.mdb" else mode
        try:
            if gid is not None:
                os.chown(file, -1, gid)
            os.chmod(file, file_mode)
        except FileNotFoundError:
            continue  # opened without a lock file (read-only copies)
        except OSError as exc:
            raise ConfigError(
                key,
                f"cannot give {file} group {gid} and mode {file_mode:04o}: {exc.strerror} "
                "(a non-root kvtierd must be a member of the group)",
            ) from exc
