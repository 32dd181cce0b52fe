"""The machine under a benchmark: the page cache (dropping a file from it, how much of a file it
holds, a cold read's time), CPU time (the machine's, a process's, other processes' share of a
run), the file system a path is on, and an ended run's arena files."""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.sizes import MiB
from benchmarks.harness.stats import median
from kvtier.tiers.commit_checksums import ledger_path

# -- page cache -------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_READ = 1
_MAP_SHARED = 1
PAGE = os.sysconf("SC_PAGE_SIZE")


def drop_page_cache(paths: Sequence[Path]) -> None:
    """Write each file's dirty pages, then ask the kernel to drop its cached ones."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_pages(path: Path) -> tuple[int, int]:
    """(pages of the file in the page cache, pages of the file), by mincore on a fresh mapping;
    mapping without touching faults nothing in."""
    size = path.stat().st_size
    pages = (size + PAGE - 1) // PAGE
    if pages == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(v & 1 for v in vec), pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident(paths: Sequence[Path]) -> tuple[int, int]:
    """(pages in the page cache, pages) over ``paths``."""
    counts = [resident_pages(p) for p in paths]
    return sum(r for r, _ in counts), sum(n for _, n in counts)


def cold_read_ms(path: Path, nbytes: int, reps: int = 3) -> float:
    """Median time to read ``nbytes`` from a new file on ``path``'s file system, dropped from the
    page cache before each read: what any cold load of that much data pays at least."""
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
    buf = bytearray(MiB)
    times = []
    try:
        for _ in range(reps):
            drop_page_cache([path])
            start = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        path.unlink()
    return median(times)


def busy_cpu_seconds() -> float:
    """CPU time the whole machine has spent busy since boot (/proc/stat), all CPUs together."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9]
        )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int | None) -> list[int]:
    """``pid`` and every live descendant of it (/proc), parents first; none for ``None``."""
    if pid is None:
        return []
    tree, i = [pid], 0
    while i < len(tree):
        for task in Path(f"/proc/{tree[i]}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # the task ended meanwhile
                tree += [int(child) for child in task.read_text().split()]
        i += 1
    return tree


def process_cpu_seconds(pid: int) -> float:
    """CPU time process ``pid`` has used, all its threads, user and system (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(
    share: float = 0.1, window_s: float = 1.0, timeout_s: float = 60.0
) -> float | None:
    """Wait until the machine's busy share over ``window_s`` falls below ``share`` (work left
    in the background, such as a write-back, is done); the seconds waited, None past
    ``timeout_s``."""
    cpus = os.cpu_count() or 1
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        before = busy_cpu_seconds()
        time.sleep(window_s)
        if (busy_cpu_seconds() - before) / (window_s * cpus) < share:
            return time.perf_counter() - started
    return None


class CpuShare:
    """CPU time other processes used while a run went on, over the machine's capacity."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        busy = busy_cpu_seconds()
        own = os.times()
        # kvtierd is a child: counted once it has been waited for
        mine = own.user + own.system + own.children_user + own.children_system
        return time.perf_counter(), busy, mine

    def others(self) -> float:
        wall, busy, mine = (b - a for a, b in zip(self.start, self._sample(), strict=True))
        cpus = os.cpu_count() or 1
        return max(0.0, busy - mine) / (wall * cpus)


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path``."""
    best, kind = "", "unknown"
    target = str(path.resolve())
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1]
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


def remove_arena(path: Path) -> None:
    """Remove an arena whose owner has ended, and the commit checksums kept beside it (an
    engine stopped without closing its embedded arena leaves both)."""
    path.unlink(missing_ok=True)
    ledger_path(path).unlink(missing_ok=True)
