"""Payload checksums of dirty arena chunks, taken as they are committed.

The arena is shared memory that clients can still write after a commit, so write-back compares
what it stores with the checksum taken here; a chunk whose bytes changed is dropped, not demoted.
A thread of its own hashes committed slots, so a commit (on the engine's step) never waits.

Each checksum is also kept on file (`ChecksumLedger`), beside the arena, where the next owner
at the arena's path reads it when this process was killed (`arena_salvage`): with each chunk's
key, generation and place, as this process knew them. The file is this process's own (mode
0600), never mapped by clients; a record carries a check of itself, so one half written when
the process died is skipped. Its owner holds a lock on it while it lives: a ledger no process
locks, whose arena file is gone (a killed owner's arena removed by hand, or by a script that
knew only the arena's name), has nothing left to speak for, and the next owner of any arena in
that directory removes it (`remove_orphaned_ledgers`).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import queue
import stat
import struct
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from xxhash import xxh3_64_intdigest

from kvtier.core.counters import Counters
from kvtier.core.keys import MAX_CHUNK_HASH_BYTES, NAMESPACE_BYTES, ChunkKey
from kvtier.core.priority import enter_background
from kvtier.core.protocol import SlotRef

log = logging.getLogger(__name__)

_KEY_BYTES = NAMESPACE_BYTES + MAX_CHUNK_HASH_BYTES
# generation, offset, nbytes, digest (xxh3-128), key length, key; then a check of the record
_FIELDS = struct.Struct(f"<QQQ16sH6x{_KEY_BYTES}s")
_CHECK = struct.Struct("<Q")
RECORD_BYTES = _FIELDS.size + _CHECK.size
LEDGER_MODE = 0o600
_SUFFIX = ".checksums"


def ledger_path(arena: Path) -> Path:
    """Where the owner of the arena at ``arena`` keeps its commit checksums."""
    return arena.with_name(arena.name + _SUFFIX)


def remove_orphaned_ledgers(directory: Path) -> int:
    """Remove the ledgers in ``directory`` that this user owns, no live process locks, and whose
    arena file is gone; returns how many. A dead owner's ledger beside its arena stays: the
    next owner at that path salvages from it."""
    removed = 0
    try:
        names = [n for n in os.listdir(directory) if n.endswith(_SUFFIX)]
    except OSError:
        return 0
    for name in names:
        path = directory / name
        arena = directory / name.removesuffix(_SUFFIX)
        if os.path.lexists(arena):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or a link: not ours to judge
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: its owner lives
            # still that file, and still no arena: a new owner makes its arena first
            if os.stat(path).st_ino == st.st_ino and not os.path.lexists(arena):
                path.unlink()
                removed += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        log.info("arena: removed %d commit-checksum files of dead owners in %s", removed, directory)
    return removed


@dataclass(frozen=True, slots=True)
class CommittedChunk:
    """A committed chunk as the arena's owner recorded it, with its commit checksum."""

    key: ChunkKey
    slot: int
    generation: int
    offset: int
    nbytes: int
    digest: bytes


class ChecksumLedger:
    """The commit checksum of each slot, in a file of this process's own beside the arena."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm

    @classmethod
    def create(cls, arena: Path, slots: int) -> ChecksumLedger | None:
        """A new, empty ledger for an arena of ``slots`` slots at ``arena``, in place of any
        earlier one (its successor reads that first); None, logged, when it cannot be made:
        the arena works without it, and what it holds is not kept after a crash."""
        remove_orphaned_ledgers(arena.parent)
        path = ledger_path(arena)
        size = max(1, slots) * RECORD_BYTES
        fd = -1
        try:
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, LEDGER_MODE)
            os.fchmod(fd, LEDGER_MODE)  # whatever the umask
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this process lives
            os.posix_fallocate(fd, 0, size)  # no SIGBUS on a later store into a full mount
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
                path.unlink(missing_ok=True)
            log.warning(
                "arena: cannot keep commit checksums at %s (%s): chunks the arena holds when "
                "this process is killed will not be kept",
                path,
                exc.strerror,
            )
            return None
        return cls(path, fd, mm)

    def put(self, slot: int, ref: SlotRef, offset: int, nbytes: int, digest: bytes) -> None:
        fields = _FIELDS.pack(ref.generation, offset, nbytes, digest, len(ref.key), ref.key)
        at = slot * RECORD_BYTES
        self._mm[at : at + RECORD_BYTES] = fields + _CHECK.pack(xxh3_64_intdigest(fields))

    def clear(self, slot: int) -> None:
        _CHECK.pack_into(self._mm, slot * RECORD_BYTES + _FIELDS.size, 0)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self._mm.close()
        os.close(self._fd)


def read_ledger(arena: Path) -> list[CommittedChunk] | None:
    """The committed chunks a dead owner recorded for the arena at ``arena``; None when it left
    no ledger, or one that is not its own (not owned by this user with mode 0600)."""
    path = ledger_path(arena)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.geteuid()
            or st.st_mode & 0o7777 != LEDGER_MODE
        ):
            log.warning(
                "arena: %s is not this user's own (owner %d, mode %04o): not read",
                path,
                st.st_uid,
                st.st_mode & 0o7777,
            )
            return None
        data = os.pread(fd, st.st_size, 0)
    finally:
        os.close(fd)
    chunks = []
    for slot in range(len(data) // RECORD_BYTES):
        at = slot * RECORD_BYTES
        fields = data[at : at + _FIELDS.size]
        (check,) = _CHECK.unpack_from(data, at + _FIELDS.size)
        if check == 0 or check != xxh3_64_intdigest(fields):
            continue  # never written, cleared, or cut short by the owner's death
        generation, offset, nbytes, digest, key_len, key = _FIELDS.unpack(fields)
        if 0 < key_len <= _KEY_BYTES:
            chunks.append(
                CommittedChunk(ChunkKey(key[:key_len]), slot, generation, offset, nbytes, digest)
            )
    return chunks


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
        self._ledger: ChecksumLedger | None = None
        self._span: Callable[[int], tuple[int, int]] = lambda slot: (0, 0)

    def keep_in(
        self, ledger: ChecksumLedger | None, span: Callable[[int], tuple[int, int]]
    ) -> None:
        """Record each checksum in ``ledger`` too, with the slot's (offset, nbytes) from
        ``span``, as this process placed it (never a client's word)."""
        self._ledger = ledger
        self._span = span

    def _keep(self, ref: SlotRef, digest: bytes) -> None:
        """Called under the lock, for a current ``ref``."""
        self._of_slot[ref.slot] = digest
        if self._ledger is not None:
            self._ledger.put(ref.slot, ref, *self._span(ref.slot), digest)

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
        enter_background()
        while (ref := self._queue.get()) is not None:
            with self._lock:
                if self._closed or not self._current(ref):
                    self._counters.add("commit_checksums", 1)
                    continue  # freed or reused meanwhile: nothing to keep
            digest = self._digest(ref)  # outside the lock
            with self._lock:
                # a generation that moved while hashing means the slot was freed: drop the hash
                if self._current(ref) and self._of_slot[ref.slot] is None:
                    self._keep(ref, digest)
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
                    self._keep(ref, digest)
        return digest

    def forget(self, slot: int) -> None:
        """The slot was freed or its chunk dropped. Called under the lock."""
        if self._of_slot[slot] is not None:
            self._of_slot[slot] = None
            if self._ledger is not None:
                self._ledger.clear(slot)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        with self._lock:
            self._closed = True
            if self._ledger is not None:
                self._ledger.close()
                self._ledger = None
