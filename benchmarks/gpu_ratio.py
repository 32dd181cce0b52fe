"""Recompute against load, per token, measured here and on a GPU node.

A hit is worth loading when loading its tokens is faster than recomputing them. On a GPU node
(benchmarks/fleet_costs.py: Llama-3.1-8B bf16 on an H100) recomputing a token costs about 16
times what loading its KV from the arena costs, 1.3 times what reading it from NVMe lmdb costs,
and less than a load from the object store. The GPU-ratio model (tests/fixtures/models.py) is
shaped so that this machine's ratios land near the GPU's; this module measures them in the run:

- recompute: the engine's prefill time (vLLM's ``vllm:request_prefill_time_seconds``) of
  prompts no cache holds, at two lengths, one request at a time; the time per token is the
  difference over the difference in tokens (what a hit of the longer prompt's extra tokens
  saves), from the median of each length.
- arena: CpuTier lease, copy of each chunk into a buffer, release.
- lmdb: LmdbTier.read_into (checksum verified) of chunks written earlier, after the
  environment was closed, its file synced and its pages dropped from the page cache
  (``/proc/sys/vm/drop_caches``, or ``posix_fadvise(DONTNEED)`` on the data file where that
  cannot be written): a read from the disk, as on a node whose page cache holds other data.
  Read at the disk bandwidth ``node_scaled_disk`` gives (a blkio cgroup,
  benchmarks/harness/disk_throttle.py): a disk that reads nearly at memory speed would make
  lmdb as cheap as the arena, which no GPU node's NVMe is. The throttle lets a slice's bytes
  through at the disk's speed after an idle slice, so the cold load reads ``HELD_SLICES``
  slices' bytes at least, however few the arena's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import tempfile
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.fleet_costs import GPU_FIGURES, gpu_node
from benchmarks.harness.buffers import filled, timed, touched
from benchmarks.harness.disk_throttle import SLICE_S, DiskThrottle, ThrottleUnavailable
from benchmarks.harness.sizes import MiB, extent_for
from benchmarks.harness.specs import spec_for_chunk
from kvtier.core.config import ArenaConfig, LMDBConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.fixtures.keys import keys_for

PREFILL_TIME = "vllm:request_prefill_time_seconds"
GPU_WINDOW = 2.0
"""A ratio measured here counts as the GPU's when it lies within this factor of it."""
THROTTLED = "gpu-ratio"
"""The name this benchmark's blkio cgroups start with."""
HELD_SLICES = 10
"""The throttled cold lmdb load lasts this many of the throttle's slices at least: what passes
unheld (a slice's bytes after idling, up to one more as the kernel rounds up to whole slices)
is then a small share of it (held to 1.1-1.25x of the bandwidth, against 2.4x on 64 MiB)."""


def gpu_ratios(chunk_tokens: int = 256) -> dict[str, float]:
    """Recompute time over load time per token on the GPU node, by tier."""
    node = gpu_node(chunk_tokens)
    recompute = node.prefill_s_per_token * chunk_tokens
    return {tier: recompute / node.load_s(tier, 1) for tier in ("cpu", "lmdb", "object")}


@dataclass(frozen=True)
class DiskBandwidth:
    """A read bandwidth for lmdb's disk, and how it was derived (or, at 0, why none was)."""

    bytes_per_s: int
    how: str


