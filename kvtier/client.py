"""TierClient: the protocol the connector and the CLI speak, whatever serves it.

`InProcessClient` serves it from a TierManager in this process (embedded mode). The daemon serves
the same protocol over gRPC; chunk bytes always travel through the arena, which a client maps by
path (`arena_path`) and addresses with the offsets in each `SlotRef`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar, runtime_checkable

from kvtier.journal import ChunkEvents
from kvtier.keys import ChunkKey, NamespaceSpec
from kvtier.manager import DraftState, LookupResult, ManagerStats, TierManager
from kvtier.tiers.arena import ArenaMemory
from kvtier.tiers.cpu import SlotRef

__all__ = ["Answer", "ArenaMemory", "ChunkEvents", "InProcessClient", "SlotRef", "TierClient"]

T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")


class Answer(Protocol[T_co]):
    """A call's answer, which may still be on its way."""

    def done(self) -> bool: ...

    def result(self) -> T_co: ...


class Ready(Generic[T]):
    """An answer there already (in-process calls)."""

    def __init__(self, value: T) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def result(self) -> T:
        return self._value


@runtime_checkable
class TierClient(Protocol):
    @property
    def arena_path(self) -> Path: ...

    @property
    def serving(self) -> bool:
        """False while the tiers do not answer in time: every call would fail at once, so a
        caller that must not wait serves without them."""
        ...

    def register_pool(self, spec: NamespaceSpec, chunk_bytes: int) -> bytes: ...

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult: ...

    def release_then_lookup_and_load(
        self, refs: Sequence[SlotRef], keys: Sequence[ChunkKey]
    ) -> tuple[LookupResult, list[SlotRef | None]]:
        """End leases, look the keys up, and lease the found chunks when the arena holds them
        all, in one call."""
        ...

    def reserve(self, keys: Sequence[ChunkKey]) -> list[SlotRef | None]: ...

    def commit(self, refs: Sequence[SlotRef]) -> int: ...

    def abort(self, refs: Sequence[SlotRef]) -> None: ...

    def commit_then_reserve(
        self, refs: Sequence[SlotRef], keys: Sequence[ChunkKey]
    ) -> tuple[int, list[SlotRef | None]]: ...

    def release_then_load(
        self, refs: Sequence[SlotRef], keys: Sequence[ChunkKey]
    ) -> list[SlotRef | None]: ...

    def load(self, keys: Sequence[ChunkKey]) -> list[SlotRef | None]: ...

    def release(self, refs: Sequence[SlotRef]) -> None: ...

    def promote(self, keys: Sequence[ChunkKey]) -> int:
        """Queue chunks of slower tiers for the arena without waiting; returns how many."""
        ...

    def draft_states(self, refresh: bool = False) -> dict[bytes, DraftState]:
        """Each draft pool's revision and swap state, by lineage; cheap unless ``refresh``."""
        ...

    def report_hits(self, every_s: float = 0.0) -> None:
        """Tell the tiers of hits answered without a call, at most every ``every_s``, without
        waiting (a client whose answers all come from a call has none)."""
        ...

    def chunk_events(self, cursor: int) -> Answer[ChunkEvents]:
        """Chunks of this client's pools that entered or left the arena and lmdb since
        ``cursor`` (negative: from now), without waiting for the answer."""
        ...

    def close(self) -> None: ...


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

    def close(self) -> None:
        self.manager.close()
