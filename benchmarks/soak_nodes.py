"""The soak's nodes: a real kvtierd each (`KvtierdProcess`), driven through kvtier's own
data-plane client as an engine drives it: look a prompt's chunks up, lease and copy out what
is there, reserve, fill and commit what is not. Also what a node's vitals are (RSS, open files,
lmdb map use, event-log bytes, namespaces and slot classes), and a reader of its lmdb map that
dies inside its read transaction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import psutil

from benchmarks.harness.buffers import filled
from benchmarks.harness.kvtierd import KvtierdProcess
from benchmarks.harness.sizes import KiB
from benchmarks.harness.specs import small_spec
from kvtier.bench.scrape import Samples, parse_counters, total
from kvtier.core.encoder import encoder_spec
from kvtier.core.keys import NAMESPACE_BYTES, ChunkKey, NamespaceSpec, Pool, make_key
from kvtier.core.lineage import BlockLineage
from kvtier.core.protocol import SlotRef
from kvtier.rpc import GrpcTierClient
from kvtier.tiers.arena import ArenaMemory

ASK_AGAIN_S = 0.03
"""A lookup that says the store is still being probed is asked once more after this."""

# A reader as the connector is one: it maps lmdb read-only, beside kvtierd, and reads in a
# transaction; this one says so on stdout and then waits, inside it, for its SIGKILL.
_READER = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=True, max_dbs=16, subdir=True)
txn = env.begin()
sum(1 for _ in zip(range(64), txn.cursor().iternext(keys=True, values=False)))
print("reading", flush=True)
time.sleep(3600)
"""


@dataclass(frozen=True)
class Model:
    """One pool of one model, as an engine registers it: a new model brings a new chunk size."""

    name: str
    chunk_bytes: int
    pool: Pool = Pool.TARGET
    revision: str = "r1"

    def spec(self) -> NamespaceSpec:
        if self.pool is Pool.ENCODER:
            # rows of 1 KiB (512 fp16 values): chunk_bytes // 1 KiB rows per part
            return encoder_spec(
                model=self.name,
                encoder_revision=self.revision,
                dtype="float16",
                width=512,
                rows_per_part=self.chunk_bytes // KiB,
                processor="soak",
            )
        spec = small_spec(self.name, self.chunk_bytes)
        if self.pool is Pool.DRAFT:
            return dataclasses.replace(
                spec,
                pool=Pool.DRAFT,
                draft_model=f"{self.name}-draft",
                draft_revision=self.revision,
            )
        if self.pool is Pool.HIDDEN:
            return dataclasses.replace(spec, pool=Pool.HIDDEN, attention="hidden_states=0")
        return spec


@dataclass
class Served:
    """What serving some prompts did, in chunks."""

    asked: int = 0
    hits: int = 0
    stored: int = 0
    refused: int = 0
    """Asked to be stored, and no slot granted."""
    refused_with_room: int = 0
    """Of those, refused while the arena held clean chunks other than the prompt's own, which
    it could have evicted. A refusal while every other chunk is dirty is right: write-back is
    writing them to lmdb (a refused store presses it), and only then may they go."""
    errors: int = 0
    """Calls that failed (a daemon being killed or restarted)."""

    def add(self, other: Served) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def hit_rate(self) -> float:
        return self.hits / self.asked if self.asked else 0.0


@dataclass(frozen=True)
class Vitals:
    rss_bytes: int
    own_bytes: int
    """kvtierd's own memory (RssAnon): its RSS without the arena's shared pages and lmdb's
    mapped file pages, which fill up to their configured sizes as chunks come and go."""
    open_files: int
    lmdb_map_bytes: int
    event_log_bytes: int
    namespaces: float
    slot_classes: float
    free_extents: float


def chunk_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def lineage(keys: list[ChunkKey], i: int) -> bytes:
    """Chunk ``i`` of a prompt as the connector describes it with its commit: one block, whose
    hash is the chunk's, after the block before it; what the fleet's events announce."""
    parent = keys[i - 1][NAMESPACE_BYTES:] if i else None
    block = BlockLineage((keys[i][NAMESPACE_BYTES:],), parent, tuple(range(16)), 16)
    return block.encode()


