"""The data-plane client: the TierClient protocol served by kvtierd over its unix socket,
composed of the channel (`channel.DaemonChannel`), the session (`session.DaemonSession`), what
it reports besides its calls (`reports.Reports`) and its view of the arena
(`arena_view.ArenaView`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from kvtier.api.v1 import tier_pb2
from kvtier.core import wire
from kvtier.core.codec import chunk_events_from, grants_from, lookup_from, ref_to
from kvtier.core.costs import CostSnapshot, EngineTimings
from kvtier.core.errors import InvalidRequestError, KVTierError
from kvtier.core.journal import ChunkEvents
from kvtier.core.keys import ChunkKey, NamespaceSpec
from kvtier.core.memory import keep_freed_pages
from kvtier.core.protocol import (
    Answer,
    DraftState,
    FailedChunk,
    IndexedRef,
    LookupResult,
    Ready,
    SlotRef,
    TierClient,
    TierCode,
    settle,
)
from kvtier.rpc.arena_view import ArenaView
from kvtier.rpc.calls import Breaker, Deadlines, Pending
from kvtier.rpc.channel import DaemonChannel
from kvtier.rpc.reports import Reports
from kvtier.rpc.session import DaemonSession

_LOOKUP_LEASE = tier_pb2.LookupRequest.LEASE_FIELD_NUMBER
_LOOKUP_AGAIN = tier_pb2.LookupRequest.AGAIN_FIELD_NUMBER
_LOOKUP_VERIFY = tier_pb2.LookupRequest.VERIFY_FIELD_NUMBER
_LOOKUP_NO_PROBE_WAIT = tier_pb2.LookupRequest.NO_PROBE_WAIT_FIELD_NUMBER
_LOOKUP_LEASE_IN_LMDB = tier_pb2.LookupRequest.LEASE_IN_LMDB_FIELD_NUMBER
_PREFETCH_IN_LMDB = tier_pb2.PrefetchRequest.IN_LMDB_FIELD_NUMBER
_IN_ARENA = int(TierCode.CPU)


class GrpcTierClient(TierClient):
    """The TierClient protocol served by kvtierd over its unix socket."""

    def __init__(
        self,
        socket_path: Path,
        replica: str,
        engine_id: str = "",
        tp_rank: int = 0,
        pp_rank: int = 0,
        timeout_s: float = 10.0,
        tune_memory: bool = True,
        deadlines: Deadlines | None = None,
    ) -> None:
        """``timeout_s`` bounds every call, unless ``deadlines`` are given (see there)."""
        if tune_memory:
            keep_freed_pages()  # see kvtier.core.memory: halves the cost of large batches here
        self._channel = DaemonChannel(socket_path, timeout_s, deadlines)
        self._reports = Reports(self._send_hits)
        self._arena = ArenaView()
        self._session = DaemonSession(
            self._channel,
            socket_path,
            replica,
            (engine_id, tp_rank, pp_rank),
            self._reports,
            self._arena,
        )

    @property
    def target(self) -> str:
        return self._channel.target

    @property
    def replica(self) -> str:
        return self._session.replica

    @property
    def session_id(self) -> str:
        return self._session.id

    def session_mark(self) -> tuple[str, int] | None:
        return self._session.mark()

    @property
    def arena_inode(self) -> int:
        return self._session.arena_inode

    @property
    def breaker(self) -> Breaker | None:
        """Open while kvtierd does not answer in time; None without deadlines."""
        return self._channel.breaker

    @property
    def serving(self) -> bool:
        """False while the breaker is open: every call would fail at once."""
        return self._channel.serving

    @property
    def arena_path(self) -> Path:
        if self._session.arena_path is None:
            raise KVTierError("register a pool first: the arena path comes with the session")
        return self._session.arena_path

    @property
    def lmdb_path(self) -> Path | None:
        return self._session.lmdb_path

    @property
    def object_tier(self) -> bool:
        return self._session.object_tier

    def register_pool(self, spec: NamespaceSpec, chunk_bytes: int) -> bytes:
        """Add a pool to this client's session (opening one if needed); returns its namespace."""
        return self._session.register_pool(spec, chunk_bytes)

    def draft_states(self, refresh: bool = False) -> dict[bytes, DraftState]:
        """The daemon's draft pools, as of the last heartbeat; ``refresh`` asks now."""
        if refresh:
            self._session.heartbeat()
        return dict(self._session.drafts)

    def quarantined(self) -> frozenset[bytes]:
        """The daemon's quarantined namespaces, as of the last heartbeat."""
        return self._session.quarantined

    def costs(self) -> CostSnapshot | None:
        """The daemon's measured costs, as of the last heartbeat."""
        return self._session.costs

    def coded(self) -> dict[bytes, float]:
        """The registered namespaces the daemon's tiers below the arena store coded, with each
        one's error bound."""
        return dict(self._session.coded)

    def _encode(
        self, keys: Sequence[ChunkKey], refs: Sequence[SlotRef], flags: Sequence[int] = ()
    ) -> bytes:
        key_bytes = len(keys[0]) if keys else 0
        packed = b"".join(keys)
        if len(packed) != key_bytes * len(keys):  # cheaper than checking every key
            raise InvalidRequestError("keys of one batch must share one length")
        encoded_refs = [ref_to(r).SerializeToString() for r in refs]
        return wire.key_request(self.session_id, key_bytes, packed, encoded_refs, flags=flags)

    def _keys_call(
        self,
        method: grpc.UnaryUnaryMultiCallable[bytes, Any],
        keys: Sequence[ChunkKey],
        refs: Sequence[SlotRef] = (),
        flags: Sequence[int] = (),
        timeout: float | None = None,
    ) -> Any:
        deadline = timeout or self._channel.lookup_s
        # encoded on each try: a new session has another id
        return self._session.in_session(
            lambda: self._channel.call(method, self._encode(keys, refs, flags), deadline)
        )

    def _send_hits(
        self, keys: Sequence[ChunkKey], release: Sequence[SlotRef], flags: tuple[int, ...]
    ) -> Pending[Any]:
        return self._channel.behind(self._channel.lookup, self._encode(keys, release, flags))

    def quarantine_namespace(self, namespace: bytes, reason: str) -> None:
        request = tier_pb2.QuarantineNamespaceRequest(
            session_id=self.session_id, namespace=namespace, reason=reason
        )
        stub = self._channel.stub
        self._session.in_session(lambda: self._channel.call(stub.QuarantineNamespace, request))

    def lookup_unleased(
        self,
        keys: Sequence[ChunkKey],
        release: Sequence[SlotRef],
        again: bool,
        verify: bool,
        probe_wait: bool = True,
    ) -> LookupResult:
        flags = (*_counting(again, verify), *_probing(probe_wait))
        lookup = self._channel.lookup
        return lookup_from(self._keys_call(lookup, keys, self._leased(release), flags))

    def lookup_behind(
        self, keys: Sequence[ChunkKey], again: bool = False, verify: bool = False
    ) -> Pending[LookupResult]:
        self._channel.check()  # nothing queues behind a daemon that does not answer
        future = self._channel.submit(
            self._keys_call, self._channel.lookup, keys, (), _counting(again, verify)
        )
        return Pending(future, lookup_from, self.target)

    def lookup_leasing(
        self,
        keys: Sequence[ChunkKey],
        release: Sequence[SlotRef],
        again: bool,
        verify: bool,
        probe_wait: bool = True,
        in_lmdb: bool = False,
    ) -> tuple[LookupResult, list[SlotRef | None]]:
        """The part of a hit the arena holds is answered from its key index, with no call and
        no lease: whoever copies a slot checks its generation afterwards anyway, and a call
        made now would compete with that copy for the CPU (it cost more than the call itself).
        kvtierd is asked only about the keys past it; `report_hits` tells it of the rest later."""
        flags = _counting(again, verify)
        self._channel.check()  # no hit, at once; ``release`` stays the caller's
        found = self._arena.find(keys, self._session.quarantined) or []
        if keys and len(found) == len(keys):
            # the leases handed back end with the next report: no call now
            self._reports.answered(flags, keys, self._leased(release))
            return LookupResult(len(found), bytes([_IN_ARENA]) * len(found)), list(found)
        owned = self._reports.take_due()
        ended = [*owned, *self._leased(release)]
        rest = keys[len(found) :]
        try:
            lookup = self._channel.lookup
            asked = (_LOOKUP_LEASE, *flags, *_probing(probe_wait))
            asked += (_LOOKUP_LEASE_IN_LMDB,) if in_lmdb else ()
            response = self._keys_call(lookup, rest, ended, asked)
        except KVTierError:
            self._reports.due_again(owned)  # these end with the next call; ``release``
            raise  # stays the caller's
        result, leases = lookup_from(response), grants_from(response.leases)
        if not found:
            return result, leases
        self._reports.answered(flags, keys[: len(found)])
        codes = bytes([_IN_ARENA]) * len(found) + result.tier_codes
        hit = LookupResult(len(found) + result.hits, codes, result.pending)
        return hit, [*found, *leases]

    def set_busy(self, busy: bool) -> None:
        """Told to kvtierd by the next heartbeat; a lookup or reserve says busy at once."""
        self._reports.set_busy(busy)

    def report_timings(self, timings: EngineTimings) -> None:
        self._reports.add_timings(timings)

    def report_failed(self, chunks: Sequence[FailedChunk]) -> None:
        self._reports.add_failed(chunks)

    def report_hits(self, every_s: float = 0.0) -> None:
        """Tell kvtierd of the hits the index answered since the last report, at most every
        ``every_s``, without waiting: it counts them, and leasing them and ending the leases
        at once refreshes their recency. Leases handed back meanwhile end with it. Raises
        what the previous report met."""
        self._reports.send_hits(every_s)

    def in_arena(self, keys: Sequence[ChunkKey]) -> list[SlotRef] | None:
        found = self._arena.find(keys, self._session.quarantined)
        return None if found is None else list(found)

    @staticmethod
    def _leased(refs: Sequence[SlotRef]) -> list[SlotRef]:
        """The refs that stand for leases: never one the index answered, which could end
        another holder's lease on the same slot."""
        return [r for r in refs if not isinstance(r, IndexedRef)]

    def reserve_slots(self, keys: Sequence[ChunkKey]) -> list[SlotRef | None]:
        reserve, store_s = self._channel.reserve, self._channel.store_s
        return grants_from(self._keys_call(reserve, keys, timeout=store_s).grants)

    def reserve_committing(
        self, keys: Sequence[ChunkKey], commit: Sequence[SlotRef]
    ) -> tuple[int, list[SlotRef | None]]:
        """Commit written slots and reserve others, in one call."""
        reserve, store_s = self._channel.reserve, self._channel.store_s
        response = self._keys_call(reserve, keys, commit, timeout=store_s)
        return response.committed, grants_from(response.grants)

    def lease(
        self, keys: Sequence[ChunkKey], *, release: Sequence[SlotRef] = (), in_lmdb: bool = False
    ) -> list[SlotRef | None]:
        """Lease the keys' chunks; with ``release``, end those leases first, in one call."""
        flags = (_PREFETCH_IN_LMDB,) if in_lmdb else ()
        response = self._keys_call(self._channel.prefetch, keys, self._leased(release), flags)
        return grants_from(response.leases)

    def commit(self, refs: Sequence[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        request = tier_pb2.CommitRequest(
            session_id=self.session_id, refs=[ref_to(r) for r in refs], lineage=lineages
        )
        commit = self._channel.stub.Commit
        response = self._session.with_old_refs(lambda: self._channel.call(commit, request))
        return response.committed if response is not None else 0

    def abort(self, refs: Sequence[SlotRef]) -> None:
        request = tier_pb2.AbortRequest(session_id=self.session_id, refs=[ref_to(r) for r in refs])
        abort = self._channel.stub.Abort
        self._session.with_old_refs(lambda: self._channel.call(abort, request))

    def settle_behind(
        self,
        *,
        commit: Sequence[SlotRef] = (),
        lineages: Sequence[bytes] = (),
        abort: Sequence[SlotRef] = (),
        release: Sequence[SlotRef] = (),
    ) -> Pending[int]:
        self._channel.check()  # nothing queues behind a daemon that does not answer
        handed = (list(commit), list(lineages), list(abort), list(release))
        return Pending(self._channel.submit(settle, self, *handed), int, self.target)

    def reserve_behind(self, keys: Sequence[ChunkKey]) -> Answer[list[SlotRef | None]]:
        if not keys:
            return Ready([])
        self._channel.check()
        return Pending(self._channel.submit(self.reserve_slots, list(keys)), list, self.target)

    def promote(self, keys: Sequence[ChunkKey]) -> int:
        return int(self._keys_call(self._channel.promote, keys).queued)

    def chunk_events(self, cursor: int) -> Pending[ChunkEvents]:
        request = tier_pb2.ChunkEventsRequest(session_id=self.session_id, cursor=cursor)
        return self._channel.behind(self._channel.stub.ChunkEvents, request, chunk_events_from)

    def release(self, refs: Sequence[SlotRef]) -> None:
        leased = self._leased(refs)
        if not leased:
            return  # refs the index answered: no lease to end, no call
        request = tier_pb2.ReleaseRequest(session_id=self.session_id, refs=map(ref_to, leased))
        release = self._channel.stub.Release
        self._session.with_old_refs(lambda: self._channel.call(release, request))

    def close(self) -> None:
        self._session.stop_heartbeats()
        self._channel.stop_calls()
        self._session.end()
        self._channel.close()
        self._arena.close()


def _counting(again: bool, verify: bool) -> tuple[int, ...]:
    """The flags that say how kvtierd counts a lookup: not again (asked again while it waits),
    or as verified rather than hit (sampled for verification)."""
    return (*((_LOOKUP_AGAIN,) if again else ()), *((_LOOKUP_VERIFY,) if verify else ()))


def _probing(probe_wait: bool) -> tuple[int, ...]:
    """The flag that tells kvtierd not to wait for a probe of the object store: an old
    kvtierd ignores it and waits up to its budget, as it always did."""
    return () if probe_wait else (_LOOKUP_NO_PROBE_WAIT,)
