"""Reservations asked for without waiting: the stores a step's stock had no slot for.

A step never waits for kvtierd to reserve what it stores. The chunks the stock cannot serve are
asked for in one call that goes on kvtierd's client's call thread (`TierClient.reserve_behind`),
and copied with the first step that finds the answer there (the next one, mostly). A full
block's content never changes while its request holds it, so the copy a step later reads the
same bytes, as long as the request still holds the block:
- a request preempted since loses its blocks: what was reserved for it is aborted;
- a request that finishes while asks are out for it keeps its blocks (vLLM frees them once the
  workers report it sent, `KVTierMetadata.sending`) until the step that copies them, or learns
  that none will be.
An answer is used only under the session and arena it was asked in (`TierClient.session_mark`);
kvtierd's client answers every call within its deadline, failed where it did not.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import Answer, SlotRef, TierClient
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls
from kvtier_vllm.shared.vllm_compat import preemptions


class Wanted(Protocol):
    """A chunk a step wants stored: the request whose blocks hold it."""

    @property
    def request(self) -> Any: ...


W = TypeVar("W", bound=Wanted)


@dataclass
class _Ask(Generic[W]):
    answer: Answer[list[SlotRef | None]]
    wanted: dict[ChunkKey, W]
    mark: Hashable
    requests: dict[str, tuple[Any, int]]
    """Per request id, the request and its preemptions when asked: a later one took its
    blocks."""

    abandoned: bool = False
    """Its step's metadata was dropped (a hook failed): what it answers is aborted."""

    def holds(self, request: Any) -> bool:
        """Whether ``request`` still holds the blocks it was asked for with."""
        return not self.abandoned and preemptions(request) == self.requests[request.request_id][1]


class StoreAsks(Generic[W]):
    """The reservations asked for over ``client`` and not yet answered, and the finished
    requests whose blocks are kept for them; a call that fails is reported to ``calls``, which
    also aborts what can no longer be written."""

    def __init__(self, client: TierClient, calls: TierCalls) -> None:
        self.client = client
        self.calls = calls
        self._out: list[_Ask[W]] = []
        self._kept: set[str] = set()
        """Finished requests whose blocks vLLM keeps for an ask still out."""

    def ask(self, wanted: Mapping[ChunkKey, W]) -> bool:
        """Ask for ``wanted``'s slots without waiting; False where that cannot be done (the
        client reserves by a function call, kvtierd was not heard from lately, or the call
        could not be sent): the caller reserves them in its step."""
        mark = self.client.session_mark()
        if mark is None:
            return False
        try:
            answer = self.client.reserve_behind(list(wanted))
        except KVTierError as exc:  # not sent: the breaker is open
            self.calls.failed("reserve", exc)
            return True  # as a failed reservation: nothing is stored
        if answer is None:
            return False
        requests = {
            w.request.request_id: (w.request, preemptions(w.request)) for w in wanted.values()
        }
        self._out.append(_Ask(answer, dict(wanted), mark, requests))
        return True

    def answered(self, wait_s: float = 0.0) -> Iterator[tuple[SlotRef, W]]:
        """Each slot answered whose request still holds its blocks, with what it was wanted
        for (waiting up to ``wait_s`` for the answers out); the slots of requests preempted
        since are aborted."""
        if not self._out:
            return
        mark = self.client.session_mark()
        deadline = time.monotonic() + wait_s
        out, self._out = self._out, []
        for ask in out:
            if not ask.answer.wait(max(0.0, deadline - time.monotonic())):
                self._out.append(ask)
                continue
            try:
                refs = ask.answer.result()
            except KVTierError as exc:
                self.calls.failed("reserve", exc)
                continue
            if ask.mark != mark:
                continue  # gone with the session or arena it was reserved in: never written
            gone: list[SlotRef] = []
            for store, ref in zip(ask.wanted.values(), refs, strict=True):
                if ref is None:
                    continue  # present already, or no room
                if ask.holds(store.request):
                    yield ref, store
                else:
                    gone.append(ref)
            if gone:
                self.calls.abort(gone)

    def keep(self, request_id: str) -> bool:
        """vLLM finished ``request_id``: whether its blocks are to be kept for an ask still out
        (then `released` names it once none is)."""
        if request_id in self._waiting_for():
            self._kept.add(request_id)
            return True
        return False

    def released(self) -> list[str]:
        """Finished requests kept for asks, none of them out any more: reported sent after the
        copies of the step they are handed to (its last call: a step that fails before it
        hands them to `abandon`)."""
        done = self._kept - self._waiting_for()
        self._kept -= done
        return sorted(done)

    def abandon(self) -> list[str]:
        """A step's metadata was dropped (a hook failed, and nothing of it is stored): every
        finished request kept, to report sent; what the asks out answer is aborted."""
        for ask in self._out:
            ask.abandoned = True
        kept, self._kept = sorted(self._kept), set()
        return kept

    def give_back(self) -> None:
        """At shutdown: abort the slots answered (those still out end with the session)."""
        refs = [ref for ref, _ in self.answered()]
        self._kept.clear()
        if refs:
            self.calls.abort(refs)

    def _waiting_for(self) -> set[str]:
        return {
            request_id
            for ask in self._out
            for request_id, (request, _) in ask.requests.items()
            if ask.holds(request)
        }
