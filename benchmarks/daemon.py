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
import json
import logging
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from benchmarks.harness.buffers import filled, no_gc, touched
from benchmarks.harness.kvtierd import KvtierdProcess
from benchmarks.harness.sizes import KiB, MiB
from benchmarks.harness.specs import sixteen_layer_spec, small_spec
from benchmarks.harness.stats import geomean
from benchmarks.harness.targets import Target, judged, judged_cell, stated
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import SlotRef
from kvtier.rpc import AdminClient, GrpcTierClient, Pending
from kvtier.tiers.arena import ArenaMemory
from tests.fixtures.keys import keys_for

log = logging.getLogger("kvtier.bench")

CHUNK_SIZES = (1 * MiB, 2 * MiB, 4 * MiB)
BATCH = 64  # chunks per call on the transfer paths
EXTENT = 32 * MiB
LOOKUP_KEYS = 8192
LOOKUP_CHUNK = 4 * KiB  # 8192 of them fit one extent
FILL_BATCH = 1024
STORE_BATCH = 64
STORE_CHUNK = 64 * KiB
LMDB_BUDGET = 1 << 30
SYNC_INTERVAL_S = 3600.0
DROP_TIMEOUT_S = 10.0
CLIENT_TIMEOUT_S = 120.0
HEARTBEAT = "HeartbeatRequest"

TARGETS: dict[str, Target] = {
    "lookup_8192_keys_p99_us": ("<=", 3000.0),
    "cross_process_arena_vs_memcpy": (">=", 0.7),
    "rpc_per_chunk": ("<=", 0.1),
}
R = TypeVar("R")


@dataclass(frozen=True)
class Mode:
    name: str
    working_set: int
    reps: int
    lookup_runs: int
    store_chunks: int
    store_reps: int


QUICK = Mode("quick", 128 * MiB, 5, 50, 1024, 15)
FULL = Mode("full", 256 * MiB, 11, 200, 2048, 31)


@dataclass
class Samples:
    """Per chunk size: GB/s samples by figure, and paired ratios by ratio name."""

    gbps: dict[str, list[float]] = field(default_factory=dict)
    ratios: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.gbps.setdefault(name, []).append(value)

    def pair(self, name: str, value: float) -> None:
        self.ratios.setdefault(name, []).append(value)


def timed(fn: Callable[[], object]) -> float:
    with no_gc():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def granted(refs: Sequence[SlotRef | None], what: str) -> list[SlotRef]:
    held = [r for r in refs if r is not None]
    if len(held) != len(refs):
        raise RuntimeError(f"{what}: the daemon granted {len(held)} of {len(refs)} slots")
    return held


class CountingClient(GrpcTierClient):
    """GrpcTierClient that counts the calls it makes, by request type."""

    def __init__(self, socket_path: Path, replica: str) -> None:
        super().__init__(socket_path, replica)
        self.calls: Counter[str] = Counter()

    def _rpc(self, method: Callable[..., R], request: Any, timeout: float | None = None) -> R:
        self.calls[type(request).__name__] += 1
        return super()._rpc(method, request, timeout)

    def _keys_call_async(
        self, method: Any, keys: Sequence[ChunkKey], refs: Sequence[SlotRef], convert: Any
    ) -> Pending[Any]:
        self.calls["pipelined"] += 1
        return super()._keys_call_async(method, keys, refs, convert)

    def traffic_since(self, before: Counter[str]) -> int:
        delta = self.calls - before
        return sum(n for name, n in delta.items() if name != HEARTBEAT)


# -- client B, in its own process ------------------------------------------------------------


def load_all(
    client: CountingClient,
    arena: ArenaMemory,
    keys: list[ChunkKey],
    chunk: int,
    dst: np.ndarray,
    verify: bool,
) -> tuple[float, int]:
    """Prefetch, copy out and release every key; returns seconds taken and calls made."""
    whole = np.frombuffer(arena.view(0, arena.size), dtype=np.uint8)
    if verify:
        dst.fill(0)
    before = client.calls.copy()

    def run() -> None:
        # one call per batch, in flight while the batch before it is copied out: it releases
        # the batch copied last and leases the one after the current
        done: list[SlotRef] = []
        leases = granted(client.lease(keys[:BATCH]), "prefetch")
        for first in range(0, len(keys), BATCH):
            following = keys[first + BATCH : first + 2 * BATCH]
            pending = client.lease_async(following, release=done)
            off = first * chunk
            for ref in leases:
                # numpy copies without the GIL, so the call in flight progresses meanwhile
                np.copyto(dst[off : off + chunk], whole[ref.offset : ref.offset + chunk])
                off += chunk
            done, leases = leases, granted(pending.result(), "prefetch")
        client.release(done)

    elapsed = timed(run)
    calls = client.traffic_since(before)
    n = len(keys) * chunk
    if verify and not np.array_equal(dst[:n], filled(n)):
        raise RuntimeError("client B read other bytes than client A stored")
    return elapsed, calls


