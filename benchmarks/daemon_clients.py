"""The daemon benchmark's clients: a gRPC client that counts its calls, and client B, which loads
in its own process what client A stored, and the daemon it talks to."""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.daemon_settings import (
    BATCH,
    EXTENT,
    LMDB_BUDGET,
    LOOKUP_CHUNK,
    SYNC_INTERVAL_S,
)
from benchmarks.harness.buffers import filled, timed, touched
from benchmarks.harness.kvtierd import KvtierdProcess
from benchmarks.harness.specs import sixteen_layer_spec
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import SlotRef
from kvtier.rpc import GrpcTierClient
from kvtier.tiers.arena import ArenaMemory


def granted(refs: Sequence[SlotRef | None], what: str) -> list[SlotRef]:
    held = [r for r in refs if r is not None]
    if len(held) != len(refs):
        raise RuntimeError(f"{what}: the daemon granted {len(held)} of {len(refs)} slots")
    return held


class CountingClient(GrpcTierClient):
    """GrpcTierClient that counts the data-plane calls the transfers make, by method, and
    makes a transfer's next call on a thread of its own, so that it overlaps copying a batch
    (numpy copies without the GIL)."""

    def __init__(self, socket_path: Path, replica: str) -> None:
        super().__init__(socket_path, replica)
        self.calls: Counter[str] = Counter()
        self._pipeline = ThreadPoolExecutor(1, thread_name_prefix="bench-call")

    def reserve(self, keys: Sequence[ChunkKey], **kwargs: Any) -> Any:
        self.calls["reserve"] += 1
        return super().reserve(keys, **kwargs)

    def lease(self, keys: Sequence[ChunkKey], **kwargs: Any) -> list[SlotRef | None]:
        self.calls["lease"] += 1
        return super().lease(keys, **kwargs)

    def commit(self, refs: Sequence[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        self.calls["commit"] += 1
        return super().commit(refs, lineages)

    def release(self, refs: Sequence[SlotRef]) -> None:
        self.calls["release"] += 1
        super().release(refs)

    def reserve_behind(
        self, keys: Sequence[ChunkKey], commit: Sequence[SlotRef]
    ) -> Future[tuple[int, list[SlotRef | None]]]:
        """`reserve` with ``commit``, without waiting."""
        return self._pipeline.submit(self.reserve, keys, commit=commit)

    def lease_behind(
        self, keys: Sequence[ChunkKey], release: Sequence[SlotRef]
    ) -> Future[list[SlotRef | None]]:
        """`lease` with ``release``, without waiting."""
        return self._pipeline.submit(self.lease, keys, release=release)

    def traffic_since(self, before: Counter[str]) -> int:
        return sum((self.calls - before).values())

    def close(self) -> None:
        self._pipeline.shutdown(wait=True)
        super().close()


Answer = Callable[[], list[SlotRef]]
"""Waits for a call in flight and answers its slots."""


def in_batches(
    keys: Sequence[ChunkKey],
    first: list[SlotRef],
    behind: Callable[[Sequence[ChunkKey], list[SlotRef]], Answer],
    copy: Callable[[int, list[SlotRef]], None],
) -> list[SlotRef]:
    """Copy the slots of ``keys`` batch after batch (``copy(index of its first key, slots)``),
    ``first`` the first batch's, with one call per batch in flight meanwhile: ``behind(keys,
    copied)`` hands back the batch copied last and asks for the slots of the batch after the
    current one. Returns the last batch copied, not handed back."""
    copied: list[SlotRef] = []
    held = first
    for start in range(0, len(keys), BATCH):
        answer = behind(keys[start + BATCH : start + 2 * BATCH], copied)
        copy(start, held)  # numpy copies without the GIL: the call in flight progresses
        copied, held = held, answer()
    return copied


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

    def lease_behind(following: Sequence[ChunkKey], done: list[SlotRef]) -> Answer:
        pending = client.lease_behind(following, release=done)
        return lambda: granted(pending.result(), "prefetch")

    def copy_out(first: int, leases: list[SlotRef]) -> None:
        off = first * chunk
        for ref in leases:
            np.copyto(dst[off : off + chunk], whole[ref.offset : ref.offset + chunk])
            off += chunk

    def run() -> None:
        leases = granted(client.lease(keys[:BATCH]), "prefetch")
        client.release(in_batches(keys, leases, lease_behind, copy_out))

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
