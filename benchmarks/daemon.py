"""The kvtierd data plane as engines see it: a daemon in its own process, clients in others.

Usage: ``python -m benchmarks.daemon [--quick] [--json]``

kvtierd runs as ``kvtier serve`` in a subprocess, with a configuration written for the run: the
arena in a fresh /dev/shm file, LMDB and the data-plane socket in a temporary directory, the admin
and metrics APIs on 127.0.0.1 at ports the kernel picks. The benchmark process is client A; client
B is a second process (multiprocessing, spawn) with its own session. Both map the arena by the
path returned at registration and address chunks by the offsets in each SlotRef, as engine
workers do; chunk bytes never cross gRPC.

GB/s is 1e9 payload bytes per second. Transfer chunks are 1, 2 and 4 MiB over a working set
(256 MiB, 128 MiB with ``--quick``); every figure is the median of several repetitions after one
untimed warm-up repetition (which also maps the arena's pages into both clients); each ratio is
the median of per-repetition ratios whose denominator was timed right before its numerator, and
the headline ratio is the geometric mean over chunk sizes.

- ``lookup_8192_keys_p50_us``, ``lookup_8192_keys_p99_us``, ``lookup_8192_keys_mean_us``: one
  GrpcTierClient.lookup of 8192 keys, all in the arena, timed end to end in client A: encode,
  unix socket, daemon, decode. Percentiles over 200 calls (50 with ``--quick``) per round, median
  over rounds, one round per repetition. ``lookup_1_key_p50_us`` is the same call with one key:
  the cost of a call as such.
- ``store_commit_chunks_per_s``: Reserve then Commit, 64 keys per call, 64 KiB chunks, no payload
  written: the rate of the store path's control calls alone, with the daemon checksumming each
  chunk's slot as it commits it (``arena.commit_checksum``, on by default).
  ``store_commit_chunks_per_s_no_checksum`` is the same against a second kvtierd, configured alike
  but with ``arena.commit_checksum: false`` and running beside the first; the two take each batch
  in turn (which goes first alternates), so both are timed under the same load.
  ``commit_checksum_store_ratio`` is the median of per-repetition ratios, with over without. This
  phase has 15 repetitions (31 in full mode, ``store_commit_repetitions``): one takes only tens of
  milliseconds.
- ``memcpy_gbps``: in client A, copy the working set chunk by chunk between two numpy buffers.
- ``arena_store_gbps``: client A streams the working set into the arena, 64 chunks per call: one
  ``reserve(commit=)`` call per batch, in flight while the batch before it is copied in with
  numpy (which drops the GIL, so the call progresses meanwhile), as an engine worker would.
- ``arena_load_gbps``: client B streams the same keys out, one ``lease(release=)`` call per
  batch in flight while the batch before it is copied out.
- ``arena_transfer_gbps``: the slower of the two sides, which is the rate of a transfer whose
  store and load overlap (a pipeline runs at its slowest stage). ``arena_transfer_serial_gbps``
  is the working set over the time of both phases run one after the other, for reference.
- ``cross_process_arena_vs_memcpy``: per repetition, the lower of store/memcpy and load/memcpy.
- ``arena_store_no_checksum_gbps``: client A's arena store into the second kvtierd (no commit
  checksums, above), once per repetition, before or after the rest in turn (its pairing is not
  the before-and-right-after of the memcpy ratios); ``commit_checksum_arena_store_ratio`` is the
  median of per-repetition ratios of ``arena_store_gbps`` over it: what checksumming every
  committed byte costs the store stream.
- ``rpc_per_chunk_store``, ``rpc_per_chunk_load``: data-plane calls client A made while storing
  over chunks stored, and calls client B made while loading over chunks loaded, counted where each
  client issues its calls (heartbeats, which depend on time and not on traffic, left out);
  ``rpc_per_chunk`` is the larger.

Write-back to LMDB is held off (``manager.clean_reserve: 0``, and clients that say they are busy,
as engines holding requests do, since an idle kvtierd writes every chunk) so that no LMDB write
runs beside the timed phases, as tiers.py keeps fsyncs out of its timed writes. Chunks are
dropped through the admin API between repetitions, so the daemon has nothing to write back on
SIGTERM; ``daemon``
reports its start time (arena pre-fault included), its exit status after SIGTERM and how long it
took to exit (``no_checksum_exit_code``: the second daemon's, which serves only the two store
comparisons).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.daemon_clients import (
    Answer,
    CountingClient,
    DaemonProcess,
    client_b,
    granted,
    in_batches,
    metric_value,
)
from benchmarks.daemon_report import result_of, table
from benchmarks.daemon_settings import (
    BATCH,
    CHUNK_SIZES,
    CLIENT_TIMEOUT_S,
    DROP_TIMEOUT_S,
    EXTENT,
    FILL_BATCH,
    FULL,
    LOOKUP_CHUNK,
    LOOKUP_KEYS,
    QUICK,
    STORE_BATCH,
    STORE_CHUNK,
    Mode,
)
from benchmarks.harness.buffers import filled, no_gc, timed, touched
from benchmarks.harness.cli import emit, log_progress
from benchmarks.harness.sizes import KiB, MiB
from benchmarks.harness.specs import sixteen_layer_spec, small_spec
from benchmarks.harness.stats import Samples
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import SlotRef
from kvtier.rpc import AdminClient
from kvtier.tiers.arena import ArenaMemory
from tests.fixtures.keys import keys_for

log = logging.getLogger("kvtier.bench")


class Bench:
    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.total = mode.working_set
        self.root = Path(tempfile.mkdtemp(prefix="kvtier-bench-daemon-"))
        self.shm = Path(f"/dev/shm/kvtier-bench-daemon-{os.getpid()}")
        # every chunk size keeps its own extents, as do the lookup and store pools
        arena_bytes = (
            len(CHUNK_SIZES) * self.total
            + LOOKUP_KEYS * LOOKUP_CHUNK
            + mode.store_chunks * STORE_CHUNK
            + 3 * EXTENT
        )
        self.daemon = DaemonProcess(self.root, self.shm, arena_bytes)
        # the store path again, without commit checksums; the same arena, as its size was seen
        # to move this rate by itself
        self.plain = DaemonProcess(
            self.root / "no-checksum",
            Path(f"{self.shm}-no-checksum"),
            arena_bytes,
            commit_checksum=False,
        )
        self.client: CountingClient | None = None
        self.admin: AdminClient | None = None
        self.plain_client: CountingClient | None = None
        self.plain_admin: AdminClient | None = None
        self.plain_arena: ArenaMemory | None = None
        self.arena: ArenaMemory | None = None
        self.b_proc: multiprocessing.process.BaseProcess | None = None
        self.b_conn: Connection | None = None
        self.src = np.empty(0, np.uint8)
        self.dst = np.empty(0, np.uint8)
        self.samples = {c: Samples() for c in CHUNK_SIZES}
        self.rpc = Counter[str]()
        self.committed = 0
        self.figures: dict[str, float] = {}
        self.phases: dict[str, float] = {}
        self.daemon_figures: dict[str, Any] = {}

    # -- set-up ---------------------------------------------------------------------------

    def start(self) -> None:
        self.daemon.start()
        self.client = CountingClient(self.daemon.socket_path, "bench-a")
        self.admin = self.daemon.admin_client()
        self.plain.start()
        self.plain_client = CountingClient(self.plain.socket_path, "bench-a")
        # as an engine holding requests: write-back keeps only the clean reserve, which is none
        for client in (self.client, self.plain_client):
            client.set_busy(True)
        self.plain_admin = self.plain.admin_client()
        ctx = multiprocessing.get_context("spawn")
        self.b_conn, child = ctx.Pipe()
        self.b_proc = ctx.Process(
            target=client_b,
            args=(child, str(self.daemon.socket_path), self.total),
            name="kvtier-bench-client-b",
            daemon=True,
        )
        self.b_proc.start()
        child.close()
        self.src = filled(self.total)
        self.dst = touched(self.total)
        self.ask_b()  # its imports and buffer are done before anything is timed

    def ask_b(self, *request: object) -> tuple[Any, ...]:
        conn = self.b_conn
        assert conn is not None
        if request:
            conn.send(request)
        if not conn.poll(CLIENT_TIMEOUT_S):
            raise RuntimeError(f"client B did not answer within {CLIENT_TIMEOUT_S:.0f} s")
        try:
            reply = conn.recv()
        except EOFError:
            raise RuntimeError("client B exited") from None
        if reply[0] != "ok":
            raise RuntimeError(f"client B failed:\n{reply[1]}")
        return tuple(reply[1:])

    def drop(self, namespace: bytes, n: int, admin: AdminClient | None = None) -> None:
        """Drop a pool's chunks from the arena (untimed), so the next repetition stores anew."""
        admin = admin or self.admin
        assert admin is not None
        # a lease or commit answered to a client may still be ending in the daemon: ask again
        deadline = time.monotonic() + DROP_TIMEOUT_S
        dropped = admin.evict(namespace=namespace).get("cpu", 0)
        while dropped < n and time.monotonic() < deadline:
            time.sleep(0.01)
            dropped += admin.evict(namespace=namespace).get("cpu", 0)
        if dropped != n:
            raise RuntimeError(
                f"evicted {dropped} of {n} chunks in {DROP_TIMEOUT_S:.0f} s; some are still leased"
            )

    # -- lookup ---------------------------------------------------------------------------

    def run_lookup(self) -> None:
        client = self.client
        assert client is not None
        namespace = client.register_pool(small_spec("bench-lookup", LOOKUP_CHUNK), LOOKUP_CHUNK)
        keys = keys_for(namespace, LOOKUP_KEYS)
        for first in range(0, LOOKUP_KEYS, FILL_BATCH):
            refs = granted(client.reserve(keys[first : first + FILL_BATCH]), "lookup fill")
            # a lookup never reads the bytes, so none are written
            self.committed += client.commit(refs)
        one = keys[:1]
        for _ in range(5):  # channel and server threads warmed up
            client.lookup(keys)
            client.lookup(one)
        p50: list[float] = []
        p99: list[float] = []
        mean: list[float] = []
        single: list[float] = []
        for _ in range(self.mode.reps):
            times = self.lookup_times(client, keys)
            p50.append(float(np.percentile(times, 50)))
            p99.append(float(np.percentile(times, 99)))
            mean.append(statistics.fmean(times))
            single.append(float(np.percentile(self.lookup_times(client, one), 50)))
        self.figures["lookup_8192_keys_p50_us"] = statistics.median(p50)
        self.figures["lookup_8192_keys_p99_us"] = statistics.median(p99)
        self.figures["lookup_8192_keys_mean_us"] = statistics.median(mean)
        self.figures["lookup_1_key_p50_us"] = statistics.median(single)
        self.drop(namespace, LOOKUP_KEYS)

    def lookup_times(self, client: CountingClient, keys: list[ChunkKey]) -> list[float]:
        times: list[float] = []
        hits: list[int] = []
        with no_gc():
            for _ in range(self.mode.lookup_runs):
                start = time.perf_counter()
                result = client.lookup(keys)
                times.append(time.perf_counter() - start)
                hits.append(result.tiers.count("cpu"))
        if min(hits) != len(keys):
            raise RuntimeError(f"lookup found {min(hits)} of {len(keys)} keys in the arena")
        return [t * 1e6 for t in times]

    # -- store control path ---------------------------------------------------------------

    def run_store_commit(self) -> None:
        client, plain = self.client, self.plain_client
        assert client is not None
        assert plain is not None
        spec = small_spec("bench-store", STORE_CHUNK)
        namespace = client.register_pool(spec, STORE_CHUNK)
        if plain.register_pool(spec, STORE_CHUNK) != namespace:
            raise RuntimeError("the two daemons gave one pool different namespaces")
        n = self.mode.store_chunks
        keys = keys_for(namespace, n)

        def run() -> tuple[float, float]:
            # batch by batch in turn, first one daemon then the other, so that both see the
            # same moments of a machine whose other load comes and goes
            spent = [0.0, 0.0]
            pair = (client, plain)
            with no_gc():
                for call, first in enumerate(range(0, n, STORE_BATCH)):
                    batch = keys[first : first + STORE_BATCH]
                    for side in (0, 1) if call % 2 else (1, 0):
                        start = time.perf_counter()
                        refs = granted(pair[side].reserve(batch), "store")
                        if pair[side].commit(refs) != len(refs):
                            raise RuntimeError("the daemon did not commit every reserved slot")
                        spent[side] += time.perf_counter() - start
            return spent[0], spent[1]

        rates: list[float] = []
        plain_rates: list[float] = []
        ratios: list[float] = []
        for rep in range(self.mode.store_reps + 1):
            with_sum, without = run()
            self.committed += n
            self.drop(namespace, n)
            self.drop(namespace, n, self.plain_admin)
            if rep:
                rates.append(n / with_sum)
                plain_rates.append(n / without)
                ratios.append(without / with_sum)
        self.figures["store_commit_chunks_per_s"] = statistics.median(rates)
        self.figures["store_commit_chunks_per_s_no_checksum"] = statistics.median(plain_rates)
        self.figures["commit_checksum_store_ratio"] = statistics.median(ratios)

    # -- bytes through the arena, client A to client B ------------------------------------

    def memcpy(self, chunk: int) -> float:
        src, dst, total = self.src, self.dst, self.total

        def run() -> None:
            for off in range(0, total, chunk):
                np.copyto(dst[off : off + chunk], src[off : off + chunk])

        return total / timed(run) / 1e9

    def store_all(
        self,
        keys: list[ChunkKey],
        chunk: int,
        to: tuple[CountingClient | None, ArenaMemory | None] | None = None,
    ) -> float:
        client, arena = to or (self.client, self.arena)
        assert client is not None
        assert arena is not None
        src = self.src
        whole = np.frombuffer(arena.view(0, arena.size), dtype=np.uint8)

        def reserve_behind(following: Sequence[ChunkKey], written: list[SlotRef]) -> Answer:
            pending = client.reserve_behind(following, commit=written)

            def answer() -> list[SlotRef]:
                committed, grants = pending.result()
                if committed != len(written):
                    raise RuntimeError("the daemon did not commit every written slot")
                return granted(grants, "reserve")

            return answer

        def copy_in(first: int, refs: list[SlotRef]) -> None:
            off = first * chunk
            for ref in refs:
                np.copyto(whole[ref.offset : ref.offset + chunk], src[off : off + chunk])
                off += chunk

        def run() -> None:
            refs = granted(client.reserve(keys[:BATCH]), "reserve")
            written = in_batches(keys, refs, reserve_behind, copy_in)
            if client.commit(written) != len(written):
                raise RuntimeError("the daemon did not commit every written slot")

        return timed(run)

    def run_transfer(self, chunk: int) -> None:
        client = self.client
        assert client is not None
        namespace = client.register_pool(sixteen_layer_spec(f"bench-daemon-{chunk}", chunk), chunk)
        if self.arena is None:
            self.arena = ArenaMemory.attach(client.arena_path)
        (b_namespace,) = self.ask_b("register", chunk)
        if b_namespace != namespace:
            raise RuntimeError("clients A and B registered different namespaces")
        plain = self.plain_client
        assert plain is not None
        if (
            plain.register_pool(sixteen_layer_spec(f"bench-daemon-{chunk}", chunk), chunk)
            != namespace
        ):
            raise RuntimeError("the two daemons gave one pool different namespaces")
        if self.plain_arena is None:
            self.plain_arena = ArenaMemory.attach(plain.arena_path)
        n = self.total // chunk
        keys = keys_for(namespace, n)
        s = self.samples[chunk]

        def store_unchecked() -> float:
            elapsed = self.store_all(keys, chunk, (plain, self.plain_arena))
            self.drop(namespace, n, self.plain_admin)
            return elapsed

        for rep in range(self.mode.reps + 1):
            # the daemon without commit checksums, before or after the rest in turn
            plain_s = store_unchecked() if rep % 2 else math.nan
            base = self.memcpy(chunk)
            before = client.calls.copy()
            store_s = self.store_all(keys, chunk)
            store_calls = client.traffic_since(before)
            self.committed += n
            base_load = self.memcpy(chunk)
            load_s, load_calls = self.ask_b("load", chunk, keys, rep == 0)
            self.drop(namespace, n)
            if not rep % 2:
                plain_s = store_unchecked()
            if rep == 0:
                continue  # warm-up: extents assigned, arena pages mapped in both clients
            store, load = self.total / store_s / 1e9, self.total / load_s / 1e9
            s.add("memcpy_gbps", base)
            s.add("memcpy_gbps", base_load)
            s.add("arena_store_gbps", store)
            s.add("arena_load_gbps", load)
            s.add("arena_transfer_gbps", min(store, load))
            s.add("arena_transfer_serial_gbps", self.total / (store_s + load_s) / 1e9)
            s.ratio("arena_store_vs_memcpy", store / base)
            s.ratio("arena_load_vs_memcpy", load / base_load)
            s.ratio("cross_process_arena_vs_memcpy", min(store / base, load / base_load))
            s.add("arena_store_no_checksum_gbps", self.total / plain_s / 1e9)
            s.ratio("commit_checksum_arena_store_ratio", plain_s / store_s)
            self.rpc.update(store_calls=store_calls, load_calls=load_calls, chunks=n)

    # -- all ------------------------------------------------------------------------------

    def run(self) -> None:
        started = time.perf_counter()
        log.info("starting kvtierd, a second one without commit checksums, and client B")
        self.start()
        self.phases["start_s"] = time.perf_counter() - started
        log.info("lookup, %d keys", LOOKUP_KEYS)
        self.run_lookup()
        log.info("reserve + commit, %d KiB chunks", STORE_CHUNK // KiB)
        self.run_store_commit()
        for chunk in CHUNK_SIZES:
            log.info("client A -> arena -> client B, %d MiB chunks", chunk // MiB)
            self.run_transfer(chunk)
        assert self.client is not None
        text = self.daemon.metrics()
        self.daemon_figures["metrics_cpu_stores"] = metric_value(
            text, "kvtier_tier_events_total", tier="cpu", event="stores"
        )
        self.daemon_figures["metrics_sessions"] = metric_value(text, "kvtier_sessions")
        self.daemon_figures["client_commits"] = self.committed
        if self.daemon_figures["metrics_cpu_stores"] != self.committed:
            log.warning("kvtierd counted other stores than the clients committed")
        self.phases["measure_s"] = time.perf_counter() - started - self.phases["start_s"]

    def close(self) -> None:
        started = time.perf_counter()
        if self.b_conn is not None:
            with contextlib.suppress(OSError):
                self.b_conn.send(("stop",))
            self.b_conn.close()
        if self.b_proc is not None:
            self.b_proc.join(30)
            if self.b_proc.exitcode is None:
                self.b_proc.terminate()
                self.b_proc.join()
        if self.arena is not None:
            self.arena.close()
        if self.client is not None:
            self.client.close()
        if self.admin is not None:
            self.admin.close()
        if self.plain_arena is not None:
            self.plain_arena.close()
        if self.plain_client is not None:
            self.plain_client.close()
        if self.plain_admin is not None:
            self.plain_admin.close()
        self.daemon.stop()
        self.plain.stop()
        self.daemon_figures.update(
            start_s=self.daemon.start_s,
            exit_code=self.daemon.exit_code,
            shutdown_s=self.daemon.stop_s,
            no_checksum_exit_code=self.plain.exit_code,
        )
        self.phases["stop_s"] = time.perf_counter() - started
        self.shm.unlink(missing_ok=True)  # gone already unless the daemon was killed
        self.plain.shm.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller working set, fewer reps")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    log_progress(log)
    bench = Bench(QUICK if args.quick else FULL)
    try:
        bench.run()
    finally:
        bench.close()
    result = result_of(bench)
    emit(result, args.json, lambda: table(result))
    daemon = result["daemon"]
    return 0 if daemon["exit_code"] == 0 and daemon["no_checksum_exit_code"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
