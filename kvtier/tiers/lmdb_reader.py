"""Reading chunks held in lmdb from another process than the one that writes them.

A load granted in lmdb (`kvtier.core.protocol.in_lmdb`) is read by the engine's worker itself,
straight from the environment's map: the hit needs no arena slot, so an arena smaller than
what the engines load at once stops capping how much of the working set they can serve.
LMDB admits readers beside its one writer: each read is one short read transaction, whose
snapshot stays whole even if the writer deletes the chunk meanwhile, and every read is verified
(and decoded, for a coded lmdb) as the tier's own reads are.

An environment must be opened once per process: where the tiers run in this process (embedded
mode), their open environment is adopted (`adopt`) instead of opening it a second time. One
opened read-only is shared by its users in the process and closed when the last gives it back
(`release_reader`: an engine shutting down), so the process can open it again, as a reader or
as the tiers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numpy as np

from kvtier.core import blockfmt
from kvtier.core.errors import ChunkFormatError, TierUnavailableError
from kvtier.core.keys import ChunkKey
from kvtier.core.log_limit import LimitedLog
from kvtier.core.protocol import Failure

__all__ = [
    "DATABASES",
    "LmdbReader",
    "LmdbSnapshot",
    "adopt",
    "copy_payload",
    "disown",
    "failure_of",
    "reader_at",
    "release_reader",
    "will_need",
    "without_frames",
]

log = logging.getLogger(__name__)

DATABASES = (b"chunks", b"lru", b"meta", b"pins", b"records")
"""The environment's databases (`kvtier.tiers.lmdb_tier`); a reader opens ``chunks`` only."""


def copy_payload(
    env: lmdb.Environment, chunks: lmdb._Database, key: ChunkKey, dst: memoryview
) -> tuple[bool, ChunkFormatError | None]:
    """Copy a chunk's payload out, verified: whether it is stored, and how it failed if it
    did (then ``dst`` holds garbage). LMDB's buffer is invalid once the transaction ends."""
    with env.begin(db=chunks, buffers=True) as txn:
        value = txn.get(key)
        if value is None:
            return False, None
        try:
            blockfmt.decode_into(value, key, dst)
        except ChunkFormatError as exc:
            return True, without_frames(exc)
    return True, None


def without_frames(exc: ChunkFormatError) -> ChunkFormatError:
    """A verification failure to hand back, without its traceback: the traceback's frames hold
    the read transaction, and with it one of LMDB's reader slots (shared by every process),
    until the cycle collector runs; engines reading many corrupt chunks filled the table."""
    return exc.with_traceback(None)


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_MADV_WILLNEED = 3


def will_need(env: lmdb.Environment, chunks: lmdb._Database, keys: Sequence[ChunkKey]) -> int:
    """Ask the kernel to read the stored chunks of ``keys`` ahead (madvise WILLNEED on their
    pages of the map), so that reads of several cold chunks overlap on the disk instead of
    faulting in one after another; returns how many were found. Nothing is read here."""
    found = 0
    page = mmap.PAGESIZE
    with env.begin(db=chunks, buffers=True) as txn:
        for key in keys:
            value = txn.get(key)
            if value is None:
                continue
            found += 1
            start = int(np.frombuffer(value, np.uint8).ctypes.data)
            first = start - start % page
            _libc.madvise(
                ctypes.c_void_p(first), ctypes.c_size_t(start + len(value) - first), _MADV_WILLNEED
            )
    return found


def failure_of(exc: ChunkFormatError) -> Failure:
    """What a failed verification found wrong: the payload's checksum, or else the header."""
    return Failure.PAYLOAD if "payload checksum" in str(exc) else Failure.HEADER


class LmdbReader:
    """Verified reads of one lmdb environment's chunks."""

    def __init__(self, env: lmdb.Environment, chunks: lmdb._Database) -> None:
        self.env = env
        self._chunks = chunks
        # a map that cannot be read fails every request's read and look-up the same way
        self.read_failures = LimitedLog(log, logging.ERROR)
        self._lookup_failures = LimitedLog(log, logging.WARNING)

    @classmethod
    def open(cls, path: Path) -> LmdbReader:
        env = lmdb.open(str(path), readonly=True, lock=True, subdir=True, max_dbs=len(DATABASES))
        try:
            return cls(env, env.open_db(b"chunks", create=False))
        except BaseException:
            env.close()
            raise

    def read_into(self, key: ChunkKey, dst: memoryview) -> ChunkFormatError | bool:
        """Copy a chunk, verified and decoded, into ``dst`` (its raw size): True when done,
        False when lmdb no longer holds it (or cannot be read), or how it failed verification."""
        try:
            try:
                found, failure = copy_payload(self.env, self._chunks, key, dst)
            except lmdb.MapResizedError:  # the writer grew the map: adopt its size, read again
                self.env.set_mapsize(0)
                found, failure = copy_payload(self.env, self._chunks, key, dst)
        except lmdb.Error as exc:
            self.read_failures.log("lmdb: cannot read chunk %s here: %s", key.hex(), exc)
            return False
        return failure if failure is not None else found

    def holds(self, key: ChunkKey) -> bool | None:
        """Whether the chunk ``key`` is stored, read from the map without touching its value;
        None where the map cannot be read (that is no answer: a caller asks the tiers)."""
        try:
            with self.begin() as txn:
                return txn.get(key) is not None
        except lmdb.Error as exc:
            self._lookup_failures.log("lmdb: cannot look up chunk %s here: %s", key.hex(), exc)
            return None

    def begin(self) -> lmdb.Transaction:
        """A read transaction of the chunks, whose values are views of the map."""
        try:
            return self.env.begin(db=self._chunks, buffers=True)
        except lmdb.MapResizedError:  # the writer grew the map: adopt its size
            self.env.set_mapsize(0)
            return self.env.begin(db=self._chunks, buffers=True)

    @contextmanager
    def snapshot(self, hold_s: float = 0.05) -> Iterator[LmdbSnapshot]:
        """Reads sharing one read transaction (begun again once held ``hold_s``), ended when the
        block exits: views it handed out are invalid after."""
        snapshot = LmdbSnapshot(self, hold_s)
        try:
            yield snapshot
        finally:
            snapshot.end()

    def read_ahead(self, keys: Sequence[ChunkKey]) -> None:
        """Start reading these chunks from disk, all together (`will_need`)."""
        try:
            will_need(self.env, self._chunks, keys)
        except lmdb.Error as exc:  # a hint only: the reads themselves report failures
            log.debug("lmdb: read-ahead failed: %s", exc)


