"""`InProcessClient`: the `TierClient` protocol (`kvtier.protocol`) served by a TierManager in
this process (embedded mode). The daemon serves the same protocol over gRPC (`kvtier.rpc`).

Chunk bytes always travel through the arena, which a client maps by path (`arena_path`) and
addresses with the offsets in each `SlotRef`; `ArenaMemory` maps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from kvtier.journal import ChunkEvents
from kvtier.keys import ChunkKey, NamespaceSpec
from kvtier.protocol import Answer, DraftState, LookupResult, SlotRef
from kvtier.tiers.arena import ArenaMemory

if TYPE_CHECKING:  # the manager is handed in: importing this module loads no tier
    from kvtier.manager import ManagerStats, TierManager

__all__ = ["ArenaMemory", "InProcessClient"]

T = TypeVar("T")


class Ready(Generic[T]):
    """An answer there already (in-process calls)."""

    def __init__(self, value: T) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def result(self) -> T:
        return self._value


class InProcessClient:
    """Embedded mode: the TierManager lives in this process."""

    def __init__(self, manager: TierManager, replica: str = "default") -> None:
        self.manager = manager
        self.replica = replica

    @property
    def arena_path(self) -> Path:
        return self.manager.cpu.memory.path

    @property
    def serving(self) -> bool:
        return True  # every call is a function call here

    def register_pool(self, spec: NamespaceSpec, chunk_bytes: int) -> bytes:
        return self.manager.register_pool(spec, chunk_bytes)

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        return self.manager.lookup(keys)

    def release_then_lookup_and_load(
        self, refs: Sequence[SlotRef], keys: Sequence[ChunkKey]
    ) -> tuple[LookupResult, list[SlotRef | None]]:
        self.manager.release(refs)
        return self.manager.lookup_then_load(keys, self.replica)

    def reserve(self, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        return self.manager.reserve(keys, self.replica)

    def commit(self, refs: Sequence[SlotRef]) -> int:
        return self.manager.commit(refs)

    def abort(self, refs: Sequence[SlotRef]) -> None:
        self.manager.abort(refs)

    def load(self, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        return self.manager.load(keys, self.replica)

    def commit_then_reserve(
        self, refs: Sequence[SlotRef], keys: Sequence[ChunkKey]
    ) -> tuple[int, list[SlotRef | None]]:
        return self.manager.commit(refs), self.manager.reserve(keys, self.replica)

    def release_then_load(
        self, refs: Sequence[SlotRef], keys: Sequence[ChunkKey]
    ) -> list[SlotRef | None]:
        self.manager.release(refs)
        return self.manager.load(keys, self.replica)

    def release(self, refs: Sequence[SlotRef]) -> None:
        self.manager.release(refs)

    def promote(self, keys: Sequence[ChunkKey]) -> int:
        return self.manager.promote(keys, self.replica)

    def draft_states(self, refresh: bool = False) -> dict[bytes, DraftState]:
        return self.manager.draft_states()

    def report_hits(self, every_s: float = 0.0) -> None:
        pass  # every lookup here is a call

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