def node_scaled_disk(prefill_s_per_token: float, kv_bytes_per_token: int) -> DiskBandwidth:
    """The bandwidth at which this machine's disk stands to its compute as a GPU node's NVMe
    stands to its H100: reading a token's KV takes the same share of prefilling it. The NVMe's
    bandwidth scaled by the KV bytes a token here over there and by the GPU's prefill time a
    token over this machine's. lmdb's read-in past the KV (``lmdb_read_in_vs_prompt_kv``,
    which the GPU node's load time carries) is not applied: the reads here pay it themselves."""
    nvme = GPU_FIGURES["nvme_bytes_per_s"][0]
    gpu_kv = GPU_FIGURES["kv_bytes_per_token"][0]
    gpu_prefill = gpu_node().prefill_s_per_token
    if prefill_s_per_token <= 0:
        return DiskBandwidth(0, f"a prefill time of {prefill_s_per_token:.3g} s a token")
    bytes_per_s = nvme * (kv_bytes_per_token / gpu_kv) * (gpu_prefill / prefill_s_per_token)
    how = (
        f"NVMe {nvme / 1e9:.1f} GB/s x {kv_bytes_per_token:,} / {gpu_kv:,.0f} bytes of KV a "
        f"token x {gpu_prefill * 1e6:.1f} / {prefill_s_per_token * 1e6:.1f} us of prefill a "
        "token (GPU node / here)"
    )
    return DiskBandwidth(round(bytes_per_s), how)


@contextlib.contextmanager
def reads_throttled(path: Path, disk: DiskBandwidth | None, pids: Sequence[int]) -> Iterator[str]:
    """While entered, processes ``pids`` read the disk under ``path`` at ``disk``'s bandwidth;
    yields what was done, "not throttled: <why>" where it could not be."""
    if disk is None or disk.bytes_per_s <= 0:
        why = disk.how if disk is not None else "no prefill time measured to scale the disk to"
        yield f"not throttled: {why}"
        return
    with contextlib.ExitStack() as stack:
        try:
            throttle = stack.enter_context(DiskThrottle(THROTTLED, path, disk.bytes_per_s))
            for pid in pids:
                throttle.place(pid)
            said = f"{throttle.describe()}: {disk.how}"
        except (ThrottleUnavailable, OSError) as exc:
            stack.close()
            said = f"not throttled: {exc}"
        yield said


@dataclass(frozen=True)
class LoadCosts:
    """Seconds per token of KV, by tier, how lmdb's pages left the page cache and at what
    bandwidth its disk read them."""

    arena_s_per_token: float
    lmdb_cold_s_per_token: float
    dropped_by: str
    lmdb_disk: str = ""


