"""What crosses the process boundary between an engine and the tiers: slot references, lookup
answers, draft states, tier codes, and `TierClient`, the protocol a client speaks whatever serves
it (a TierManager in this process, or kvtierd over gRPC).

Both sides import this module; it imports nothing of kvtier but keys and the journal, so a client
never loads the tiers or the server. Chunk bytes never travel here: a client maps the arena by
path (`TierClient.arena_path`) and addresses it with the offsets in each `SlotRef`, and reads a
chunk leased in lmdb from lmdb's map (`TierClient.lmdb_path`).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Literal, Protocol, TypeVar, overload, runtime_checkable

from kvtier.core.costs import CostSnapshot, EngineTimings
from kvtier.core.journal import ChunkEvents
from kvtier.core.keys import ChunkKey, NamespaceSpec

__all__ = [
    "LMDB_SLOT",
    "Answer",
    "DraftRevision",
    "DraftState",
    "FailedChunk",
    "Failure",
    "IndexedRef",
    "LookupResult",
    "Ready",
    "SlotRef",
    "TierClient",
    "TierCode",
    "in_lmdb",
    "leasable_hit",
    "settle",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class TierCode(enum.IntEnum):
    """A tier as lookup answers and chunk events carry it, one byte per chunk. The values are
    those of the wire's `Tier` enum."""

    CPU = 1
    LMDB = 2
    OBJECT = 3

    @property
    def tier(self) -> str:
        """The tier's name, as tiers and stats call it ("cpu", "lmdb", "object")."""
        return self.name.lower()


class Failure(enum.IntEnum):
    """What an engine's verification of a chunk it read found wrong; the values are those of
    the wire's `Failure` enum."""

    HEADER = 1
    """Magic, version, namespace or hash, lengths, or the header's own checksum."""
    PAYLOAD = 2
    """The payload's checksum."""
    GENERATION = 3
    """An arena slot's generation moved under the read."""


@dataclass(frozen=True, slots=True)
class FailedChunk:
    """A chunk an engine read itself and found failing verification (`TierClient.report_failed`)."""

    key: ChunkKey
    tier: TierCode
    what: Failure


# plain ints and names: the lookup path reads one per chunk
_NAMES = {int(code): code.tier for code in TierCode}
_CPU = int(TierCode.CPU)
_LMDB = int(TierCode.LMDB)


@dataclass(frozen=True, slots=True)
class SlotRef:
    """Where a reserved or leased chunk lives in the arena; valid while ``generation`` holds."""

    key: ChunkKey
    slot: int
    offset: int
    nbytes: int
    generation: int
    lease: int = field(default=0, compare=False)
    """The daemon's id of this lease within its session (0: none), so a retried release ends
    this lease and never another one on the same slot."""


@dataclass(frozen=True, slots=True)
class IndexedRef(SlotRef):
    """A ref read from the arena's key index: no lease stands behind it, so it is never
    released (and never equals the lease of another holder on the same slot)."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    hits: int
    """Length of the longest prefix of the asked keys present in some tier."""
    tier_codes: bytes
    """Tier of each of those ``hits`` chunks (the fastest one holding it), a `TierCode` value
    per byte: compact for batches of thousands."""
    pending: bool = False
    """The object store is still being probed past ``hits``: asking again may find more."""
    from_store: int = 0
    """Of the hits, chunks a probe brought from the object store since a lookup last found
    them: lmdb holds them now, but they count as the store's hits (kvtierd's own figure)."""

    @property
    def tiers(self) -> list[str]:
        return [_NAMES[c] for c in self.tier_codes]

    @property
    def by_tier(self) -> dict[str, int]:
        return hits_by_tier(self.tier_codes, self.from_store)


def hits_by_tier(tier_codes: bytes, from_store: int = 0) -> dict[str, int]:
    """Hits per tier name, ``from_store`` of them counted as the object store's: a probe
    brought them into lmdb (or the arena, once promoted) before the lookup found them."""
    counted = {tier: tier_codes.count(code) for code, tier in _NAMES.items()}
    for tier in ("lmdb", "cpu"):
        moved = min(from_store, counted[tier])
        counted[tier] -= moved
        counted["object"] += moved
        from_store -= moved
    return counted


LMDB_SLOT = (1 << 64) - 1
"""The slot of a lease granted in lmdb (`TierClient.lease` with ``in_lmdb``): no arena slot holds
the chunk, the client reads it from lmdb's map by its key (`kvtier.tiers.lmdb_reader`)."""


