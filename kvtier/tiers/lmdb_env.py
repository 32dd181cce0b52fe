"""Opening the lmdb tier's environment: directory, budget, checks, preallocation, moving aside."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lmdb

from kvtier.core.config import Durability, LMDBConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.lmdb_space import restrict_files
from kvtier.tiers.arena import resolve_group
from kvtier.tiers.lmdb_reader import DATABASES

log = logging.getLogger("kvtier.tiers.lmdb_tier")  # the tier's logger, which operators filter on

MAP_HEADROOM = 64 << 20
DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
# what LMDB raises on pages or headers it cannot make sense of (an environment to move aside)
UNREADABLE_ERRORS = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
    lmdb.IncompatibleError,
    lmdb.BadValsizeError,
    lmdb.PanicError,
)


class Unreadable(Exception):
    """The environment on disk cannot be opened or walked."""


def prepare_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".kvtier-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError("lmdb.path", f"{path} is not writable: {exc.strerror}") from exc


def _free_name(base: Path) -> Path:
    name = base
    n = 1
    while name.exists():
        n += 1
        name = base.with_name(f"{base.name}-{n}")
    return name


def move_aside(path: Path, reason: str) -> Path:
    """Rename an unreadable environment to a timestamped sibling, kept for inspection; the
    files alone when the directory cannot move (a mount point). Returns where it went."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = _free_name(path.with_name(f"{path.name}.unreadable-{stamp}"))
    try:
        path.rename(target)
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.EXDEV, errno.EACCES, errno.EPERM):
            raise
        target = _free_name(path / f"{DATA_FILE}.unreadable-{stamp}")
        (path / DATA_FILE).rename(target)
        (path / LOCK_FILE).unlink(missing_ok=True)
    path.mkdir(exist_ok=True)
    log.warning(
        "lmdb environment %s is unreadable (%s): moved aside to %s; lmdb starts empty",
        path,
        reason,
        target,
    )
    return target


def allocated_bytes(path: Path) -> int:
    """Disk space the file takes (a preallocated or written file; not the holes of a sparse
    one); 0 when absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return 0
    return min(st.st_size, st.st_blocks * 512)


def budget(config: LMDBConfig) -> int:
    usage = shutil.disk_usage(config.path)
    room = usage.free + allocated_bytes(config.path / DATA_FILE)
    if config.budget_bytes is None:
        auto = int(room * config.auto_fraction)
        log.warning(
            "lmdb.budget_bytes is not set: using %.2f GiB, %.0f%% of %.2f GiB free at %s",
            auto / 2**30,
            config.auto_fraction * 100,
            room / 2**30,
            config.path,
        )
        return auto
    chosen = int(config.budget_bytes)
    if chosen + MAP_HEADROOM > room:
        raise ConfigError(
            "lmdb.budget_bytes",
            f"{chosen} bytes does not fit the {room} bytes free at {config.path}",
        )
    return chosen


def _open_env(config: LMDBConfig, map_size: int, writemap: bool) -> lmdb.Environment:
    """Open the environment with the flags ``durability`` asks for.

    With ``writemap`` LMDB writes pages straight into the shared map instead of staging them
    in malloc'd buffers that it writes to the file at commit: a copy fewer. A killed process
    still leaves the last commit: a commit never writes over pages the last two commits' trees
    use, and the meta page's transaction id is stored last. Only ``fast`` (sync and metasync off)
    uses it, where the kernel writing dirty map pages back in any order changes nothing: after
    an OS crash nothing is promised either way. ``consistent`` and ``full`` keep staged writes,
    whose flush at commit measured faster (`benchmarks/tiers.py --durability`) than msync of
    the map; map_async is never set, as it would make their flushes asynchronous.
    """
    durability = config.durability
    return lmdb.open(
        str(config.path),
        map_size=map_size,
        max_dbs=8,
        max_readers=config.max_readers,
        writemap=writemap,
        map_async=False,
        sync=durability is not Durability.FAST,
        metasync=durability is Durability.FULL,
        readahead=True,
        mode=0o600,  # created closed; `restrict_files` then gives the configured group and mode
    )


def check_size(env: lmdb.Environment, data: Path) -> None:
    """Pages past the end of the file would fault the process (SIGBUS) when read: refuse
    a file shorter than the pages its meta page counts (an OS crash lost its tail). Run it
    on an environment opened without writemap, which grows the file to the map size."""
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.stat(data).st_size
    if size < need:
        raise Unreadable(f"{DATA_FILE} holds {size} bytes, its pages need {need}")


def _load_fallocate() -> Any:
    # fallocate(2) itself: posix_fallocate falls back to writing every block when the
    # filesystem cannot preallocate, far too slow for a map of hundreds of GiB
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).fallocate64
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int
    return fn


_fallocate = _load_fallocate()


def preallocate(data: Path, size: int) -> str | None:
    """Allocate the first ``size`` bytes of ``data`` on disk, so that writes through a map of
    that size never meet a block the filesystem has yet to find (on a full disk the process
    would get SIGBUS, not an error). None when done, otherwise why not; a failed attempt
    leaves the file its old length."""
    if _fallocate is None:
        return "fallocate(2) is not available"
    fd = os.open(data, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        old = os.fstat(fd).st_size
        if _fallocate(fd, 0, 0, size) == 0:
            return None
        why = os.strerror(ctypes.get_errno())
        if os.fstat(fd).st_size > old:
            os.ftruncate(fd, old)
        return f"fallocate of {size} bytes: {why}"
    finally:
        os.close(fd)


def files_mode(config: LMDBConfig) -> tuple[int, int | None]:
    """The mode and group the environment's files get (``lmdb.file_mode``, ``lmdb.group``)."""
    gid = resolve_group(config.group, "lmdb.group")
    if config.file_mode is not None:
        return config.file_mode, gid
    return (0o640 if gid is not None else 0o600), gid