def drop_page_cache(data_file: Path) -> str:
    """Evicts ``data_file``'s clean pages (it must be synced and mapped by no one); says how."""
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        fd = os.open(data_file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "fadvise"


class PageCacheDropper:
    """While entered, syncs and drops the page cache every ``interval_s`` (a thread): a tier
    below the arena then reads from the disk what was written a moment before, as a node whose
    page cache holds other data would. Pages a process keeps mapped stay; ``drops`` counts."""

    def __init__(self, data_file: Path, interval_s: float = 2.0) -> None:
        self.data_file = data_file
        self.interval_s = interval_s
        self.drops = 0
        self.dropped_by = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="page-cache-dropper", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            os.sync()  # only clean pages drop
            if self.data_file.exists():
                self.dropped_by = drop_page_cache(self.data_file)
                self.drops += 1

    def __enter__(self) -> PageCacheDropper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def cold_load_bytes(total_bytes: int, disk: DiskBandwidth | None) -> int:
    """What the cold lmdb load reads: ``total_bytes``, or ``HELD_SLICES`` slices at ``disk``'s
    bandwidth where that is more."""
    if disk is None or disk.bytes_per_s <= 0:
        return total_bytes
    return max(total_bytes, round(disk.bytes_per_s * SLICE_S * HELD_SLICES))


Chunks = list[tuple[memoryview, memoryview]]
"""Each chunk's bytes to store and where its load goes."""


@dataclass(frozen=True)
class _Chunks:
    """``total_bytes`` of chunks of ``chunk_tokens`` tokens: each one's bytes to store, where
    its load goes, and its key."""

    registry: PoolRegistry
    namespace: int
    chunks: Chunks
    chunk_tokens: int

    @classmethod
    def of(cls, kv_bytes_per_token: int, chunk_tokens: int, total_bytes: int) -> _Chunks:
        chunk = kv_bytes_per_token * chunk_tokens
        n = max(1, total_bytes // chunk)
        registry = PoolRegistry()
        namespace = registry.register(spec_for_chunk("gpu-ratio", chunk), chunk).namespace
        src, dst = memoryview(filled(n * chunk)), memoryview(touched(n * chunk))
        spans = [slice(i * chunk, (i + 1) * chunk) for i in range(n)]
        return cls(registry, namespace, [(src[span], dst[span]) for span in spans], chunk_tokens)

    def keys(self, n: int | None = None) -> list[ChunkKey]:
        return keys_for(self.namespace, len(self.chunks) if n is None else n)

    def tokens(self) -> int:
        return len(self.chunks) * self.chunk_tokens


def measure_arena_load(
    kv_bytes_per_token: int, chunk_tokens: int, *, total_bytes: int = 64 * MiB, reps: int = 3
) -> float:
    """Seconds a token, the median over ``reps`` of loading ``total_bytes`` of chunks of
    ``chunk_tokens`` tokens from the arena."""
    made = _Chunks.of(kv_bytes_per_token, chunk_tokens, total_bytes)
    return _arena_load_s(made.registry, made.keys(), made.chunks, reps) / made.tokens()


def measure_loads(
    kv_bytes_per_token: int,
    chunk_tokens: int,
    *,
    total_bytes: int = 64 * MiB,
    reps: int = 3,
    disk: DiskBandwidth | None = None,
) -> LoadCosts:
    """The median over ``reps`` of loading ``total_bytes`` of chunks of ``chunk_tokens``
    tokens from the arena and, with its pages dropped, ``cold_load_bytes`` from lmdb on a disk
    read at ``disk``'s bandwidth (this process throttled while it reads)."""
    made = _Chunks.of(kv_bytes_per_token, chunk_tokens, total_bytes)
    n, chunk = len(made.chunks), kv_bytes_per_token * chunk_tokens
    # more chunks for lmdb where the disk needs them, on the same buffers over again
    cold_n = max(n, -(-cold_load_bytes(total_bytes, disk) // chunk))
    cold_chunks = [made.chunks[i % n] for i in range(cold_n)]
    root = Path(tempfile.mkdtemp(prefix="kvtier-gpu-ratio-"))
    try:
        arena_s = _arena_load_s(made.registry, made.keys(), made.chunks, reps)
        with reads_throttled(root, disk, [os.getpid()]) as lmdb_disk:
            lmdb_s, dropped_by = _lmdb_cold_load_s(
                root, made.registry, made.keys(cold_n), cold_chunks, reps
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    arena_token_s, lmdb_token_s = arena_s / made.tokens(), lmdb_s / (cold_n * chunk_tokens)
    return LoadCosts(arena_token_s, lmdb_token_s, dropped_by, lmdb_disk)


def _arena_load_s(registry: PoolRegistry, keys: list[ChunkKey], chunks: Chunks, reps: int) -> float:
    chunk = len(chunks[0][0])
    extent = extent_for(chunk)
    shm = Path(f"/dev/shm/kvtier-gpu-ratio-{os.getpid()}")
    size = len(chunks) * chunk + 2 * extent
    arena = CpuTier(ArenaConfig(path=shm, size_bytes=size, extent_bytes=extent), registry)
    try:
        refs = [ref for ref in arena.reserve(keys) if ref is not None]
        if len(refs) != len(keys):
            raise RuntimeError("the arena is sized to hold every chunk")
        for ref, (data, _) in zip(refs, chunks, strict=True):
            arena.view(ref)[:] = data
        arena.commit(refs)

        def load() -> None:
            leased = [ref for ref in arena.lease(keys) if ref is not None]
            for ref, (_, out) in zip(leased, chunks, strict=True):
                out[:] = arena.view(ref)
            arena.release(leased)

        load()  # untimed: the destination's pages and the arena's extents warm
        _check(chunks, "the arena")
        return statistics.median(timed(load) for _ in range(reps))
    finally:
        arena.close()
        shm.unlink(missing_ok=True)


def _lmdb_cold_load_s(
    root: Path, registry: PoolRegistry, keys: list[ChunkKey], chunks: Chunks, reps: int
) -> tuple[float, str]:
    budget = 2 * len(chunks) * len(chunks[0][0]) + 64 * MiB
    config = LMDBConfig(path=root / "lmdb", budget_bytes=budget)
    writer = LmdbTier(config, registry)
    try:
        items = [(key, data) for key, (data, _) in zip(keys, chunks, strict=True)]
        for first in range(0, len(items), 8):
            if not all(writer.put_many(items[first : first + 8])):
                raise RuntimeError("lmdb rejected a chunk; its budget holds them all")
    finally:
        writer.close()

    def load(reader: LmdbTier) -> None:
        for key, (_, out) in zip(keys, chunks, strict=True):
            if not reader.read_into(key, out):
                raise RuntimeError("lmdb missed a chunk it holds")

    samples, dropped_by = [], ""
    for _ in range(reps):
        # closed (unmapped) and synced first: the kernel drops only clean, unmapped pages
        os.sync()
        drop_page_cache(config.path / "data.mdb")
        reader = LmdbTier(config, registry)
        try:
            # opening walks the file (what it reads ahead stays cached): dropped again, all
            # but the pages the reader keeps mapped, so that the loads read the disk
            dropped_by = drop_page_cache(config.path / "data.mdb")
            # each buffer once (chunks may share one): a load must write it back
            for out in {id(out): out for _, out in chunks}.values():
                out[:1] = b"\xff" if out[0] != 0xFF else b"\x00"
            samples.append(timed(lambda: load(reader)))  # noqa: B023 (called at once)
        finally:
            reader.close()
        _check(chunks, "lmdb")
    return statistics.median(samples), dropped_by


def _check(chunks: Chunks, tier: str) -> None:
    if any(data != out for data, out in chunks):
        raise RuntimeError(f"{tier} loaded other bytes than were stored")


def _prefill_seconds(url: str) -> tuple[float, float]:
    """The engine's prefill-time histogram: its sum and count."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{PREFILL_TIME}_sum":
                total += sample.value
            elif sample.name == f"{PREFILL_TIME}_count":
                count += sample.value
    return total, count


def _complete(url: str, model: str, prompt: list[int]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        r.read()


def measure_prefill(url: str, model: str, prompts: dict[int, list[list[int]]]) -> dict[str, float]:
    """The engine's prefill seconds per token from ``prompts`` by length (two lengths, prompts
    no cache holds), sent one at a time; each length's first prompt is left out (warm-up)."""
    medians: dict[int, float] = {}
    for length, batch in sorted(prompts.items()):
        times = []
        for i, prompt in enumerate(batch):
            before = _prefill_seconds(url)
            _complete(url, model, prompt)
            after = _prefill_seconds(url)
            if after[1] != before[1] + 1:
                raise RuntimeError(f"the engine counted {after[1] - before[1]} prefills for one")
            if i:
                times.append(after[0] - before[0])
        medians[length] = statistics.median(times)
    short, long = sorted(medians)
    return {
        "prefill_s_per_token": (medians[long] - medians[short]) / (long - short),
        "prefill_s_short": medians[short],
        "prefill_s_long": medians[long],
        "short_tokens": short,
        "long_tokens": long,
    }


def ratios(prefill_s_per_token: float, loads: LoadCosts, chunk_tokens: int) -> dict[str, Any]:
    """This machine's ratios beside the GPU node's, and whether each lies within
    ``GPU_WINDOW`` of it (the object store's is not shaped: reported only)."""
    here = {
        "cpu": prefill_s_per_token / loads.arena_s_per_token,
        "lmdb": prefill_s_per_token / loads.lmdb_cold_s_per_token,
    }
    gpu = gpu_ratios(chunk_tokens)
    return {
        "recompute_vs_load_here": here,
        "recompute_vs_load_gpu": gpu,
        "within_gpu_window": {
            tier: gpu[tier] / GPU_WINDOW <= value <= gpu[tier] * GPU_WINDOW
            for tier, value in here.items()
        },
        "prefill_s_per_token": prefill_s_per_token,
        "loads": asdict(loads),
    }