def in_lmdb(ref: SlotRef) -> bool:
    """Whether ``ref`` is a lease granted in lmdb rather than on an arena slot."""
    return ref.slot == LMDB_SLOT


def leasable_hit(result: LookupResult, in_lmdb: bool = False) -> int:
    """How many chunks a lookup found, when the arena (``in_lmdb``: or lmdb, whose map the
    caller reads) holds them all; else 0: leases would only be given back."""
    codes = result.tier_codes
    return len(codes) if not codes.strip(bytes([_CPU, _LMDB] if in_lmdb else [_CPU])) else 0


@dataclass(frozen=True, slots=True)
class DraftState:
    """Where one draft pool stands, as engines follow it."""

    revision: str
    swapping: bool = False
    """A swap has begun and not been committed: the draft's weights are in flux, so engines
    neither load nor store its chunks."""
    epoch: int = 0
    """Bumped by every begin and every change of revision, so a client sees A -> B -> A."""


@dataclass(frozen=True, slots=True)
class DraftRevision:
    """One revision of a draft pool, and the chunks each tier holds of it."""

    model: str
    draft_model: str
    revision: str
    namespace: bytes
    current: bool
    chunks: dict[str, int]


class Answer(Protocol[T_co]):
    """A call's answer, which may still be on its way."""

    def done(self) -> bool: ...

    def wait(self, timeout_s: float | None) -> bool:
        """Whether the answer is there, after waiting for it at most ``timeout_s``."""
        ...

    def result(self) -> T_co: ...


class Ready(Generic[T]):
    """An answer there already (in-process calls)."""

    def __init__(self, value: T) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None) -> bool:
        return True

    def result(self) -> T:
        return self._value


