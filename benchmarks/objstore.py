"""The object tier against plain boto3, on a moto S3 server started for the run.

Usage: ``python -m benchmarks.objstore [--quick] [--json]``

moto's S3/STS server runs as a subprocess on a free loopback port (killed at exit). Both sides
reach it the way a pod on EKS reaches S3 with IRSA: ``AWS_ROLE_ARN`` and
``AWS_WEB_IDENTITY_TOKEN_FILE`` (a JWT-shaped token moto does not verify), ``AWS_REGION`` and
``AWS_ENDPOINT_URL``, no keys anywhere, so botocore trades the token for temporary keys at STS.
The tier builds its S3 client itself from that environment (kvtier's S3Backend); the baseline is
a boto3 client from a default session in the same process, with the same botocore settings (no
SDK retries, the same timeouts and connection pool), against the same server in the same run.

MB/s is 1e6 payload bytes per second. Objects hold ``pack_target_bytes`` (8 MiB) of payload: a
pack of 1 MiB chunks for the tier (each with its chunk header, so a tier object is slightly
larger), one plain object of that many bytes for boto3. A repetition uploads 16 objects
(``--quick``) or 32 per figure, in waves of ``upload_concurrency`` (8) objects on as many threads;
downloads go in waves of ``download_concurrency`` (8), and each whole object is read 3 times.
The sides of a comparison take turns wave by wave (boto3 then tier on one wave, tier then boto3 on
the next), so load from other processes weighs on both alike; a side's figure is its bytes over
the sum of its waves' times. Every figure is the median over repetitions, after one untimed
warm-up repetition of one wave that also checks the bytes that come back; each ratio is the
median of per-repetition ratios. ``client_cpu_ms_per_mb`` is the CPU time of this process (all
its threads) per MB moved, ``server_cpu_ms_per_mb`` that of the moto process (from /proc; 10 ms
ticks): CPU is far less disturbed by other load than wall time, so these show what each side
costs even where the machine is noisy.

- ``raw_put_mbps``: boto3 ``put_object`` of each object (a ``bytes`` body), new names each time.
- ``tier_put_mbps``: ``ObjectTier.put_pack`` of the same payload, one call per pack: chunk
  encoding (header, xxh3 checksums), the upload, the index write.
- ``uploader_put_mbps``: as many other chunks, first written to an LmdbTier (untimed), offered
  to an ``Uploader`` wired as TierManager wires it (``LmdbTier.copy_encoded`` copies each chunk
  out of lmdb, encoded and verified, into the pack; its packer groups them, its own pool
  uploads them), timed from the first offer until ``wait_idle``.
- ``upload_vs_raw_boto3``: tier_put / raw_put; ``uploader_vs_raw_boto3``: uploader_put / raw_put.
- ``raw_get_mbps``: boto3 ``get_object`` of each whole object, body read into ``bytes``.
- ``tier_fetch_mbps``: ``ObjectTier.fetch`` of each pack: the GET, then every chunk verified.
- ``download_vs_raw_boto3``: tier_fetch / raw_get.
- ``raw_range_get_mbps`` and ``tier_read_into_mbps``: one chunk per request instead, a ranged
  ``get_object`` against ``ObjectTier.read_into`` (ranged GET, verified copy into a buffer);
  ``read_into_vs_raw_range`` is their ratio.
- ``lookup_budget_p50_ms``, ``lookup_budget_p99_ms``, ``lookup_budget_max_ms``: a TierManager
  (arena, lmdb and the object tier) whose S3 endpoint is a loopback proxy that holds every
  response for ``lookup_store_delay_ms`` (200 ms); each lookup asks for 8 chunks found in no local
  tier, so the manager probes the store for an object another node uploaded (half of them exist)
  and waits at most ``object.lookup_budget_ms`` for the answer. ``lookup_pending_fraction`` is the
  share of those lookups answered "ask again". ``lookup_fast_store_p50_ms``/``_p99_ms`` are the
  same lookups with the proxy not delaying: the cost of a probe that does answer in time.

The proxy runs in a child process of its own. On a machine with few cores moto, the proxy and the
client share them (and whatever else runs there), so absolute figures say more about the machine
than about the tier; the ratios are the point.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3.session
import botocore.config

from benchmarks.harness.buffers import filled
from benchmarks.harness.cli import emit, log_progress
from benchmarks.harness.sizes import MiB
from benchmarks.harness.specs import spec_for_chunk
from benchmarks.harness.stats import Samples
from benchmarks.objstore_lookups import lookups_against_a_slow_store
from benchmarks.objstore_proxy import ProxyProcess
from benchmarks.objstore_report import result_of, table
from benchmarks.objstore_settings import (
    BUCKET,
    CHUNK,
    FULL,
    GET_PASSES,
    QUICK,
    RATIOS,
    REQUEST_TIMEOUT_S,
    STORE_DELAY_MS,
    Mode,
)
from benchmarks.objstore_timing import Cost, timed
from kvtier.core.config import LMDBConfig, ObjectStoreConfig
from kvtier.core.counters import Counters
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.lmdb_tier import LmdbTier
from kvtier.tiers.objstore.tier import ObjectTier
from kvtier.tiers.objstore.uploader import Uploader
from tests.fixtures.keys import keys_for
from tests.fixtures.s3 import SCRUBBED_ENV, MotoServer, irsa_env, patched_env

log = logging.getLogger("kvtier.bench")

Pack = list[tuple[ChunkKey, memoryview]]


class Bench:
    def __init__(self, mode: Mode, root: Path, moto: MotoServer) -> None:
        self.mode = mode
        self.root = root
        self.moto = moto
        self.shm = Path(f"/dev/shm/kvtier-bench-objstore-{os.getpid()}")
        self.config = ObjectStoreConfig(
            url=f"s3://{BUCKET}/tier",
            index_path=root / "objindex",
            request_timeout_s=REQUEST_TIMEOUT_S,
        )
        self.object_bytes = int(self.config.pack_target_bytes)
        if self.object_bytes < CHUNK or self.object_bytes % CHUNK:
            raise ValueError("pack_target_bytes must be a multiple of the 1 MiB chunk")
        self.chunks_per_object = self.object_bytes // CHUNK
        self.up_threads = self.config.upload_concurrency
        self.down_threads = self.config.download_concurrency
        self.registry = PoolRegistry()
        self.namespace = self.registry.register(
            spec_for_chunk("bench-objstore", CHUNK), CHUNK
        ).namespace
        # one bytes object per pack; the tier sees it as chunk views, boto3 as one body
        self.bodies = [
            filled(self.object_bytes, i * self.object_bytes).tobytes() for i in range(mode.objects)
        ]
        self.dst = bytearray(mode.objects * self.object_bytes)
        self.samples = Samples()
        self.raw: Any = boto3.session.Session().client("s3", config=self.client_config())
        self.tier: ObjectTier | None = None
        # where the uploader reads chunks from, as TierManager wires it
        self.lmdb = LmdbTier(
            LMDBConfig(
                path=root / "lmdb-source",
                budget_bytes=2 * len(self.dst) + 64 * MiB,
                sync_interval_s=3600.0,
            ),
            self.registry,
        )
        self.pool_up = ThreadPoolExecutor(self.up_threads, "bench-up")
        self.pool_down = ThreadPoolExecutor(self.down_threads, "bench-down")

    @staticmethod
    def client_config() -> botocore.config.Config:
        # what kvtier's S3Backend sets, so both clients differ only in what wraps them
        return botocore.config.Config(
            connect_timeout=REQUEST_TIMEOUT_S,
            read_timeout=REQUEST_TIMEOUT_S,
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=64,
        )

    def open_tier(self) -> ObjectTier:
        self.raw.create_bucket(Bucket=BUCKET)
        self.tier = ObjectTier(self.config, self.registry)
        self.tier.principal_resolved.wait(30)  # resolved in the background
        if not self.tier.principal.startswith("arn:aws:sts::"):
            raise RuntimeError(f"the tier is not using web identity: {self.tier.principal}")
        return self.tier

    # -- keys and payloads ----------------------------------------------------------------

    def packs(self, rep: int, salt: int) -> list[Pack]:
        """Chunks of every object, keyed afresh per repetition and series."""
        per = self.chunks_per_object
        first = (rep * 4 + salt) * self.mode.objects * per
        keys = keys_for(self.namespace, self.mode.objects * per, first)
        out = []
        for i, body in enumerate(self.bodies):
            view = memoryview(body)
            out.append([(keys[i * per + j], view[j * CHUNK : (j + 1) * CHUNK]) for j in range(per)])
        return out

    @staticmethod
    def raw_name(series: int, i: int) -> str:
        return f"raw/{series}/{i:05d}"

    @staticmethod
    def waves(n: int, size: int) -> list[range]:
        return [range(i, min(i + size, n)) for i in range(0, n, size)]

    # -- uploads: each call moves the objects of one wave ---------------------------------

    def raw_put(self, series: int, wave: range) -> None:
        raw = self.raw

        def one(i: int) -> None:
            raw.put_object(Bucket=BUCKET, Key=self.raw_name(series, i), Body=self.bodies[i])

        list(self.pool_up.map(one, wave))

    def tier_put(self, tier: ObjectTier, packs: list[Pack], wave: range) -> None:
        def one(i: int) -> None:
            if tier.put_pack(packs[i]) != len(packs[i]):
                raise RuntimeError(f"put_pack failed: {tier.counters.snapshot()}")

        list(self.pool_up.map(one, wave))

    def fill_lmdb(self, packs: list[Pack]) -> None:
        for items in packs:
            if not all(self.lmdb.put_many(items)):
                raise RuntimeError("lmdb refused chunks; raise its budget")

    @staticmethod
    def uploader_put(uploader: Uploader, packs: list[Pack], wave: range) -> None:
        keys = [key for i in wave for key, _ in packs[i]]
        for i in wave:  # each pack is one prefix's consecutive chunks, as a reserve tells it
            uploader.follows([key for key, _ in packs[i]])
        if uploader.offer(keys, "default") != len(keys):
            raise RuntimeError("the upload queue refused chunks; raise its bound")
        if not uploader.wait_idle(120.0):
            raise RuntimeError("uploads did not finish")

    # -- downloads ------------------------------------------------------------------------

    def raw_get(self, series: int, wave: range, check: bool = False) -> None:
        raw = self.raw

        def one(i: int) -> None:
            body = raw.get_object(Bucket=BUCKET, Key=self.raw_name(series, i))["Body"]
            try:
                data = body.read()
            finally:
                body.close()
            if check and data != self.bodies[i]:
                raise RuntimeError("boto3 read back other bytes than it wrote")

        list(self.pool_down.map(one, wave))

    def tier_fetch(
        self, tier: ObjectTier, packs: list[Pack], wave: range, check: bool = False
    ) -> None:
        def one(i: int) -> None:
            name = tier.object_name(packs[i][0][0])
            chunks = tier.fetch(name)
            if chunks is None or len(chunks) != len(packs[i]):
                raise RuntimeError(f"fetch of {name} failed: {tier.counters.snapshot()}")
            if check:
                for got, (key, payload) in zip(chunks, packs[i], strict=True):
                    if got.key != key or got.payload != payload:
                        raise RuntimeError("the tier read back other bytes than it wrote")

        list(self.pool_down.map(one, wave))

    def raw_range_get(self, series: int, wave: range) -> None:
        raw, dst = self.raw, memoryview(self.dst)
        per = self.chunks_per_object

        def one(n: int) -> None:
            i, j = divmod(n, per)
            rng = f"bytes={j * CHUNK}-{(j + 1) * CHUNK - 1}"
            body = raw.get_object(Bucket=BUCKET, Key=self.raw_name(series, i), Range=rng)["Body"]
            try:
                data = body.read()
            finally:
                body.close()
            dst[n * CHUNK : (n + 1) * CHUNK] = data

        list(self.pool_down.map(one, range(wave.start * per, wave.stop * per)))

    def tier_read_into(
        self, tier: ObjectTier, packs: list[Pack], wave: range, check: bool = False
    ) -> None:
        per = self.chunks_per_object
        dst = memoryview(self.dst)

        def one(n: int) -> None:
            i, j = divmod(n, per)
            if not tier.read_into(packs[i][j][0], dst[n * CHUNK : (n + 1) * CHUNK]):
                raise RuntimeError(f"read_into missed: {tier.counters.snapshot()}")

        span = slice(wave.start * self.object_bytes, wave.stop * self.object_bytes)
        if check:
            self.dst[span] = bytes(span.stop - span.start)
        list(self.pool_down.map(one, range(wave.start * per, wave.stop * per)))
        if check and self.dst[span] != b"".join(self.bodies[i] for i in wave):
            raise RuntimeError("read_into returned other bytes than were stored")

    # -- repetitions ----------------------------------------------------------------------

    def interleaved(
        self, sides: Sequence[Callable[[range], object]], waves: list[range]
    ) -> list[Cost]:
        """What each side took over all waves, the sides taking turns wave by wave, in forward
        order on even waves and backward on odd ones."""
        totals = [Cost() for _ in sides]
        pid = self.moto.pid
        for w, wave in enumerate(waves):
            order = range(len(sides)) if w % 2 == 0 else range(len(sides) - 1, -1, -1)
            for i in order:
                totals[i] += timed(functools.partial(sides[i], wave), pid)
        return totals

    def drop(self, tier: ObjectTier, series: int, packs: Sequence[list[Pack]]) -> None:
        for group in packs:
            keys = [key for items in group for key, _ in items]
            if tier.delete(keys) != len(keys):
                raise RuntimeError("the tier did not drop every chunk")
            self.lmdb.delete(keys)
        names = [{"Key": self.raw_name(series, i)} for i in range(self.mode.objects)]
        self.raw.delete_objects(Bucket=BUCKET, Delete={"Objects": names, "Quiet": True})

    def repetition(self, tier: ObjectTier, rep: int, warm_up: bool) -> dict[str, tuple[Cost, int]]:
        """One repetition; returns the cost and the payload bytes moved, by figure. The warm-up
        moves one wave of each kind and checks the bytes that come back."""
        packs, queued = self.packs(rep, 0), self.packs(rep, 1)
        self.fill_lmdb(queued)
        n = self.up_threads if warm_up else self.mode.objects
        up_waves = self.waves(n, self.up_threads)
        down_waves = self.waves(n, self.down_threads)
        uploader = Uploader(tier, self.lmdb, self.config, Counters())
        try:
            raw_put, tier_put, up_put = self.interleaved(
                [
                    functools.partial(self.raw_put, rep),
                    functools.partial(self.tier_put, tier, packs),
                    functools.partial(self.uploader_put, uploader, queued),
                ],
                up_waves,
            )
        finally:
            uploader.close(10.0)
        lost = uploader.counters.snapshot()
        queued_keys = [key for i in range(n) for key, _ in queued[i]]
        if lost or not all(tier.contains(queued_keys)):
            raise RuntimeError(f"the uploader lost chunks: {lost}")
        # a GET costs a fraction of a PUT: each object is read GET_PASSES times
        get_passes = 1 if warm_up else GET_PASSES
        raw_get, fetch = self.interleaved(
            [
                functools.partial(self.raw_get, rep, check=warm_up),
                functools.partial(self.tier_fetch, tier, packs, check=warm_up),
            ],
            down_waves * get_passes,
        )
        if warm_up:
            self.tier_fetch(tier, queued, down_waves[0], check=True)
        raw_range, read_into = self.interleaved(
            [
                functools.partial(self.raw_range_get, rep),
                functools.partial(self.tier_read_into, tier, packs, check=warm_up),
            ],
            down_waves,
        )
        self.drop(tier, rep, [packs[:n], queued[:n]])
        nbytes = n * self.object_bytes
        return {
            "raw_put": (raw_put, nbytes),
            "tier_put": (tier_put, nbytes),
            "uploader_put": (up_put, nbytes),
            "raw_get": (raw_get, nbytes * get_passes),
            "tier_fetch": (fetch, nbytes * get_passes),
            "raw_range_get": (raw_range, nbytes),
            "tier_read_into": (read_into, nbytes),
        }

    def run_transfers(self) -> None:
        tier = self.tier or self.open_tier()
        s = self.samples
        self.repetition(tier, 0, warm_up=True)
        for rep in range(1, self.mode.reps + 1):
            costs = self.repetition(tier, rep, warm_up=False)
            for name, (cost, nbytes) in costs.items():
                mb = nbytes / 1e6
                s.add(f"{name}_mbps", mb / cost.wall)
                s.add(f"{name}_cpu_ms_per_mb", cost.cpu * 1e3 / mb)
                s.add(f"{name}_server_cpu_ms_per_mb", cost.server_cpu * 1e3 / mb)
            log.info(
                "rep %d: %s",
                rep,
                " ".join(f"{k} {n / 1e6 / c.wall:.0f}" for k, (c, n) in costs.items()),
            )
            for ratio, raw, tiered in RATIOS:
                s.ratio(ratio, costs[raw][0].wall / costs[tiered][0].wall)

    # -- all ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        phases: dict[str, float] = {}
        log.info("transfers, %d objects of %d MiB", self.mode.objects, self.object_bytes // MiB)
        self.run_transfers()
        phases["transfers_s"] = time.perf_counter() - started
        log.info("lookups against a store delayed by %.0f ms", STORE_DELAY_MS)
        proxy = ProxyProcess(self.moto.port)
        try:
            lookups = lookups_against_a_slow_store(
                proxy, self.root, self.shm, self.mode.lookups, self.pool_up
            )
        finally:
            proxy.close()
        phases["lookups_s"] = time.perf_counter() - started - phases["transfers_s"]
        phases["total_s"] = time.perf_counter() - started
        return result_of(self, lookups, phases)

    def close(self) -> None:
        self.pool_up.shutdown(wait=True, cancel_futures=True)
        self.pool_down.shutdown(wait=True, cancel_futures=True)
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        self.raw.close()
        self.lmdb.close()
        self.shm.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer objects and repetitions")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    log_progress(log, "botocore")
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-objstore-"))
    moto = MotoServer(root / "moto.log")
    bench: Bench | None = None
    try:
        moto.start()
        with patched_env(irsa_env(root, moto.url), drop=SCRUBBED_ENV):
            bench = Bench(QUICK if args.quick else FULL, root, moto)
            result = bench.run()
    finally:
        if bench is not None:
            bench.close()
        moto.stop()
        shutil.rmtree(root, ignore_errors=True)
    emit(result, args.json, lambda: table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
