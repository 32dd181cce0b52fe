"""The shared-memory arena file: its layout, creation, pre-faulting and mapping by path.

Layout of the file::

    [0, 4 KiB)            header: magic, version, retired word, sizes
    [4 KiB, ...)          extent table: slot size of each extent (0 = unassigned)
    slot table            per slot: generation u64, state u32, refcount u32 (separate arrays)
    key index             which slot holds each committed chunk (arena_index.py)
    data (2 MiB aligned)  extents of ``extent_bytes``, each cut into equal slots

Only the owning process (the TierManager) writes the tables; any process may map the file, read a
slot's generation to tell whether a reference it holds is still current, and find chunks in the
index. Every slot's generation starts at the file's random ``epoch``, so a reference into one
daemon's arena never passes as current in its successor's at the same path.

A file is marked retired (its header's retired word set) before it leaves the path: by its owner
at close, or by the successor that takes over a dead owner's file. A process mapping it reads the
mark from memory, so telling whether its mapping is still the arena costs no system call, which
would give up the GIL in a busy engine loop.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import grp
import math
import mmap
import os
import secrets
import struct
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvtier.core.errors import CapacityError, ConfigError, TierUnavailableError
from kvtier.tiers.arena_index import ENTRY_BYTES, ArenaIndex, capacity_for

_MAGIC = b"KVTARENA"
_VERSION = 2
_HEADER = struct.Struct("<8sIIQQQQQQQQQ")
_RETIRED_AT = struct.calcsize("<8sI")  # the u32 after magic and version; 0 in a live file
_RETIRED = struct.Struct("<I")
_PAGE = 4096
_DATA_ALIGN = 2 << 20


class SlotState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _plan(size: int, extent_bytes: int, max_slots_per_extent: int) -> tuple[int, int, int, int]:
    """Largest extent count whose tables and data fit in ``size``; returns the table, index and
    data offsets too."""
    extents = size // extent_bytes
    while extents > 0:
        slots = extents * max_slots_per_extent
        table_off = _align(_PAGE + extents * 8, _PAGE)
        index_off = _align(table_off + slots * 16, _PAGE)
        data_off = _align(index_off + capacity_for(slots) * ENTRY_BYTES, _DATA_ALIGN)
        if data_off + extents * extent_bytes <= size:
            return extents, table_off, index_off, data_off
        extents -= 1
    raise ConfigError(
        "arena.size_bytes", f"{size} bytes cannot hold one {extent_bytes}-byte extent"
    )


class ArenaMemory:
    """One mapping of the arena file, owning or attached."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self.owner = owner
        self.size: int
        self.extent_bytes: int
        self.num_extents: int
        self.max_slots_per_extent: int
        self.data_offset: int
        self.epoch: int
        (
            magic,
            version,
            _retired,
            self.size,
            self.extent_bytes,
            self.num_extents,
            self.max_slots_per_extent,
            table_off,
            self.data_offset,
            index_off,
            index_capacity,
            self.epoch,
        ) = _HEADER.unpack_from(mm, 0)
        if magic != _MAGIC or version != _VERSION:
            raise TierUnavailableError(f"{path} is not a kvtier arena (version {_VERSION})")
        n = self.num_extents * self.max_slots_per_extent
        self.extent_slot_bytes: npt.NDArray[np.uint64] = np.frombuffer(
            mm, np.uint64, self.num_extents, _PAGE
        )
        self.generation: npt.NDArray[np.uint64] = np.frombuffer(mm, np.uint64, n, table_off)
        self.state: npt.NDArray[np.uint32] = np.frombuffer(mm, np.uint32, n, table_off + 8 * n)
        self.refcount: npt.NDArray[np.uint32] = np.frombuffer(mm, np.uint32, n, table_off + 12 * n)
        self._view = memoryview(mm)
        self.index = ArenaIndex(self._view, index_off, index_capacity)
        self._state_words = self._view[table_off + 8 * n : table_off + 12 * n].cast("I")
        self._generation_words = self._view[table_off : table_off + 8 * n].cast("Q")
        self._retired_word = self._view[_RETIRED_AT : _RETIRED_AT + 4].cast("I")

    @property
    def retired(self) -> bool:
        """Whether this file has left its path (its owner closed it, or a successor took over)."""
        return bool(self._retired_word[0])

    @classmethod
    def create(
        cls,
        path: Path,
        size: int,
        extent_bytes: int,
        min_slot_bytes: int,
        prefault: bool = True,
        mode: int = 0o600,
        gid: int | None = None,
    ) -> ArenaMemory:
        """Create (or take over) the arena file, reserve its memory and map it; the file gets
        ``mode`` and, when given, group ``gid`` (the socket's: its clients map the arena)."""
        max_slots = extent_bytes // min_slot_bytes
        extents, table_off, index_off, data_off = _plan(size, extent_bytes, max_slots)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _take_over_stale(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise ConfigError("arena.path", f"cannot create {path}: {exc.strerror}") from exc
        try:
            # the group first, then the mode: group access is never given to the wrong group
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ConfigError(
                "arena.group",
                f"cannot give {path} group {gid} and mode {mode:04o}: {exc.strerror} "
                "(a non-root kvtierd must be a member of the group)",
            ) from exc
        try:
            os.posix_fallocate(fd, 0, size)  # fail now, not with SIGBUS on a later store
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise CapacityError(
                f"arena.size_bytes: cannot reserve {size} bytes at {path}: {exc.strerror}; "
                "lower arena.size_bytes or enlarge the shared-memory mount"
            ) from exc
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if prefault:
            pages = np.frombuffer(mm, np.uint8)
            pages[::_PAGE] = 0  # one write per page maps it in
            del pages
        epoch = secrets.randbits(62)  # room for 2**62 generations per slot above it
        _HEADER.pack_into(
            mm,
            0,
            _MAGIC,
            _VERSION,
            0,
            size,
            extent_bytes,
            extents,
            max_slots,
            table_off,
            data_off,
            index_off,
            capacity_for(extents * max_slots),
            epoch,
        )
        memory = cls(path, fd, mm, owner=True)
        memory.generation[:] = epoch
        return memory

    @classmethod
    def attach(cls, path: Path, populate: bool = True) -> ArenaMemory:
        """Map an existing arena, as a worker process does.

        ``populate`` maps every page now: otherwise each first touch of a page by this process
        is a fault, which held copies into a fresh mapping to about a third of memcpy speed.
        """
        try:
            fd = os.open(path, os.O_RDWR)
        except PermissionError as exc:
            raise TierUnavailableError(_denied(path)) from exc
        except OSError as exc:
            raise TierUnavailableError(f"cannot open arena {path}: {exc.strerror}") from exc
        size = os.fstat(fd).st_size
        if size < _HEADER.size:
            os.close(fd)
            raise TierUnavailableError(f"{path} is not a kvtier arena (too small)")
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(path, fd, mm, owner=False)

    def slot_id(self, extent: int, index: int) -> int:
        return extent * self.max_slots_per_extent + index

    def slot_offset(self, slot: int) -> int:
        extent, index = divmod(slot, self.max_slots_per_extent)
        slot_bytes = int(self.extent_slot_bytes[extent])
        return self.data_offset + extent * self.extent_bytes + index * slot_bytes

    def slot_bytes(self, slot: int) -> int:
        return int(self.extent_slot_bytes[slot // self.max_slots_per_extent])

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._view[offset : offset + nbytes]

    def is_current(self, slot: int, generation: int) -> bool:
        """Whether a reference taken at ``generation`` still names the same chunk."""
        return int(self.generation[slot]) == generation

    def find(self, key: bytes) -> tuple[int, int] | None:
        """(slot, generation) of a committed chunk, from the shared index; None if absent or
        changing right now."""
        return self.index.find(key, self._state_words, self._generation_words)

    def close(self) -> None:
        if self.owner:
            self._retired_word[0] = 1  # before the unlink: a mapper that sees no mark stats
            self.path.unlink(missing_ok=True)
        self._retired_word.release()
        del self.extent_slot_bytes, self.generation, self.state, self.refcount, self.index
        self._state_words.release()
        self._generation_words.release()
        self._view.release()
        # A caller may still hold a slot view; the mapping then goes when that view does.
        with contextlib.suppress(BufferError):
            self._mm.close()
        os.close(self._fd)


def resolve_group(group: str | int | None, key: str) -> int | None:
    """The gid of a configured group (a name or a number); None when unset."""
    if group is None:
        return None
    if isinstance(group, int) or group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(key, f"no group named {group!r} on this machine") from None


def _denied(path: Path) -> str:
    """Why this process may not map the arena, and what to change."""
    try:
        st = os.stat(path)
        owner = f"mode {st.st_mode & 0o777:04o}, owner {st.st_uid}, group {st.st_gid}"
    except OSError:
        owner = "its directory is closed to this process"
    groups = sorted({os.getegid(), *os.getgroups()})
    return (
        f"cannot map the arena {path}: permission denied ({owner}; this process runs as uid "
        f"{os.geteuid()} in groups {groups}); run it in the arena's group (kvtierd's "
        "server.group), with arena.file_mode 0660"
    )


def _take_over_stale(path: Path) -> None:
    """Unlink an arena left by a dead owner; refuse one whose owner still holds its lock.

    Unlinking (not truncating) leaves processes that still map the old file unharmed.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError("arena.path", f"{path} is in use by another kvtier process") from None
        # its mappers move to the new file; a file someone else planted is not read
        if os.fstat(fd).st_uid == os.geteuid() and os.pread(fd, len(_MAGIC), 0) == _MAGIC:
            os.pwrite(fd, _RETIRED.pack(1), _RETIRED_AT)
        path.unlink()
    finally:
        os.close(fd)


class ArenaAtPath:
    """The arena at ``path`` as another process sees it, mapped again whenever a new file takes
    the path (a restarted daemon), so nothing is read from or written to an arena nobody owns.

    A mapping whose file is not marked retired is used as is; the path is looked at again only
    after a mark, or once ``recheck_s`` passed since the last look (a file removed by hand)."""

    def __init__(self, path: Path, populate: bool, recheck_s: float = 1.0) -> None:
        self.path = path
        self._populate = populate
        self._recheck_s = recheck_s
        self._inode = 0
        self._looked = -math.inf
        self.memory: ArenaMemory | None = None

    def current(self) -> ArenaMemory:
        """The mapping of the file at the path now; raises TierUnavailableError without one."""
        memory = self.memory
        now = time.monotonic()
        if memory is not None and not memory.retired and now - self._looked < self._recheck_s:
            return memory
        try:
            inode = os.stat(self.path).st_ino
        except OSError as exc:
            raise TierUnavailableError(f"no arena at {self.path}: {exc.strerror}") from None
        if memory is None or self._inode != inode or memory.retired:
            self.close()
            self.memory = memory = ArenaMemory.attach(self.path, self._populate)
            self._inode = inode
        self._looked = now
        return memory

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
            self.memory = None
