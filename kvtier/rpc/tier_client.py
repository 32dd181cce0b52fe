"""The data-plane client: the TierClient protocol served by kvtierd over its unix socket."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, overload

import grpc

from kvtier.api.v1 import tier_pb2
from kvtier.core import wire
from kvtier.core.codec import chunk_events_from, grants_from, lookup_from, ref_to
from kvtier.core.costs import EngineTimings
from kvtier.core.errors import InvalidRequestError, KVTierError, SessionNotFoundError
from kvtier.core.journal import ChunkEvents
from kvtier.core.keys import ChunkKey, cut_at_namespaces
from kvtier.core.protocol import FailedChunk, IndexedRef, LookupResult, SlotRef, TierCode
from kvtier.rpc.calls import Pending
from kvtier.rpc.session import DaemonSession

R = TypeVar("R")
_LOOKUP_LEASE = tier_pb2.LookupRequest.LEASE_FIELD_NUMBER
_LOOKUP_AGAIN = tier_pb2.LookupRequest.AGAIN_FIELD_NUMBER
_LOOKUP_SERVED = tier_pb2.LookupRequest.SERVED_FIELD_NUMBER
_LOOKUP_VERIFY = tier_pb2.LookupRequest.VERIFY_FIELD_NUMBER
_PREFETCH_IN_LMDB = tier_pb2.PrefetchRequest.IN_LMDB_FIELD_NUMBER
_IN_ARENA = int(TierCode.CPU)
_MAX_REPORT = 4096  # keys per report, under the daemon's batch limit
_ENDING_TIMEOUT_S = 1.0  # a daemon gone already: the session then ends at its timeout


class GrpcTierClient(DaemonSession):
    """The TierClient protocol served by kvtierd over its unix socket."""

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
        deadline = timeout or self._lookup_s
        # encoded on each try: a new session has another id
        return self._in_session(
            lambda: self._rpc(method, self._encode(keys, refs, flags), deadline)
        )

    def _keys_call_async(
        self,
        method: grpc.UnaryUnaryMultiCallable[bytes, Any],
        keys: Sequence[ChunkKey],
        refs: Sequence[SlotRef],
        convert: Callable[[Any], R],
        flags: Sequence[int] = (),
    ) -> Pending[R]:
        return self._behind(method, self._encode(keys, refs, flags), convert)

    def quarantine_namespace(self, namespace: bytes, reason: str) -> None:
        request = tier_pb2.QuarantineNamespaceRequest(
            session_id=self.session_id, namespace=namespace, reason=reason
        )
        self._in_session(lambda: self._rpc(self._stub.QuarantineNamespace, request))

    def quarantined(self) -> frozenset[bytes]:
        """The daemon's quarantined namespaces, as of the last heartbeat."""
        return self._quarantined

    def coded(self) -> dict[bytes, float]:
        """The registered namespaces the daemon's tiers below the arena store coded, with each
        one's error bound."""
        return dict(self._coded)

    @overload
    def lookup(
        self,
        keys: Sequence[ChunkKey],
        *,
        release: Sequence[SlotRef] = ...,
        lease: Literal[False] = ...,
        again: bool = ...,
        verify: bool = ...,
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
    ) -> tuple[LookupResult, list[SlotRef | None]]: ...

    def lookup(
        self,
        keys: Sequence[ChunkKey],
        *,
        release: Sequence[SlotRef] = (),
        lease: bool = False,
        again: bool = False,
        verify: bool = False,
    ) -> LookupResult | tuple[LookupResult, list[SlotRef | None]]:
        flags = _counting(again, verify)
        if not lease:
            return lookup_from(self._keys_call(self._lookup, keys, self._leased(release), flags))
        return self._lookup_leasing(release, keys, flags)

    def lookup_behind(
        self, keys: Sequence[ChunkKey], verify: bool = False
    ) -> Pending[LookupResult]:
        if self.breaker is not None:
            self.breaker.check()  # nothing queues behind a daemon that does not answer
        future = self._calls().submit(
            self._keys_call, self._lookup, keys, (), _counting(False, verify)
        )
        return Pending(future, lookup_from, self.target)

    def _lookup_leasing(
        self, refs: Sequence[SlotRef], keys: Sequence[ChunkKey], flags: tuple[int, ...]
    ) -> tuple[LookupResult, list[SlotRef | None]]:
        """The part of a hit the arena holds is answered from its key index, with no call and
        no lease: whoever copies a slot checks its generation afterwards anyway, and a call
        made now would compete with that copy for the CPU (it cost more than the call itself).
        kvtierd is asked only about the keys past it; `report_hits` tells it of the rest later."""
        if self.breaker is not None:
            self.breaker.check()  # no hit, at once; ``refs`` stay the caller's
        found = self._in_arena(keys)
        if keys and len(found) == len(keys):
            with self._reporting:
                self._due += self._leased(refs)  # with the next report: no call now
                self._hits.setdefault(tuple(flags), []).extend(keys)
            return LookupResult(len(found), bytes([_IN_ARENA]) * len(found)), list(found)
        with self._reporting:
            owned, self._due = self._due, []
        release = [*owned, *self._leased(refs)]
        rest = keys[len(found) :]
        try:
            response = self._keys_call(self._lookup, rest, release, (_LOOKUP_LEASE, *flags))
        except KVTierError:
            with self._reporting:
                self._due = owned + self._due  # these end with the next call; ``refs`` stay
            raise  # the caller's
        result, leases = lookup_from(response), grants_from(response.leases)
        if not found:
            return result, leases
        with self._reporting:
            self._hits.setdefault(tuple(flags), []).extend(keys[: len(found)])
        codes = bytes([_IN_ARENA]) * len(found) + result.tier_codes
        hit = LookupResult(len(found) + result.hits, codes, result.pending)
        return hit, [*found, *leases]

    def set_busy(self, busy: bool) -> None:
        """Told to kvtierd by the next heartbeat; a lookup or reserve says busy at once."""
        self._busy = busy

    def report_timings(self, timings: EngineTimings) -> None:
        with self._timings_lock:
            self._timings.merge(timings)

    def report_failed(self, chunks: Sequence[FailedChunk]) -> None:
        with self._timings_lock:
            room = _MAX_REPORT - len(self._failed)  # bounded while kvtierd is away
            self._failed.extend(chunks[: max(0, room)])

    def in_arena(self, keys: Sequence[ChunkKey]) -> list[SlotRef] | None:
        if self._arena is None:
            return None
        return list(self._in_arena(keys))

    def _in_arena(self, keys: Sequence[ChunkKey]) -> list[IndexedRef]:
        """The slot of each key of the longest prefix the arena holds, from its key index
        (none where the index cannot be read here), up to a quarantined namespace as kvtierd's
        own lookup stops there."""
        if self._arena is None or not keys:
            return []
        try:
            memory = self._arena.current()
        except KVTierError:
            return []
        refs = []
        for key in cut_at_namespaces(keys, self._quarantined):
            found = memory.find(key)
            if found is None:
                break
            slot, generation = found
            offset, nbytes = memory.slot_offset(slot), memory.slot_bytes(slot)
            refs.append(IndexedRef(key, slot, offset, nbytes, generation))
        return refs

    @staticmethod
    def _leased(refs: Sequence[SlotRef]) -> list[SlotRef]:
        """The refs that stand for leases: never one the index answered, which could end
        another holder's lease on the same slot."""
        return [r for r in refs if not isinstance(r, IndexedRef)]

    def report_hits(self, every_s: float = 0.0) -> None:
        """Tell kvtierd of the hits the index answered since the last report, at most every
        ``every_s``, without waiting: it counts them, and leasing them and ending the leases
        at once refreshes their recency. Leases handed back meanwhile end with it. Raises
        what the previous report met."""
        with self._reporting:
            self._report_held(every_s)

    def _report_held(self, every_s: float) -> None:
        now = time.monotonic()
        if now < self._next_report or (self._report is not None and not self._report.done()):
            return
        if self._report is not None:
            report, self._report = self._report, None
            try:
                report.result()
            except SessionNotFoundError:  # the next call opens a new one; its leases are gone
                pass
            except KVTierError:
                self._due = self._reported + self._due  # they end with the next report
                raise
        # one kind per report, first asked first: the others go with the next
        counting = next((kind for kind, held in self._hits.items() if held), ())
        held = self._hits.pop(counting, [])
        keys = held[:_MAX_REPORT]
        if held[_MAX_REPORT:]:
            self._hits[counting] = held[_MAX_REPORT:]
        flags = (_LOOKUP_SERVED, *counting)
        release, self._due = self._due, []
        if not keys and not release:
            return
        self._next_report = now + every_s
        try:
            self._report = self._behind(self._lookup, self._encode(keys, release, flags))
        except KVTierError:
            self._due = release + self._due
            raise
        self._reported = release

    @overload
    def reserve(self, keys: Sequence[ChunkKey], *, commit: None = ...) -> list[SlotRef | None]: ...

    @overload
    def reserve(
        self, keys: Sequence[ChunkKey], *, commit: Sequence[SlotRef]
    ) -> tuple[int, list[SlotRef | None]]: ...

    def reserve(
        self, keys: Sequence[ChunkKey], *, commit: Sequence[SlotRef] | None = None
    ) -> list[SlotRef | None] | tuple[int, list[SlotRef | None]]:
        """Reserve slots; with ``commit``, commit written slots first, in one call."""
        if commit is None:
            return grants_from(self._keys_call(self._reserve, keys, timeout=self._store_s).grants)
        response = self._keys_call(self._reserve, keys, commit, timeout=self._store_s)
        return response.committed, grants_from(response.grants)

    def lease(
        self, keys: Sequence[ChunkKey], *, release: Sequence[SlotRef] = (), in_lmdb: bool = False
    ) -> list[SlotRef | None]:
        """Lease the keys' chunks; with ``release``, end those leases first, in one call."""
        flags = (_PREFETCH_IN_LMDB,) if in_lmdb else ()
        response = self._keys_call(self._prefetch, keys, self._leased(release), flags)
        return grants_from(response.leases)

    def reserve_async(
        self, keys: Sequence[ChunkKey], *, commit: Sequence[SlotRef]
    ) -> Pending[tuple[int, list[SlotRef | None]]]:
        """`reserve` with ``commit`` without waiting, so the call overlaps copying a batch."""
        return self._keys_call_async(
            self._reserve, keys, commit, lambda r: (r.committed, grants_from(r.grants))
        )

    def lease_async(
        self, keys: Sequence[ChunkKey], *, release: Sequence[SlotRef] = ()
    ) -> Pending[list[SlotRef | None]]:
        """`lease` without waiting, so the call overlaps copying a batch."""
        return self._keys_call_async(
            self._prefetch, keys, self._leased(release), lambda r: grants_from(r.leases)
        )

    def _old_refs_call(self, call: Callable[[], R]) -> R | None:
        """Refs of a lost session are void: open a new session and report nothing done."""
        try:
            return call()
        except SessionNotFoundError:
            if self.breaker is None:
                self._reopen()
            else:  # the probe opens the new one
                self.breaker.trip("its session is gone")
            return None

    def commit(self, refs: Sequence[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        request = tier_pb2.CommitRequest(
            session_id=self.session_id, refs=[ref_to(r) for r in refs], lineage=lineages
        )
        response = self._old_refs_call(lambda: self._rpc(self._stub.Commit, request))
        return response.committed if response is not None else 0

    def abort(self, refs: Sequence[SlotRef]) -> None:
        request = tier_pb2.AbortRequest(session_id=self.session_id, refs=[ref_to(r) for r in refs])
        self._old_refs_call(lambda: self._rpc(self._stub.Abort, request))

    def promote(self, keys: Sequence[ChunkKey]) -> int:
        return int(self._keys_call(self._promote, keys).queued)

    def chunk_events(self, cursor: int) -> Pending[ChunkEvents]:
        request = tier_pb2.ChunkEventsRequest(session_id=self.session_id, cursor=cursor)
        return self._behind(self._stub.ChunkEvents, request, chunk_events_from)

    def release(self, refs: Sequence[SlotRef]) -> None:
        leased = self._leased(refs)
        if not leased:
            return  # refs the index answered: no lease to end, no call
        request = tier_pb2.ReleaseRequest(session_id=self.session_id, refs=map(ref_to, leased))
        self._old_refs_call(lambda: self._rpc(self._stub.Release, request))

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self._caller is not None:
            self._caller.shutdown(wait=True, cancel_futures=True)
        if self.session_id:  # kvtierd gives back what the session holds now, not at its timeout
            ending = tier_pb2.HeartbeatRequest(session_id=self.session_id, ending=True)
            with contextlib.suppress(grpc.RpcError):
                self._stub.Heartbeat(ending, timeout=_ENDING_TIMEOUT_S)
        self._channel.close()
        if self._arena is not None:
            self._arena.close()


def _counting(again: bool, verify: bool) -> tuple[int, ...]:
    """The flags that say how kvtierd counts a lookup: not again (asked again while it waits),
    or as verified rather than hit (sampled for verification)."""
    return (*((_LOOKUP_AGAIN,) if again else ()), *((_LOOKUP_VERIFY,) if verify else ()))
