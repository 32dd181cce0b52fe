"""Throughput of the arena and LMDB tiers, against this machine's own limits measured in the run.

Usage: ``python -m benchmarks.tiers [--quick] [--json] [--durability] [--preallocate]``

GB/s is 1e9 payload bytes per second. Chunks are 1, 2 and 4 MiB over a working set (256 MiB,
128 MiB with ``--quick``) well above the last-level cache. Every figure is the median of several
repetitions after one untimed warm-up repetition; each ratio is the median of per-repetition
ratios whose denominator was timed right before its numerator, and the headline ratio is the
geometric mean over chunk sizes.

- ``memcpy_gbps``: copy the working set chunk by chunk between two numpy buffers.
- ``arena_store_gbps``: CpuTier reserve (8 keys per call), copy each chunk from the source buffer
  into ``cpu.view(ref)``, commit.
- ``arena_load_gbps``: CpuTier lease, copy each ``cpu.view(ref)`` into a destination buffer,
  release.
- ``disk_write_gbps``: write the working set, one write per chunk, to a new file in the directory
  that holds the LMDB environments; no fsync; includes open and close.
- ``lmdb_write_gbps``: LmdbTier.put_many, 8 chunks per transaction, into a fresh environment
  (a new data.mdb, so like with like against the new file), durability fast, the default
  ``lmdb.preallocate: false``: each chunk is copied (and hashed) into one reused buffer, LMDB
  stages its pages in its own buffers and writes them to the file at commit, three copies in
  all. With ``--preallocate`` (``lmdb.preallocate: true``) the file is preallocated to the map
  size when the tier opens, before the timing, and writes go through LMDB's shared map: two
  copies. The consistent and full settings of ``--durability`` always stage.
- ``disk_overwrite_gbps``: the same writes over the existing file.
- ``lmdb_write_steady_gbps``: put_many into the same environment after its previous chunks were
  deleted, so LMDB reuses freed pages; compared with ``disk_overwrite_gbps``.
- ``lmdb_hot_read_gbps``: LmdbTier.read_into (checksum verified) into a destination buffer, with
  the environment in the page cache and already mapped.
- ``verify_gbps``: kvtier.core.blockfmt.decode (header and payload checksum) over encoded chunks.
- ``lookup_8192_keys_us``: TierManager.lookup (arena and LMDB enabled) of 8192 keys all in the
  arena; ``lookup_8192_keys_arena_only_us`` is the same with LMDB disabled.

``--durability`` measures only what each ``lmdb.durability`` costs on fresh-environment writes:
``lmdb_write_<setting>_gbps`` for fast, consistent and full, against ``disk_write_gbps`` and
``disk_write_synced_gbps`` (the same writes with an fdatasync after every 8 chunks, what a synced
commit costs the raw disk), each ratio paired with the baseline timed right before it.

LMDB's background sync interval is set long enough that no fsync falls inside a timed write,
as in the disk baseline. On a fresh VM the first touch of memory can run at a fraction of its
later speed (pages backed lazily by the host); the warm-up repetition absorbs most of that.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.buffers import filled, no_gc, touched
from benchmarks.harness.cli import emit, log_progress
from benchmarks.harness.sizes import MiB
from benchmarks.harness.specs import sixteen_layer_spec, small_spec
from benchmarks.harness.stats import Samples, geomean
from benchmarks.tiers_report import durability_table, result_of, table
from benchmarks.tiers_settings import (
    BATCH,
    CHUNK_SIZES,
    EXTENT,
    FULL,
    LOOKUP_CHUNK,
    LOOKUP_KEYS,
    QUICK,
    SYNC_INTERVAL_S,
    Mode,
)
from kvtier.core import blockfmt
from kvtier.core.config import ArenaConfig, Durability, LMDBConfig, from_mapping
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry, Registration
from kvtier.tiering.manager import TierManager
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.fixtures.keys import keys_for

log = logging.getLogger("kvtier.bench")


def gbps(nbytes: int, fn: Callable[[], object]) -> float:
    with no_gc():
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
    return nbytes / elapsed / 1e9


class Bench:
    def __init__(self, mode: Mode, preallocate: bool = False) -> None:
        self.mode = mode
        self.preallocate = preallocate
        self.total = mode.working_set
        self.root = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
        self.shm = Path(f"/dev/shm/kvtier-bench-{os.getpid()}")
        try:
            self.src = filled(self.total)
            self.dst = touched(self.total)
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        self.src_mv = memoryview(self.src)
        self.dst_mv = memoryview(self.dst)
        self.registry = PoolRegistry()
        self.regs = {
            c: self.registry.register(sixteen_layer_spec(f"bench-{c}", c), c) for c in CHUNK_SIZES
        }
        self.samples = {c: Samples() for c in CHUNK_SIZES}
        self.cpu: CpuTier | None = None
        self.env_bytes: dict[int, int] = {}

    # -- baselines ------------------------------------------------------------------------

    def memcpy(self, chunk: int) -> float:
        src, dst, total = self.src_mv, self.dst_mv, self.total

        def run() -> None:
            for off in range(0, total, chunk):
                dst[off : off + chunk] = src[off : off + chunk]

        return gbps(total, run)

    def disk_write(self, path: Path, chunk: int, overwrite: bool, synced: bool = False) -> float:
        src, total = self.src_mv, self.total
        every = BATCH * chunk

        def run() -> None:
            with open(path, "r+b" if overwrite else "xb", buffering=0) as f:
                for off in range(0, total, chunk):
                    f.write(src[off : off + chunk])
                    if synced and (off + chunk) % every == 0:
                        os.fdatasync(f.fileno())

        return gbps(total, run)

    # -- arena ----------------------------------------------------------------------------

    def open_arena(self) -> CpuTier:
        # every chunk size keeps its own extents, so the arena holds one working set per size
        size = len(CHUNK_SIZES) * self.total + 2 * EXTENT
        config = ArenaConfig(path=self.shm, size_bytes=size, extent_bytes=EXTENT)
        self.cpu = CpuTier(config, self.registry)
        return self.cpu

    def arena_store(self, cpu: CpuTier, keys: list[ChunkKey], chunk: int) -> float:
        src = self.src_mv

        def run() -> None:
            for first in range(0, len(keys), BATCH):
                refs = cpu.reserve(keys[first : first + BATCH])
                off = first * chunk
                for ref in refs:
                    assert ref is not None
                    cpu.view(ref)[:] = src[off : off + chunk]
                    off += chunk
                cpu.commit(refs)  # type: ignore[arg-type]

        return gbps(self.total, run)

    def arena_load(self, cpu: CpuTier, keys: list[ChunkKey], chunk: int) -> float:
        dst = self.dst_mv

        def run() -> None:
            for first in range(0, len(keys), BATCH):
                refs = cpu.lease(keys[first : first + BATCH])
                off = first * chunk
                for ref in refs:
                    assert ref is not None
                    dst[off : off + chunk] = cpu.view(ref)
                    off += chunk
                cpu.release(refs)  # type: ignore[arg-type]

        return gbps(self.total, run)

    def run_arena(self, chunk: int) -> None:
        cpu = self.cpu or self.open_arena()
        reg = self.regs[chunk]
        keys = keys_for(reg.namespace, self.total // chunk)
        s = self.samples[chunk]
        for rep in range(self.mode.reps + 1):
            base = self.memcpy(chunk)
            store = self.arena_store(cpu, keys, chunk)
            base_load = self.memcpy(chunk)
            if rep == 0:
                self.dst.fill(0)
            load = self.arena_load(cpu, keys, chunk)
            if rep == 0 and not np.array_equal(self.dst, self.src):
                raise RuntimeError("arena load returned other bytes than were stored")
            if cpu.delete(keys) != len(keys):
                raise RuntimeError("arena still holds leased chunks")
            if rep == 0:
                continue  # warm-up: extents assigned, memory faulted in
            s.add("memcpy_gbps", base)
            s.add("memcpy_gbps", base_load)
            s.add("arena_store_gbps", store)
            s.add("arena_load_gbps", load)
            s.ratio("arena_store_vs_memcpy", store / base)
            s.ratio("arena_load_vs_memcpy", load / base_load)

    # -- lmdb -----------------------------------------------------------------------------

    def open_lmdb(self, path: Path, durability: Durability = Durability.FAST) -> LmdbTier:
        config = LMDBConfig(
            path=path,
            budget_bytes=2 * self.total + 64 * MiB,
            sync_interval_s=SYNC_INTERVAL_S,
            durability=durability,
            preallocate=self.preallocate,
        )
        return LmdbTier(config, self.registry)

    def lmdb_write(self, tier: LmdbTier, keys: list[ChunkKey], chunk: int) -> float:
        src = self.src_mv

        def run() -> None:
            for first in range(0, len(keys), BATCH):
                items = [
                    (key, src[(first + i) * chunk : (first + i + 1) * chunk])
                    for i, key in enumerate(keys[first : first + BATCH])
                ]
                if not all(tier.put_many(items)):
                    raise RuntimeError("lmdb rejected a chunk; raise its budget")

        return gbps(self.total, run)

    def lmdb_read(self, tier: LmdbTier, keys: list[ChunkKey], chunk: int) -> float:
        dst = self.dst_mv

        def run() -> None:
            off = 0
            for key in keys:
                if not tier.read_into(key, dst[off : off + chunk]):
                    raise RuntimeError("lmdb missed a chunk it holds")
                off += chunk

        return gbps(self.total, run)

    def run_lmdb(self, chunk: int) -> None:
        reg = self.regs[chunk]
        n = self.total // chunk
        first_keys = keys_for(reg.namespace, n)
        second_keys = keys_for(reg.namespace, n, start=n)
        s = self.samples[chunk]
        for rep in range(self.mode.reps + 1):
            file = self.root / f"disk-{chunk}-{rep}"
            env = self.root / f"env-{chunk}-{rep}"
            tier = self.open_lmdb(env)
            try:
                disk = self.disk_write(file, chunk, overwrite=False)
                fresh = self.lmdb_write(tier, first_keys, chunk)
                if tier.delete(first_keys) != n:
                    raise RuntimeError("lmdb did not drop every chunk")
                disk_over = self.disk_write(file, chunk, overwrite=True)
                steady = self.lmdb_write(tier, second_keys, chunk)
                file.unlink()
                if rep == 0:
                    self.dst.fill(0)
                self.lmdb_read(tier, second_keys, chunk)  # maps the pages
                if rep == 0 and not np.array_equal(self.dst, self.src):
                    raise RuntimeError("lmdb read returned other bytes than were stored")
                base = self.memcpy(chunk)
                read = self.lmdb_read(tier, second_keys, chunk)
                # pages LMDB uses: a preallocated file has the whole map's length
                grown = (tier.env.info()["last_pgno"] + 1) * tier.env.stat()["psize"]
            finally:
                tier.close()
                shutil.rmtree(env, ignore_errors=True)
            self.env_bytes[chunk] = grown
            if rep == 0:
                continue
            s.add("disk_write_gbps", disk)
            s.add("lmdb_write_gbps", fresh)
            s.add("disk_overwrite_gbps", disk_over)
            s.add("lmdb_write_steady_gbps", steady)
            s.add("memcpy_gbps", base)
            s.add("lmdb_hot_read_gbps", read)
            s.ratio("lmdb_write_vs_disk", fresh / disk)
            s.ratio("lmdb_write_steady_vs_disk_overwrite", steady / disk_over)
            s.ratio("lmdb_hot_read_vs_memcpy", read / base)

    def run_durability(self, chunk: int) -> None:
        keys = keys_for(self.regs[chunk].namespace, self.total // chunk)
        s = self.samples[chunk]
        for rep in range(self.mode.reps + 1):
            for setting in Durability:
                file = self.root / f"disk-{chunk}-{rep}-{setting}"
                env = self.root / f"env-{chunk}-{rep}-{setting}"
                synced = setting is not Durability.FAST
                tier = self.open_lmdb(env, setting)
                try:
                    disk = self.disk_write(file, chunk, overwrite=False, synced=synced)
                    file.unlink()
                    rate = self.lmdb_write(tier, keys, chunk)
                finally:
                    tier.close()
                    shutil.rmtree(env, ignore_errors=True)
                if rep == 0:
                    continue
                baseline = "disk_write_synced_gbps" if synced else "disk_write_gbps"
                s.add(baseline, disk)
                s.add(f"lmdb_write_{setting}_gbps", rate)
                s.ratio(f"lmdb_write_{setting}_vs_{baseline.removesuffix('_gbps')}", rate / disk)

    def run_durability_only(self) -> dict[str, Any]:
        started = time.perf_counter()
        for chunk in CHUNK_SIZES:
            log.info("lmdb durability, %d MiB chunks", chunk // MiB)
            self.run_durability(chunk)
        per_size: dict[str, dict[str, float]] = {}
        for chunk, s in self.samples.items():
            row = s.medians()
            row.update({f"{name}_min": min(v) for name, v in s.rates.items()})
            row.update({f"{name}_max": max(v) for name, v in s.rates.items()})
            per_size[f"{chunk // MiB}MiB"] = row
        out: dict[str, Any] = {
            "mode": self.mode.name,
            "lmdb_preallocate": self.preallocate,
            "working_set_bytes": self.total,
            "repetitions": self.mode.reps,
            "chunks_per_txn": BATCH,
            "per_chunk_size": per_size,
        }
        for name in next(iter(per_size.values())):
            out[name] = geomean([row[name] for row in per_size.values()])
        out["elapsed_s"] = {"total_s": time.perf_counter() - started}
        return out

    # -- verification ---------------------------------------------------------------------

    def run_verify(self, chunk: int) -> None:
        reg: Registration = self.regs[chunk]
        keys = keys_for(reg.namespace, self.total // chunk)
        src = self.src_mv
        values = [
            blockfmt.encode(key, reg.descriptor, src[i * chunk : (i + 1) * chunk])
            for i, key in enumerate(keys)
        ]
        decode = blockfmt.decode

        def run() -> None:
            for key, value in zip(keys, values, strict=True):
                decode(value, key)

        s = self.samples[chunk]
        for rep in range(self.mode.reps + 1):
            rate = gbps(self.total, run)
            if rep:
                s.add("verify_gbps", rate)
        values.clear()

    # -- lookup ---------------------------------------------------------------------------

    def run_lookup(self, with_lmdb: bool) -> float:
        # 4 KiB chunks keep 8192 of them within one 32 MiB extent
        config = from_mapping(
            {
                "arena": {
                    "path": str(self.shm) + "-lookup",
                    "size_bytes": 2 * EXTENT + 4 * MiB,
                    "extent_bytes": EXTENT,
                    "min_slot_bytes": LOOKUP_CHUNK,
                },
                "lmdb": {
                    "enabled": with_lmdb,
                    "path": str(self.root / "lookup-env"),
                    "budget_bytes": 256 * MiB,
                    "sync_interval_s": SYNC_INTERVAL_S,
                },
            }
        )
        manager = TierManager(config)
        try:
            namespace = manager.register_pool(
                small_spec("bench-lookup", LOOKUP_CHUNK), LOOKUP_CHUNK
            )
            keys = keys_for(namespace, LOOKUP_KEYS)
            payload = bytes(LOOKUP_CHUNK)
            for first in range(0, len(keys), 256):
                refs = manager.reserve(keys[first : first + 256])
                if any(ref is None for ref in refs):
                    raise RuntimeError("arena refused a lookup chunk")
                for ref in refs:
                    assert ref is not None
                    manager.cpu.view(ref)[:] = payload
                manager.commit(refs)  # type: ignore[arg-type]
            manager.flush()  # no write-back left to run beside the timed lookups
            times = []
            for _ in range(self.mode.lookup_runs + 1):
                with no_gc():
                    start = time.perf_counter()
                    result = manager.lookup(keys)
                    times.append(time.perf_counter() - start)
                if result.hits != LOOKUP_KEYS or result.tiers.count("cpu") != LOOKUP_KEYS:
                    raise RuntimeError(f"lookup found {result.hits} of {LOOKUP_KEYS} in the arena")
            return statistics.median(times[1:]) * 1e6
        finally:
            manager.close()
            shutil.rmtree(self.root / "lookup-env", ignore_errors=True)

    # -- all ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        phases: dict[str, float] = {}
        for chunk in CHUNK_SIZES:
            log.info("arena, %d MiB chunks", chunk // MiB)
            self.run_arena(chunk)
        phases["arena_s"] = time.perf_counter() - started
        if self.cpu is not None:
            self.cpu.close()
            self.cpu = None
        for chunk in CHUNK_SIZES:
            log.info("lmdb, %d MiB chunks", chunk // MiB)
            self.run_lmdb(chunk)
        phases["lmdb_s"] = time.perf_counter() - started - sum(phases.values())
        for chunk in CHUNK_SIZES:
            log.info("verify, %d MiB chunks", chunk // MiB)
            self.run_verify(chunk)
        log.info("lookup")
        lookup = self.run_lookup(with_lmdb=True)
        lookup_arena = self.run_lookup(with_lmdb=False)
        phases["total_s"] = time.perf_counter() - started
        return result_of(self, lookup, lookup_arena, phases)

    def close(self) -> None:
        if self.cpu is not None:
            self.cpu.close()
            self.cpu = None
        for path in (self.shm, Path(str(self.shm) + "-lookup")):
            path.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller working set, fewer reps")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--durability", action="store_true", help="only lmdb writes under each lmdb.durability"
    )
    parser.add_argument(
        "--preallocate", action="store_true", help="lmdb.preallocate: write through the map"
    )
    args = parser.parse_args(argv)
    log_progress(log)
    bench = Bench(QUICK if args.quick else FULL, preallocate=args.preallocate)
    try:
        result = bench.run_durability_only() if args.durability else bench.run()
    finally:
        bench.close()
    emit(result, args.json, lambda: durability_table(result) if args.durability else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