def _open_checked(config: LMDBConfig, map_size: int, writemap: bool) -> lmdb.Environment:
    try:
        env = _open_env(config, map_size, writemap)
    except UNREADABLE_ERRORS as exc:
        raise Unreadable(f"{type(exc).__name__}: {exc}") from exc
    except lmdb.Error as exc:
        raise ConfigError("lmdb.path", f"cannot open LMDB at {config.path}: {exc}") from exc
    try:  # files an older kvtier created open to others are closed too
        restrict_files(config.path, (DATA_FILE, LOCK_FILE), *files_mode(config), "lmdb.group")
    except BaseException:
        env.close()
        raise
    return env


def walk(env: lmdb.Environment, dbs: Sequence[lmdb._Database]) -> None:
    """Read every branch and leaf page of ``dbs`` (values are verified when read)."""
    with env.begin() as txn:
        for db in dbs:
            for _ in txn.cursor(db=db).iternext(keys=True, values=False):
                pass


def open_environment(
    config: LMDBConfig, map_size: int, load: Callable[[lmdb.Environment], None]
) -> lmdb.Environment:
    """Open the environment, check its file covers its pages and have ``load`` read it through
    (raising `Unreadable`, with nothing left open, when it cannot); then, for ``fast`` with
    ``preallocate`` and where the file can be preallocated to the whole map, reopen it to write
    through the map. The
    caller opens its databases again on what this returns."""
    env = _open_checked(config, map_size, writemap=False)
    try:
        check_size(env, config.path / DATA_FILE)
        stale = env.reader_check()
        if stale:
            log.info("lmdb: cleared %d stale reader slots", stale)
        load(env)
    except (*UNREADABLE_ERRORS, struct.error, UnicodeDecodeError) as exc:  # pages or entries
        env.close()
        raise Unreadable(f"{type(exc).__name__}: {exc}") from exc
    except BaseException:
        env.close()
        raise
    if config.durability is not Durability.FAST or not config.preallocate:
        return env
    why = preallocate(config.path / DATA_FILE, env.info()["map_size"])
    if why is not None:
        log.warning(
            "lmdb %s: writes are staged in LMDB's own buffers, not written through the map: "
            "cannot preallocate it (%s)",
            config.path,
            why,
        )
        return env
    env.close()
    return _open_checked(config, map_size, writemap=True)


def open_or_set_aside(
    config: LMDBConfig, map_size: int, load: Callable[[lmdb.Environment], None]
) -> tuple[lmdb.Environment, Path | None]:
    """`open_environment`; an environment that LMDB refuses, whose file is shorter than its
    pages, or whose trees cannot be walked is moved aside (renamed, timestamped) and a fresh
    one opened: a cache that lost its contents still serves, where one that cannot open stops
    the process. Returns the environment and where an unreadable one went."""
    try:
        return open_environment(config, map_size, load), None
    except Unreadable as exc:
        aside = move_aside(config.path, str(exc))
    try:
        return open_environment(config, map_size, load), aside
    except Unreadable as again:
        raise ConfigError("lmdb.path", f"cannot open LMDB at {config.path}: {again}") from again


def adopt_map_size(env: lmdb.Environment, data: Path) -> str | None:
    """Adopt the map size another process set; a map written through is preallocated to its
    new size. Returns why that failed, logged, else None."""
    old = env.info()["map_size"]
    env.set_mapsize(0)
    size = env.info()["map_size"]
    if not env.flags()["writemap"] or size <= old:
        return None
    why = preallocate(data, size)
    if why is not None:
        log.error("lmdb: the grown map is not preallocated, a full disk can stop it (%s)", why)
    return why


def stored_keys_read_only(path: Path, namespace: bytes) -> list[ChunkKey]:
    """The keys of ``namespace`` stored in the environment at ``path``, read beside the process
    that writes it (kvtierd): LMDB admits readers beside its writer, and nothing is written."""
    env = lmdb.open(str(path), readonly=True, max_dbs=len(DATABASES), lock=True, subdir=True)
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin(db=meta) as txn:
            cursor = txn.cursor()
            keys: list[ChunkKey] = []
            if not cursor.set_range(namespace):
                return keys
            for key in cursor.iternext(keys=True, values=False):
                if not bytes(key).startswith(namespace):
                    break
                keys.append(ChunkKey(bytes(key)))
            return keys
    finally:
        env.close()