def client_b(conn: Connection, socket_path: str, total: int) -> None:
    """Serve client A's requests to register and load until told to stop."""
    client = CountingClient(Path(socket_path), "bench-b")
    arena: ArenaMemory | None = None
    try:
        dst = touched(total)
        conn.send(("ok",))
        while True:
            request = conn.recv()
            if request[0] == "stop":
                break
            try:
                if request[0] == "register":
                    namespace = client.register_pool(
                        sixteen_layer_spec(f"bench-daemon-{request[1]}", request[1]), request[1]
                    )
                    if arena is None:
                        arena = ArenaMemory.attach(client.arena_path)
                    conn.send(("ok", namespace))
                elif request[0] == "load":
                    _, chunk, keys, verify = request
                    assert arena is not None
                    conn.send(("ok", *load_all(client, arena, keys, chunk, dst, verify)))
                else:
                    conn.send(("error", f"unknown request {request[0]!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        if arena is not None:
            arena.close()
        client.close()
        conn.close()


# -- the daemon, in its own process ----------------------------------------------------------


class DaemonProcess(KvtierdProcess):
    """kvtierd configured for the data-plane figures: one arena size, no clean reserve (nothing
    is written back while a client says it is busy)."""

    def __init__(
        self, root: Path, shm: Path, arena_bytes: int, commit_checksum: bool = True
    ) -> None:
        self.shm = shm
        self.socket_path = root / "kvtierd.sock"
        config = {
            "arena": {
                "path": str(shm),
                "size_bytes": arena_bytes,
                "extent_bytes": EXTENT,
                "min_slot_bytes": LOOKUP_CHUNK,
                "commit_checksum": commit_checksum,
            },
            "lmdb": {
                "path": str(root / "lmdb"),
                "budget_bytes": LMDB_BUDGET,
                "sync_interval_s": SYNC_INTERVAL_S,
            },
            "manager": {"clean_reserve": 0.0},
            "server": {
                "socket_path": str(self.socket_path),
                "admin_address": "127.0.0.1:0",
                "metrics_address": "127.0.0.1:0",
            },
        }
        super().__init__(root, config)


def metric_value(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    return None


# -- client A and the run --------------------------------------------------------------------


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

        def run() -> None:
            # one call per batch, in flight while a batch is copied in: it commits the batch
            # written last and reserves the one after the current
            written: list[SlotRef] = []
            refs = granted(client.reserve(keys[:BATCH]), "reserve")
            for first in range(0, len(keys), BATCH):
                following = keys[first + BATCH : first + 2 * BATCH]
                pending = client.reserve_async(following, commit=written)
                off = first * chunk
                for ref in refs:
                    np.copyto(whole[ref.offset : ref.offset + chunk], src[off : off + chunk])
                    off += chunk
                committed, grants = pending.result()
                if committed != len(written):
                    raise RuntimeError("the daemon did not commit every written slot")
                written, refs = refs, granted(grants, "reserve")
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
            s.pair("arena_store_vs_memcpy", store / base)
            s.pair("arena_load_vs_memcpy", load / base_load)
            s.pair("cross_process_arena_vs_memcpy", min(store / base, load / base_load))
            s.add("arena_store_no_checksum_gbps", self.total / plain_s / 1e9)
            s.pair("commit_checksum_arena_store_ratio", plain_s / store_s)
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

    def report(self) -> dict[str, Any]:
        per_size: dict[str, dict[str, float]] = {}
        for chunk, s in self.samples.items():
            row = {name: statistics.median(v) for name, v in s.gbps.items()}
            row.update({name: statistics.median(v) for name, v in s.ratios.items()})
            per_size[f"{chunk // MiB}MiB"] = row
        names = list(next(iter(per_size.values())))
        out: dict[str, Any] = {
            "mode": self.mode.name,
            "chunk_sizes_bytes": list(CHUNK_SIZES),
            "working_set_bytes": self.total,
            "repetitions": self.mode.reps,
            "chunks_per_call": BATCH,
            "lookup_runs_per_round": self.mode.lookup_runs,
            "store_commit_keys_per_call": STORE_BATCH,
            "store_commit_chunk_bytes": STORE_CHUNK,
            "store_commit_repetitions": self.mode.store_reps,
        }
        for name in names:
            out[name] = geomean([row[name] for row in per_size.values()])
        out.update(self.figures)
        chunks = self.rpc["chunks"]
        out["rpc_per_chunk_store"] = self.rpc["store_calls"] / chunks
        out["rpc_per_chunk_load"] = self.rpc["load_calls"] / chunks
        out["rpc_per_chunk"] = max(out["rpc_per_chunk_store"], out["rpc_per_chunk_load"])
        out["per_chunk_size"] = per_size
        out["daemon"] = self.daemon_figures
        out["targets"] = stated(TARGETS)
        out["targets_met"] = judged(out, TARGETS)
        self.phases["total_s"] = sum(self.phases.values())
        out["elapsed_s"] = self.phases
        return out


SIZE_ROWS = (
    ("memcpy_gbps", "memcpy, client A", "GB/s"),
    ("arena_store_gbps", "arena store, client A", "GB/s"),
    ("arena_load_gbps", "arena load, client B", "GB/s"),
    ("arena_transfer_gbps", "A -> B, slower side", "GB/s"),
    ("arena_transfer_serial_gbps", "A -> B, both phases", "GB/s"),
    ("arena_store_vs_memcpy", "arena store / memcpy", "x"),
    ("arena_load_vs_memcpy", "arena load / memcpy", "x"),
    ("cross_process_arena_vs_memcpy", "A -> B / memcpy", "x"),
    ("arena_store_no_checksum_gbps", "arena store, no checksum", "GB/s"),
    ("commit_checksum_arena_store_ratio", "store, checksum / none", "x"),
)
ROWS = (
    ("lookup_8192_keys_p50_us", "lookup 8192 keys, p50", "us", ".0f"),
    ("lookup_8192_keys_p99_us", "lookup 8192 keys, p99", "us", ".0f"),
    ("lookup_8192_keys_mean_us", "lookup 8192 keys, mean", "us", ".0f"),
    ("lookup_1_key_p50_us", "lookup 1 key, p50", "us", ".0f"),
    ("store_commit_chunks_per_s", "reserve + commit", "chunks/s", ".0f"),
    ("store_commit_chunks_per_s_no_checksum", "same, no checksum", "chunks/s", ".0f"),
    ("commit_checksum_store_ratio", "same, checksum / none", "x", ".3f"),
    ("rpc_per_chunk_store", "calls per chunk, store", "", ".4f"),
    ("rpc_per_chunk_load", "calls per chunk, load", "", ".4f"),
    ("rpc_per_chunk", "calls per chunk", "", ".4f"),
)


def target_cell(result: dict[str, Any], key: str) -> str:
    return judged_cell(TARGETS, result["targets_met"], key)


def table(result: dict[str, Any]) -> str:
    sizes = list(result["per_chunk_size"])
    head = f"{'':34}" + "".join(f"{s:>9}" for s in sizes) + f"{'overall':>9}  target"
    lines = [
        f"kvtierd data plane, {result['mode']} mode: {result['working_set_bytes'] // MiB} MiB "
        f"working set, {result['repetitions']} repetitions, {result['chunks_per_call']} chunks "
        "per call, medians",
        head,
        "-" * len(head),
    ]
    for key, label, unit in SIZE_ROWS:
        cells = "".join(f"{result['per_chunk_size'][s][key]:9.2f}" for s in sizes)
        lines.append(
            f"{label + ' (' + unit + ')':34}{cells}{result[key]:9.2f}  {target_cell(result, key)}"
        )
    for key, label, unit, fmt in ROWS:
        name = f"{label} ({unit})" if unit else label
        value = format(result[key], fmt)
        lines.append(f"{name:34}{'':{9 * len(sizes)}}{value:>9}  {target_cell(result, key)}")
    daemon = result["daemon"]
    lines.append(
        f"kvtierd: ready in {daemon['start_s']:.2f} s, exited {daemon['exit_code']} "
        f"{daemon['shutdown_s']:.2f} s after SIGTERM"
    )
    lines.append(f"elapsed: {result['elapsed_s']['total_s']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller working set, fewer reps")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    logging.getLogger("kvtier").setLevel(logging.WARNING)
    log.setLevel(logging.INFO)
    bench = Bench(QUICK if args.quick else FULL)
    try:
        bench.run()
    finally:
        bench.close()
    result = bench.report()
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=False)
        sys.stdout.write("\n")
    else:
        print(table(result))
    daemon = result["daemon"]
    return 0 if daemon["exit_code"] == 0 and daemon["no_checksum_exit_code"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
