"""A short synthetic load on a live kvtierd, from a thread of the test process.

Two replicas store, look up, load and promote chunks of a target and a draft pool; now and then
the arena and lmdb are emptied through the admin API, so that lookups hit every tier (lmdb, then
the object store). The second replica registers a newer draft revision: one draft swap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtier.core.costs import EngineTimings
from kvtier.core.keys import ChunkKey, NamespaceSpec
from kvtier.rpc import AdminClient, GrpcTierClient
from kvtier.tiers.arena import ArenaMemory
from tests.support import draft_spec, keys_for, payload_for, target_spec

CHUNK = 256 << 10
DRAFT_CHUNK = 64 << 10
PER_ROUND = 4


def engine_timings(loaded: int, nbytes: int) -> EngineTimings:
    """What an engine would report of a round: its loads from the arena, and prefill steps of
    a whole prompt and of a suffix."""
    timings = EngineTimings()
    timings.prefilled(PER_ROUND * 64, 0.01)
    timings.prefilled(16, 0.002)
    timings.loaded("cpu", loaded, loaded * nbytes, 0.0005 * loaded)
    return timings


class Load(threading.Thread):
    def __init__(self, socket: Path, admin: Callable[[], AdminClient]) -> None:
        super().__init__(name="operability-load", daemon=True)
        self.socket = socket
        self.admin = admin
        self.asked = 0
        self.hits = 0
        self.verified = 0
        self.rounds = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._round = threading.Lock()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No call in flight while the block runs."""
        with self._round:
            yield

    def stop(self) -> None:
        self._halt.set()
        self.join(30)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the tests that read the load
            self.error = exc

    def _run(self) -> None:
        admin = self.admin()
        clients = []
        pools: list[tuple[GrpcTierClient, list[tuple[bytes, int]]]] = []
        for replica, revision in (("dp0", "d1"), ("dp1", "d2")):
            client = GrpcTierClient(self.socket, replica, tune_memory=False)
            specs: list[tuple[NamespaceSpec, int]] = [
                (target_spec(), CHUNK),
                (draft_spec(draft_revision=revision), DRAFT_CHUNK),
            ]
            namespaces = [(client.register_pool(s, n), n) for s, n in specs]
            clients.append(client)
            pools.append((client, namespaces))
        arena = ArenaMemory.attach(clients[0].arena_path)
        try:
            while not self._halt.is_set():
                with self._round:
                    self._one_round(admin, arena, pools)
                self._halt.wait(0.05)
        finally:
            for client in clients:
                client.close()
            arena.close()
            admin.close()

    def _one_round(
        self,
        admin: AdminClient,
        arena: ArenaMemory,
        pools: list[tuple[GrpcTierClient, list[tuple[bytes, int]]]],
    ) -> None:
        r = self.rounds
        client, namespaces = pools[r % len(pools)]
        for namespace, nbytes in namespaces:
            fresh = keys_for(namespace, PER_ROUND, start=r * PER_ROUND)
            self._store(client, arena, fresh, nbytes)
            asked = keys_for(namespace, (r + 1) * PER_ROUND + 2)
            found = client.lookup(asked)
            self.asked += len(asked)
            self.hits += found.hits
            leases = [ref for ref in client.lease(asked[: max(1, found.hits // 2)]) if ref]
            client.release(leases)
            client.promote(asked[: found.hits])
            client.report_timings(engine_timings(len(leases), nbytes))
            if r % 4 == 1:  # a request sampled for verification: what it finds is not a hit
                self.asked += len(asked)
                self.verified += client.lookup(asked, verify=True).hits
        if r % 6 == 3:
            admin.evict(tier="cpu")  # next lookups hit lmdb
        if r % 6 == 5:
            admin.evict()  # and the object store
        self.rounds += 1

    @staticmethod
    def _store(
        client: GrpcTierClient, arena: ArenaMemory, keys: list[ChunkKey], nbytes: int
    ) -> None:
        refs = [ref for ref in client.reserve(keys) if ref is not None]
        for ref in refs:
            arena.view(ref.offset, ref.nbytes)[:] = payload_for(ref.key, nbytes)
        if refs:
            client.commit(refs)