@runtime_checkable
class TierClient(Protocol):
    @property
    def arena_path(self) -> Path: ...

    @property
    def arena_inode(self) -> int:
        """The arena file this client's session holds slots in, by inode; 0 where not known,
        or where the client owns its arena. A worker that finds another file at the path (a
        restarted kvtierd's, before this client's session follows it) copies none of them."""
        return 0

    @property
    def lmdb_path(self) -> Path | None:
        """lmdb's environment, for leases granted there (None: no lmdb tier, or one not to be
        read beside its writer)."""
        ...

    @property
    def object_tier(self) -> bool:
        """Whether the tiers may have an object store: a lookup may then find chunks neither
        the arena nor lmdb holds (True where it is not known)."""
        ...

    @property
    def serving(self) -> bool:
        """False while the tiers do not answer in time: every call would fail at once, so a
        caller that must not wait serves without them."""
        ...

    def register_pool(self, spec: NamespaceSpec, chunk_bytes: int) -> bytes: ...

    def coded(self) -> dict[bytes, float]:
        """Registered namespaces that the tiers below the arena store coded (int8, fp8), each
        with the largest relative error a hit of theirs may show for it
        (`kvtier.core.kvcodec.error_bound`)."""
        ...

    @overload
    def lookup(
        self,
        keys: Sequence[ChunkKey],
        *,
        release: Sequence[SlotRef] = ...,
        lease: Literal[False] = ...,
        again: bool = ...,
        verify: bool = ...,
        probe_wait: bool = ...,
    ) -> LookupResult: ...

    @overload
    def lookup(
        self,
        keys: Sequence[ChunkKey],
        *,
        release: Sequence[SlotRef] = ...,
        lease: Literal[True],
        again: bool = ...,
        verify: bool = ...,
        probe_wait: bool = ...,
        in_lmdb: bool = ...,
    ) -> tuple[LookupResult, list[SlotRef | None]]: ...

    def lookup(
        self,
        keys: Sequence[ChunkKey],
        *,
        release: Sequence[SlotRef] = (),
        lease: bool = False,
        again: bool = False,
        verify: bool = False,
        probe_wait: bool = True,
        in_lmdb: bool = False,
    ) -> LookupResult | tuple[LookupResult, list[SlotRef | None]]:
        """Look the keys up, first ending the leases ``release``. With ``lease``, also lease
        the found chunks when the arena (``in_lmdb``: or lmdb, as `lease`) holds them all, in
        one call. ``again``: the same request asks again while it waits; its keys and hits are
        not counted twice. ``verify``: the request is sampled for verification, so what is
        found is counted as verified, not as hits: none of it is served. ``probe_wait``: wait,
        up to the object store's lookup budget, for a probe of the store past what the arena
        and lmdb hold; a caller inside an engine's step turns it off and asks again while the
        answer is ``pending``.

        A client that subclasses this protocol inherits this method (and `reserve`) and serves
        its two forms, `lookup_unleased` and `lookup_leasing`: the overloads are written once."""
        if lease:
            return self.lookup_leasing(keys, release, again, verify, probe_wait, in_lmdb)
        return self.lookup_unleased(keys, release, again, verify, probe_wait)

    def lookup_unleased(
        self,
        keys: Sequence[ChunkKey],
        release: Sequence[SlotRef],
        again: bool,
        verify: bool,
        probe_wait: bool = True,
    ) -> LookupResult:
        """`lookup` without ``lease``."""
        ...

    def lookup_leasing(
        self,
        keys: Sequence[ChunkKey],
        release: Sequence[SlotRef],
        again: bool,
        verify: bool,
        probe_wait: bool = True,
        in_lmdb: bool = False,
    ) -> tuple[LookupResult, list[SlotRef | None]]:
        """`lookup` with ``lease``: the answer and the lease of each found chunk."""
        ...

    def lookup_behind(
        self, keys: Sequence[ChunkKey], again: bool = False, verify: bool = False
    ) -> Answer[LookupResult]:
        """`lookup` without a lease, without waiting for the answer: a caller that must not
        wait asks again later, or waits as long as it may. A client that answers it in the
        caller's thread does not wait for a probe of the object store either."""
        ...

    @overload
    def reserve(self, keys: Sequence[ChunkKey], *, commit: None = ...) -> list[SlotRef | None]: ...

    @overload
    def reserve(
        self, keys: Sequence[ChunkKey], *, commit: Sequence[SlotRef]
    ) -> tuple[int, list[SlotRef | None]]: ...

    def reserve(
        self, keys: Sequence[ChunkKey], *, commit: Sequence[SlotRef] | None = None
    ) -> list[SlotRef | None] | tuple[int, list[SlotRef | None]]:
        """Arena slots to write. With ``commit``, first commit those written slots, in one
        call, and answer how many were committed too."""
        if commit is None:
            return self.reserve_slots(keys)
        return self.reserve_committing(keys, commit)

    def reserve_slots(self, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        """`reserve` without ``commit``."""
        ...

    def reserve_committing(
        self, keys: Sequence[ChunkKey], commit: Sequence[SlotRef]
    ) -> tuple[int, list[SlotRef | None]]:
        """`reserve` with ``commit``: how many were committed, and the slots."""
        ...

    def session_mark(self) -> Hashable | None:
        """What a reservation made now is held under (kvtierd's client: its session and the
        arena's file): one made under a mark is held, and its slot may be written, while the
        mark stays the same. None while that cannot be told (kvtierd not heard from lately), and
        where reservations are function calls."""
        return None

    def reserve_behind(self, keys: Sequence[ChunkKey]) -> Answer[list[SlotRef | None]] | None:
        """`reserve` without waiting (kvtierd's client sends it on its call thread): for blank
        keys (`kvtier.core.keys.blank_key`), slots reserved ahead of the stores that name their
        chunks when they commit, and for the chunks a step stores that no such slot was held
        for, copied a step later. None where a reservation is a function call: nothing to gain
        by reserving ahead (asking for no keys tells which, without a call)."""
        return None

    def commit(self, refs: Sequence[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        """Commit written slots; ``lineages``, beside ``refs``: each chunk's encoded
        `kvtier.core.lineage.BlockLineage` (empty for none), for routers."""
        ...

    def abort(self, refs: Sequence[SlotRef]) -> None: ...

    def settle_behind(
        self,
        *,
        commit: Sequence[SlotRef] = (),
        lineages: Sequence[bytes] = (),
        abort: Sequence[SlotRef] = (),
        release: Sequence[SlotRef] = (),
    ) -> Answer[int]:
        """`commit` (with ``lineages``), `abort` and `release`, in that order, without waiting
        where the client can: kvtierd's client sends them on its call thread, behind the calls
        queued before, so no engine step waits for its daemon to answer them. The answer is how
        many were committed; one that fails may have handed back any part of them, and handing
        each back again is safe. Here: made now (an in-process client has no call to wait for)."""
        return Ready(settle(self, commit, lineages, abort, release))

    def lease(
        self, keys: Sequence[ChunkKey], *, release: Sequence[SlotRef] = (), in_lmdb: bool = False
    ) -> list[SlotRef | None]:
        """Lease the keys' chunks, first ending the leases ``release``, in one call. With
        ``in_lmdb``, a chunk lmdb holds and the arena does not is leased there (`in_lmdb`): the
        caller reads it from `lmdb_path` itself, and it takes no arena slot."""
        ...

    def release(self, refs: Sequence[SlotRef]) -> None: ...

    def promote(self, keys: Sequence[ChunkKey]) -> int:
        """Queue chunks of slower tiers for the arena without waiting; returns how many."""
        ...

    def draft_states(self, refresh: bool = False) -> dict[bytes, DraftState]:
        """Each draft pool's revision and swap state, by lineage; cheap unless ``refresh``."""
        ...

    def quarantine_namespace(self, namespace: bytes, reason: str) -> None:
        """Stop serving one of this client's namespaces, found to hold wrong KV: for every
        client of these tiers, until an admin lifts it."""
        ...

    def quarantined(self) -> frozenset[bytes]:
        """The namespaces quarantined now (in sidecar mode, as of the last heartbeat)."""
        ...

    def report_hits(self, every_s: float = 0.0) -> None:
        """Tell the tiers of hits answered without a call, at most every ``every_s``, without
        waiting (a client whose answers all come from a call has none)."""
        ...

    def report_timings(self, timings: EngineTimings) -> None:
        """What the engine measured (its loads per tier, its prefill), for the tiers' cost
        estimates (`kvtier locate`); never waits: in sidecar mode it goes with a heartbeat."""
        ...

    def costs(self) -> CostSnapshot | None:
        """What loads from each tier and prefilling cost, as the tiers measured them, read
        without a call (in sidecar mode, as of the last heartbeat; None before the first)."""
        ...

    def report_failed(self, chunks: Sequence[FailedChunk]) -> None:
        """Chunks the engine read and found failing verification: the tiers verify each again
        themselves, and drop and count those that fail. Never waits: in sidecar mode they go
        with the next heartbeat."""
        ...

    def set_busy(self, busy: bool) -> None:
        """Whether this client's engine holds requests now. Tiers in another process write
        the arena to lmdb while no engine is busy, so that it takes no CPU from a forward."""
        ...

    def in_arena(self, keys: Sequence[ChunkKey]) -> list[SlotRef] | None:
        """The slot of each key of the longest prefix the arena holds, read without a call and
        without a lease (a hint: the slot may be reused after); None where this client cannot
        read the arena so."""
        ...

    def chunk_events(self, cursor: int) -> Answer[ChunkEvents]:
        """Chunks of this client's pools that entered or left the arena and lmdb since
        ``cursor`` (negative: from now), without waiting for the answer."""
        ...

    def close(self) -> None: ...


def settle(
    client: TierClient,
    commit: Sequence[SlotRef] = (),
    lineages: Sequence[bytes] = (),
    abort: Sequence[SlotRef] = (),
    release: Sequence[SlotRef] = (),
) -> int:
    """`TierClient.settle_behind`'s calls, made now; how many were committed."""
    committed = client.commit(commit, lineages) if commit else 0
    if abort:
        client.abort(abort)
    if release:
        client.release(release)
    return committed


# What a tier reports of itself: the admin API's stats and the metrics read these.


@dataclass(slots=True)
class UsageStats:
    used_bytes: int = 0
    chunks: int = 0
    capacity_bytes: int = 0


@dataclass(slots=True)
class TierStats:
    tier: str
    capacity_bytes: int
    used_bytes: int
    chunks: int
    pools: dict[str, UsageStats] = field(default_factory=dict)
    replicas: dict[tuple[str, str], UsageStats] = field(default_factory=dict)
    """Keyed by (replica, pool); capacity_bytes there is the replica's quota."""
    counters: Counter[str] = field(default_factory=Counter)
    """hits, misses, stores, store_rejected, evictions_<reason>, corrupt, ..."""
    learned: dict[str, UsageStats] = field(default_factory=dict)
    """Per pool, chunks of the object store that other nodes uploaded and this one only learned
    of: not its own, so neither in ``pools`` nor in ``used_bytes``."""