class LmdbSnapshot:
    """Verified reads of a run of chunks (a step's loads) in one read transaction, where a
    chunk stored as it is is verified in lmdb's map and handed out as a view of it: the bytes
    verified are the bytes the caller then copies, with no copy between. A transaction pins the
    pages it sees (the writer cannot reuse them), so it is begun again at the first read past
    ``hold_s``: none is held longer than that plus one chunk's read and copy."""

    def __init__(self, reader: LmdbReader, hold_s: float) -> None:
        self._reader = reader
        self._hold_s = hold_s
        self._txn: lmdb.Transaction | None = None
        self._begun = 0.0

    def read(
        self, key: ChunkKey, nbytes: int, buffer: Callable[[], memoryview], in_place: bool
    ) -> memoryview | ChunkFormatError | bool:
        """``key``'s payload (``nbytes`` long), verified: with ``in_place`` and stored as it
        is, a view of lmdb's map, valid until the next read or the snapshot's end; otherwise
        decoded into ``buffer()``, returned. False where lmdb no longer holds it or cannot be
        read; how it failed verification."""
        try:
            value = self._current().get(key)
            if value is None:
                return False
            view = blockfmt.verified_in_place(value, key, nbytes) if in_place else None
            if view is None:
                view = buffer()
                blockfmt.decode_into(value, key, view)
            return view
        except ChunkFormatError as exc:
            return without_frames(exc)
        except lmdb.Error as exc:
            self._reader.read_failures.log("lmdb: cannot read chunk %s here: %s", key.hex(), exc)
            self.end()
            return False

    def end(self) -> None:
        """End the transaction (a later read begins another)."""
        if self._txn is not None:
            self._txn.abort()
            self._txn = None

    def _current(self) -> lmdb.Transaction:
        now = time.monotonic()
        if self._txn is not None and now - self._begun <= self._hold_s:
            return self._txn
        self.end()
        self._txn = self._reader.begin()
        self._begun = now
        return self._txn


class _Held:
    """A reader this process shares, with how many users hold it."""

    def __init__(self, reader: LmdbReader, adopted: bool) -> None:
        self.reader = reader
        self.adopted = adopted
        """The tiers of this process opened it (and close it); else it was opened read-only."""
        self.users = 0


_readers: dict[str, _Held] = {}
_lock = threading.Lock()


def _canonical(path: Path) -> str:
    return os.path.realpath(path)


def adopt(path: Path, env: lmdb.Environment, chunks: lmdb._Database) -> None:
    """The tiers of this process opened the environment at ``path``: readers here use it."""
    with _lock:
        _readers[_canonical(path)] = _Held(LmdbReader(env, chunks), adopted=True)


def disown(path: Path) -> None:
    """The tiers of this process close the environment at ``path``."""
    with _lock:
        _readers.pop(_canonical(path), None)


def reader_at(path: str | Path) -> LmdbReader:
    """This process's reader of the environment at ``path``, opened read-only on first use and
    held until every user gave it back (`release_reader`); raises `TierUnavailableError` where
    it cannot be read from here."""
    name = _canonical(Path(path))
    with _lock:
        held = _readers.get(name)
        if held is None:
            try:
                held = _readers[name] = _Held(LmdbReader.open(Path(name)), adopted=False)
            except (lmdb.Error, OSError) as exc:
                raise TierUnavailableError(f"lmdb at {path} cannot be read here: {exc}") from exc
        held.users += 1
        return held.reader


def release_reader(path: str | Path) -> None:
    """Give back a reader `reader_at` handed out (an engine shut down): the last user closes an
    environment opened read-only, freeing this process to open it again (LMDB admits one
    environment per file in a process) and its reader slots."""
    name = _canonical(Path(path))
    with _lock:
        held = _readers.get(name)
        if held is None or held.users == 0:
            return
        held.users -= 1
        if held.users == 0 and not held.adopted:
            del _readers[name]
            held.reader.env.close()
