"""`InProcessClient`: the `TierClient` protocol (`kvtier.core.protocol`) served by a TierManager in
this process (embedded mode). The daemon serves the same protocol over gRPC (`kvtier.rpc`).

Chunk bytes always travel through the arena, which a client maps by path (`arena_path`) and
addresses with the offsets in each `SlotRef`; `ArenaMemory` maps it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.core.costs import CostSnapshot, EngineTimings
from kvtier.core.journal import ChunkEvents
from kvtier.core.keys import ChunkKey, NamespaceSpec
from kvtier.core.protocol import (
    Answer,
    DraftState,
    FailedChunk,
    LookupResult,
    Ready,
    SlotRef,
    TierClient,
)
from kvtier.tiers.arena import ArenaAtPath, ArenaMemory
from kvtier.tiers.lmdb_reader import (
    LmdbReader,
    LmdbSnapshot,
    failure_of,
    reader_at,
    release_reader,
)

if TYPE_CHECKING:  # the manager is handed in: importing this module loads no tier
    from kvtier.core.config import KVTierConfig
    from kvtier.tiering.manager import ManagerStats, TierManager

__all__ = [
    "ArenaAtPath",
    "ArenaMemory",
    "InProcessClient",
    "LmdbReader",
    "LmdbSnapshot",
    "SharedClient",
    "embedded",
    "failure_of",
    "reader_at",
    "release_reader",
    "shared_embedded",
]


class InProcessClient(TierClient):
    """Embedded mode: the TierManager lives in this process."""

    def __init__(self, manager: TierManager, replica: str = "default") -> None:
        self.manager = manager
        self.replica = replica

    @property
    def arena_path(self) -> Path:
        return self.manager.cpu.memory.path

    @property
    def lmdb_path(self) -> Path | None:
        lmdb = self.manager.lmdb
        return None if lmdb is None else lmdb.config.path

    @property
    def object_tier(self) -> bool:
        return self.manager.object is not None

    @property
    def serving(self) -> bool:
        return True  # every call is a function call here

    def register_pool(self, spec: NamespaceSpec, chunk_bytes: int) -> bytes:
        return self.manager.register_pool(spec, chunk_bytes)

    def lookup_unleased(
        self,
        keys: Sequence[ChunkKey],
        release: Sequence[SlotRef],
        again: bool,
        verify: bool,
        probe_wait: bool = True,
    ) -> LookupResult:
        if release:
            self.manager.release(release)
        return self.manager.lookup(keys, again=again, verify=verify, probe_wait=probe_wait)

    def lookup_leasing(
        self,
        keys: Sequence[ChunkKey],
        release: Sequence[SlotRef],
        again: bool,
        verify: bool,
        probe_wait: bool = True,
        in_lmdb: bool = False,
    ) -> tuple[LookupResult, list[SlotRef | None]]:
        self.manager.release(release)
        return self.manager.lookup_leasing(
            keys, self.replica, again=again, verify=verify, probe_wait=probe_wait, in_lmdb=in_lmdb
        )

    def reserve_slots(self, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        return self.manager.reserve(keys, self.replica)

    def reserve_committing(
        self, keys: Sequence[ChunkKey], commit: Sequence[SlotRef]
    ) -> tuple[int, list[SlotRef | None]]:
        return self.manager.commit(commit), self.manager.reserve(keys, self.replica)

    def commit(self, refs: Sequence[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        return self.manager.commit(refs, lineages)

    def abort(self, refs: Sequence[SlotRef]) -> None:
        self.manager.abort(refs)

    def lease(
        self, keys: Sequence[ChunkKey], *, release: Sequence[SlotRef] = (), in_lmdb: bool = False
    ) -> list[SlotRef | None]:
        if release:
            self.manager.release(release)
        return self.manager.lease(keys, self.replica, in_lmdb=in_lmdb)

    def release(self, refs: Sequence[SlotRef]) -> None:
        self.manager.release(refs)

    def promote(self, keys: Sequence[ChunkKey]) -> int:
        return self.manager.promote(keys, self.replica)

    def draft_states(self, refresh: bool = False) -> dict[bytes, DraftState]:
        return self.manager.draft_states()

    def quarantine_namespace(self, namespace: bytes, reason: str) -> None:
        source = f"replica {self.replica}, embedded in pid {os.getpid()}"
        self.manager.quarantines.add(namespace, reason, source)

    def quarantined(self) -> frozenset[bytes]:
        return self.manager.quarantines.namespaces

    def coded(self) -> dict[bytes, float]:
        return self.manager.registry.coded(self.manager.config.lower_codecs)

    def report_hits(self, every_s: float = 0.0) -> None:
        pass  # every lookup here is a call

    def set_busy(self, busy: bool) -> None:
        pass  # the caller runs the engine: it decides when to flush

    def report_timings(self, timings: EngineTimings) -> None:
        self.manager.costs.reported(timings)

    def costs(self) -> CostSnapshot | None:
        return self.manager.costs.snapshot()

    def report_failed(self, chunks: Sequence[FailedChunk]) -> None:
        self.manager.integrity.submit(chunks, f"replica {self.replica}")

    def lookup_behind(
        self, keys: Sequence[ChunkKey], again: bool = False, verify: bool = False
    ) -> Answer[LookupResult]:
        # answered in the caller's thread: a probe of the object store is not waited for
        return Ready(self.manager.lookup(keys, again=again, verify=verify, probe_wait=False))

    def in_arena(self, keys: Sequence[ChunkKey]) -> list[SlotRef] | None:
        return None  # a lookup here is no dearer

    def chunk_events(self, cursor: int) -> Answer[ChunkEvents]:
        return Ready(self.manager.chunk_events(cursor))

    def stats(self) -> ManagerStats:
        return self.manager.stats()

    @property
    def arena_bytes(self) -> int:
        return self.manager.cpu.memory.size

    def writeback_pending(self) -> int:
        """Committed arena chunks not yet written to lmdb."""
        return self.manager.cpu.writeback_pending()

    def flush(self, timeout: float = 30.0) -> bool:
        """Write dirty arena chunks to lmdb until none is left or ``timeout`` passed (0: one
        transaction); True when none is left."""
        return self.manager.flush(timeout)

    def close(self) -> None:
        self.manager.close()


class SharedClient(InProcessClient):
    """An embedded client over the one tier manager of its arena in this process, which the
    connectors of one engine share (its KV and its encoder cache): an arena has one owner. The
    manager closes with the last of its clients."""

    def __init__(self, manager: TierManager, replica: str, arena: Path) -> None:
        super().__init__(manager, replica)
        self._arena = arena
        self._closed = False

    def close(self) -> None:
        with _shared_lock:
            if self._closed:
                return
            self._closed = True
            held = _shared[self._arena]
            held.users -= 1
            if held.users:
                return
            del _shared[self._arena]
        self.manager.close()


@dataclass
class _Held:
    manager: TierManager
    users: int


_shared_lock = threading.Lock()
_shared: dict[Path, _Held] = {}


def embedded(config: KVTierConfig, replica: str = "default") -> InProcessClient:
    """Embedded mode: a client over a tier manager of its own, opened from ``config``."""
    from kvtier.tiering.manager import TierManager  # here: importing this module loads no tier

    return InProcessClient(TierManager(config), replica)


def shared_embedded(config: KVTierConfig, replica: str = "default") -> SharedClient:
    """Embedded mode: a client over this process's tier manager of ``config``'s arena, opened
    from ``config`` by the first caller (later callers' other settings are not applied)."""
    from kvtier.tiering.manager import TierManager

    arena = config.arena.path.resolve()
    with _shared_lock:
        held = _shared.get(arena)
        if held is None:
            held = _shared[arena] = _Held(TierManager(config), 0)
        held.users += 1
        return SharedClient(held.manager, replica, arena)