def own_memory(pid: int) -> int:
    """A process's anonymous resident memory (RssAnon in /proc/<pid>/status), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * KiB
    return 0


def map_bytes(path: Path) -> int:
    """Pages an lmdb environment has used so far (its high-water mark in the map), read from
    its meta pages without taking a reader slot."""
    if not (path / "data.mdb").exists():
        return 0
    env = lmdb.open(str(path), readonly=True, lock=False, subdir=True, max_dbs=16)
    try:
        return int((env.info()["last_pgno"] + 1) * env.stat()["psize"])
    finally:
        env.close()


class Node:
    """One kvtierd and the engine that uses it."""

    def __init__(self, name: str, root: Path, config: dict[str, Any], env: dict[str, str]):
        self.name = name
        self.config = config
        self.daemon = KvtierdProcess(root, config)
        self.daemon.env = env
        self.client: GrpcTierClient | None = None
        self.arena: ArenaMemory | None = None
        self.whole = np.empty(0, np.uint8)
        self.namespaces: dict[Model, bytes] = {}
        self.patterns: dict[int, np.ndarray] = {}

    @property
    def lmdb_path(self) -> Path:
        return Path(self.config["lmdb"]["path"])

    def start(self) -> None:
        self.daemon.start()
        self.reconnect()

    def _disconnect(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        self.whole = np.empty(0, np.uint8)
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def reconnect(self) -> None:
        """The engine restarts (as for another model): a new session, registering anew."""
        self._disconnect()
        self.client = GrpcTierClient(Path(self.config["server"]["socket_path"]), self.name)
        self.namespaces.clear()

    def restart(self, kill: bool) -> None:
        """SIGKILL (or stop) kvtierd and start it again; the engine reconnects."""
        self._disconnect()
        if kill:
            self.daemon.kill()
        else:
            self.daemon.stop()
        self.start()

    def stop(self) -> None:
        self._disconnect()
        self.daemon.stop()

    def namespace(self, model: Model) -> bytes:
        ns = self.namespaces.get(model)
        if ns is None:
            assert self.client is not None
            ns = self.client.register_pool(model.spec(), model.chunk_bytes)
            self.namespaces[model] = ns
            if self.arena is None:
                self.arena = ArenaMemory.attach(self.client.arena_path)
                self.whole = np.frombuffer(self.arena.view(0, self.arena.size), np.uint8)
        return ns

    def keys(self, model: Model, prompt: str, chunks: int) -> list[ChunkKey]:
        ns = self.namespace(model)
        return [make_key(ns, chunk_hash(f"{prompt}/{i}")) for i in range(chunks)]

    def serve(self, model: Model, prompts: list[str], chunks: int) -> Served:
        """Serve each prompt of ``chunks`` chunks of ``model``, as an engine would."""
        served = Served()
        for prompt in prompts:
            try:
                served.add(self._serve_one(model, self.keys(model, prompt, chunks)))
            except Exception:  # a daemon killed under the call, a registration refused
                served.errors += 1
                served.asked += chunks
        return served

    def _serve_one(self, model: Model, keys: list[ChunkKey]) -> Served:
        client = self.client
        assert client is not None
        result = client.lookup(keys)
        if result.pending:
            time.sleep(ASK_AGAIN_S)
            result = client.lookup(keys, again=True)
        held = 0
        if result.hits:
            leases = client.lease(keys[: result.hits])
            got = [r for r in leases if r is not None]
            while held < len(leases) and leases[held] is not None:
                held += 1
            scratch = np.empty(model.chunk_bytes, np.uint8)
            for ref in got:  # the engine copies the chunk into its KV cache
                np.copyto(scratch, self.whole[ref.offset : ref.offset + model.chunk_bytes])
            client.release(got)
        missing = keys[held:]
        grants = client.reserve(missing) if missing else []
        granted: list[SlotRef] = [g for g in grants if g is not None]
        pattern = self.patterns.get(model.chunk_bytes)
        if pattern is None:
            pattern = self.patterns[model.chunk_bytes] = filled(model.chunk_bytes)
        for ref in granted:
            np.copyto(self.whole[ref.offset : ref.offset + model.chunk_bytes], pattern)
        targets = model.pool is Pool.TARGET  # the pool whose chunks a router indexes
        lineages = [lineage(keys, keys.index(ref.key)) for ref in granted] if targets else []
        stored = client.commit(granted, lineages) if granted else 0
        refused = len(missing) - len(granted)
        room = refused if refused and self._other_clean_chunks(keys) > 0 else 0
        return Served(len(keys), held, stored, refused, room)

    def _other_clean_chunks(self, keys: list[ChunkKey]) -> float:
        """Chunks the arena holds that are not of these keys' prompt and are written back
        (all but kvtierd's write-back queue): those it may evict."""
        assert self.client is not None
        mine = self.client.lookup(keys).tier_codes.count(1)  # TierCode.CPU
        samples = self.samples()
        dirty = total(samples, "kvtier_queue_depth_chunks", queue="writeback")
        return total(samples, "kvtier_tier_chunks", tier="cpu") - mine - dirty

    def samples(self) -> Samples:
        return parse_counters(self.daemon.metrics())

    def vitals(self) -> Vitals:
        pid = self.daemon.pid
        assert pid is not None
        proc = psutil.Process(pid)
        samples = self.samples()
        events = self.config.get("events", {}).get("log_path")
        return Vitals(
            rss_bytes=int(proc.memory_info().rss),
            own_bytes=own_memory(pid),
            open_files=int(proc.num_fds()),
            lmdb_map_bytes=map_bytes(self.lmdb_path),
            event_log_bytes=map_bytes(Path(events)) if events else 0,
            namespaces=total(samples, "kvtier_namespaces"),
            slot_classes=total(samples, "kvtier_arena_slot_classes"),
            free_extents=total(samples, "kvtier_arena_free_extents"),
        )

    def kill_readers(self, count: int, timeout_s: float = 30.0) -> int:
        """Start ``count`` readers of this node's lmdb map and SIGKILL each inside its read;
        returns how many were killed there."""
        killed = 0
        for _ in range(count):
            proc = subprocess.Popen(
                [sys.executable, "-c", _READER, str(self.lmdb_path)],
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
            )
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
            inside = bool(ready) and proc.stdout.readline().strip() == "reading"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            killed += inside
        return killed


def fill_disk(directory: Path, leave_bytes: int) -> Path:
    """A ballast file taking all but ``leave_bytes`` of ``directory``'s filesystem."""
    ballast = directory / "ballast"
    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    with open(ballast, "wb") as out, contextlib.suppress(OSError):
        os.posix_fallocate(out.fileno(), 0, max(0, free - leave_bytes))
    return ballast
