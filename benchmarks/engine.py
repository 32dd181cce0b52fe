"""What the engine benchmarks share (``ttft.py`` and its hybrid case ``hybrid_ttft.py``):
kvtierd in a subprocess, timed cases and their samples, page-cache probes, arena sizing, and
`EngineBench`, what a case run outside ``ttft.py`` needs of its bench."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from benchmarks.kvtierd import STOP_TIMEOUT_S, KvtierdProcess
from kvtier.rpc import AdminClient

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("kvtier.bench")

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
LMDB_BUDGET = 3 * GiB
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


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


# -- kvtierd ----------------------------------------------------------------------------------


class Kvtierd(KvtierdProcess):
    """kvtierd with an arena and lmdb sized for an engine benchmark, and its admin client."""

    def __init__(self, root: Path, shm: Path, arena_bytes: int, extent_bytes: int) -> None:
        self.shm = shm
        self.socket_dir = root
        if len(str(root / "kvtierd.sock")) > MAX_SOCKET_PATH:
            self.socket_dir = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
        self.socket_path = self.socket_dir / "kvtierd.sock"
        self.lmdb_path = root / "lmdb"
        config = {
            "arena": {
                "path": str(shm),
                "size_bytes": arena_bytes,
                "extent_bytes": extent_bytes,
                "min_slot_bytes": 64 * KiB,
            },
            "lmdb": {"path": str(self.lmdb_path), "budget_bytes": LMDB_BUDGET},
            "server": {
                "socket_path": str(self.socket_path),
                "admin_address": "127.0.0.1:0",
                "metrics_address": "127.0.0.1:0",
            },
        }
        super().__init__(root, config)
        self.admin: AdminClient | None = None

    def start(self) -> None:
        super().start()
        self.admin = self.admin_client(timeout_s=STOP_TIMEOUT_S)

    def counters(self) -> dict[str, int]:
        """The manager's counters, and each tier's as ``<tier>.<name>``."""
        assert self.admin is not None
        stats = self.admin.stats()
        out = {k: int(v) for k, v in stats.counters.items()}
        for tier in stats.tiers:
            out.update({f"{tier.tier}.{k}": int(v) for k, v in tier.counters.items()})
        return out

    def stop(self) -> None:
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        stopping = self.proc is not None and self.exit_code is None
        super().stop()
        if stopping:
            self.shm.unlink(missing_ok=True)
            if self.socket_dir != self.root:
                shutil.rmtree(self.socket_dir, ignore_errors=True)


def delta(after: dict[str, int], before: dict[str, int], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


# -- cases ------------------------------------------------------------------------------------


@dataclass
class Sample:
    ms: float
    cached: int
    external: int
    token: int


@dataclass
class Case:
    name: str
    expected: int
    """num_cached_tokens a full hit gives (0 for a cold case)."""
    connector: bool = False
    """Whether the hit must come from a connector (vLLM counts it as external)."""
    samples: list[Sample] = field(default_factory=list)
    resident: list[float] = field(default_factory=list)
    """Share of the backing files in the page cache right before each timed prompt."""
    read_in: list[int] = field(default_factory=list)
    """Bytes of the backing files the timed prompt brought into the page cache."""
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return median([s.ms for s in self.samples])

    @property
    def hits_ok(self) -> bool:
        if self.expected == 0:
            return all(s.cached == 0 for s in self.samples)
        external = self.expected if self.connector else 0
        return all(
            s.cached >= self.expected and (s.external >= external if external else not s.external)
            for s in self.samples
        )

    def summary(self, cold_tokens: Sequence[int] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ttft_ms": self.ms,
            "ttft_ms_each": [round(s.ms, 2) for s in self.samples],
            "cached_tokens": [s.cached for s in self.samples],
            "external_hit_tokens": [s.external for s in self.samples],
            "expected_cached_tokens": self.expected,
            "hits_ok": self.hits_ok,
        }
        if cold_tokens:
            n = len(cold_tokens)
            same = sum(s.token == cold_tokens[i % n] for i, s in enumerate(self.samples))
            out["first_token_same_as_cold"] = f"{same}/{len(self.samples)}"
        if self.resident:
            out["resident_before_load"] = [round(r, 4) for r in self.resident]
            out["read_in_bytes"] = self.read_in
        if self.counters:
            out["kvtierd_counters"] = self.counters
        return out


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def extent_for(chunk_bytes: int) -> int:
    """The arena's allocation unit: 32 MiB, or the next power of two that holds a chunk."""
    extent = 32 * MiB
    while extent < chunk_bytes:
        extent *= 2
    return extent


class EngineBench(Protocol):
    """The parts of ``ttft.py``'s bench a case module drives (structural, so neither imports
    the other)."""

    cache_dir: Path
    tokenizer: Path
    root: Path
    block_size: int
    warmup: list[int]
    prompts: list[list[int]]

    def full_hit(self, tokens_per_chunk: int) -> int: ...

    def engine(
        self,
        connector: dict[str, Any] | None = None,
        *,
        model: Path | None = None,
        dtype: str = "bfloat16",
    ) -> AbstractContextManager[Any]: ...

    def first_token(self, llm: Any, prompt: Sequence[int]) -> Sample: ...

    def rounds(self, llm: Any) -> Iterator[int]: ...

    def compute(self, llm: Any, prompts: Sequence[Sequence[int]]) -> None: ...

    def shm(self, name: str) -> Path: ...

    def sidecar(self, daemon: Kvtierd, bpc: int) -> dict[str, Any]: ...
