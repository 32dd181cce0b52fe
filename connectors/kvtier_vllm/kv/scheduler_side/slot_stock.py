"""Arena slots reserved ahead of the stores that fill them, so that a step's stores take their
slots without waiting for kvtierd.

Each slot is reserved under a blank key of its namespace (`kvtier.core.keys.blank_key`); the
store that takes it names its chunk when it commits, and kvtierd frees the slot instead where
the arena holds that chunk already or lmdb keeps it. kvtierd holds at most an eighth of a pool's
slots blank, so that a stock never crowds out the stores. The stock is topped up with calls that
go without waiting (`TierClient.reserve_behind`), answered by the next steps. Per namespace it
holds twice what the busiest of the last `DEMAND_STEPS` steps stored, at most `MAX_STOCK`. A
slot asked for `MAX_AGE_S` ago goes back at the next step; an engine gone idle keeps its stock
until kvtierd aborts it, `kvtier.core.keys.BLANK_HOLD_S` after it was reserved (counted apart
from lost commits). A slot is used only under the session and arena it was reserved in, while
kvtierd was heard from lately (`TierClient.session_mark`): what a lost session or a restarted
kvtierd's old arena held is dropped, never written. A store the stock has no slot for is
reserved in its step. An embedded engine keeps no stock: its reservations are function calls.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, replace

from kvtier.core.errors import KVTierError
from kvtier.core.keys import (
    BLANK_HOLD_S,
    MIN_BLANK_HASH_BYTES,
    NAMESPACE_BYTES,
    ChunkKey,
    blank_key,
    namespace_of,
)
from kvtier.core.protocol import Answer, SlotRef, TierClient
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls

MAX_STOCK = 64
"""Slots held per namespace at most."""
MAX_AGE_S = BLANK_HOLD_S / 6
"""A slot held this long, counted from when it was asked for, goes back: well before kvtierd
would abort it (`kvtier.core.keys.BLANK_HOLD_S`), so no store ever writes a slot given away."""
DEMAND_STEPS = 16


@dataclass(frozen=True, slots=True)
class _Held:
    ref: SlotRef
    asked_at: float
    mark: Hashable
    """The session and arena it was reserved in (`TierClient.session_mark`)."""


class _Namespace:
    """One namespace's stock: the slots held, its top-up under way, and its recent demand."""

    def __init__(self, hash_bytes: int) -> None:
        self.hash_bytes = hash_bytes
        self.held: deque[_Held] = deque()
        self.asked: Answer[list[SlotRef | None]] | None = None
        self.asked_at = 0.0
        self.asked_mark: Hashable = None
        self.demand: deque[int] = deque(maxlen=DEMAND_STEPS)

    @property
    def target(self) -> int:
        return min(MAX_STOCK, 2 * max(self.demand, default=0))

    @property
    def unused(self) -> bool:
        """Nothing held or asked for, and no store in the last `DEMAND_STEPS` steps (its
        namespace went with a draft swap, say)."""
        return not self.held and self.asked is None and self.target == 0


class SlotStock:
    """Blank reservations over ``client``, per namespace; a call that fails is reported to
    ``calls``, which also gives back what ages out."""

    def __init__(
        self, client: TierClient, calls: TierCalls, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.client = client
        self.calls = calls
        self.clock = clock
        self._by_namespace: dict[bytes, _Namespace] = {}
        self._serial = itertools.count()
        self._aged: list[SlotRef] = []
        self._mark: Hashable = None
        """The client's session mark this step (None: the stock is neither used nor topped up)."""
        self.off = client.reserve_behind([]) is None
        """The client reserves by a function call (embedded): a step's stores reserve then."""

    def collect(self) -> None:
        """Once a step, first: read the client's session mark, drop the slots held under
        another one (they went with their session, or their arena), and take in the top-ups
        answered."""
        if self.off:
            return
        mark, now = self.client.session_mark(), self.clock()
        if mark is not None and mark != self._mark:
            for stock in self._by_namespace.values():
                stock.held = deque(held for held in stock.held if held.mark == mark)
        self._mark = mark
        for stock in self._by_namespace.values():
            if stock.asked is None or not stock.asked.done():
                continue
            answer, stock.asked = stock.asked, None
            try:
                refs = [ref for ref in answer.result() if ref is not None]
            except KVTierError as exc:
                self.calls.failed("reserve", exc)
                continue
            held = [_Held(ref, stock.asked_at, stock.asked_mark) for ref in refs]
            if stock.asked_mark == mark or mark is None:
                stock.held.extend(held)
            self._age(stock, now)

    def take(self, key: ChunkKey) -> SlotRef | None:
        """A slot held for ``key``'s namespace, named ``key``; None when none is held, or
        while the session cannot be told held."""
        stock = self._by_namespace.get(namespace_of(key))
        if stock is None or self._mark is None:
            return None
        self._age(stock, self.clock())
        if not stock.held or stock.held[0].mark != self._mark:
            return None
        return replace(stock.held.popleft().ref, key=key)

    def step(self, stored: Iterable[ChunkKey]) -> None:
        """Once a step, after its stores took their slots: what they stored (``stored``, the
        keys of every chunk the step stores) sets the demand; old slots go back, and a top-up
        is asked for each namespace below its target."""
        if self.off:
            return
        counts: dict[bytes, int] = {}
        for key in stored:
            namespace = namespace_of(key)
            counts[namespace] = counts.get(namespace, 0) + 1
            hash_bytes = len(key) - NAMESPACE_BYTES
            if namespace not in self._by_namespace and hash_bytes >= MIN_BLANK_HASH_BYTES:
                self._by_namespace[namespace] = _Namespace(hash_bytes)
        now = self.clock()
        for namespace, stock in self._by_namespace.items():
            stock.demand.append(counts.get(namespace, 0))
            self._age(stock, now)
        aged, self._aged = self._aged, []
        if aged:  # before the top-ups: kvtierd bounds the slots held blank
            self.calls.abort(aged)
        for namespace in [n for n, stock in self._by_namespace.items() if stock.unused]:
            del self._by_namespace[namespace]
        if self._mark is None:
            return
        for namespace, stock in self._by_namespace.items():
            if stock.asked is None and len(stock.held) < stock.target:
                self._ask(namespace, stock, stock.target - len(stock.held), now)

    @property
    def held(self) -> int:
        """Slots held now, over every namespace."""
        return sum(len(stock.held) for stock in self._by_namespace.values())

    @property
    def namespaces(self) -> int:
        """Namespaces with a stock, held or wanted."""
        return len(self._by_namespace)

    def give_back(self) -> None:
        """Abort every slot held (at shutdown: those still asked for end with the session)."""
        self.collect()
        refs = self._aged + [
            held.ref
            for stock in self._by_namespace.values()
            for held in stock.held
            if held.mark == self._mark
        ]
        self._aged = []
        for stock in self._by_namespace.values():
            stock.held.clear()
        if refs:
            self.calls.abort(refs)

    def _age(self, stock: _Namespace, now: float) -> None:
        while stock.held and now - stock.held[0].asked_at > MAX_AGE_S:
            self._aged.append(stock.held.popleft().ref)

    def _ask(self, namespace: bytes, stock: _Namespace, count: int, now: float) -> None:
        keys = [blank_key(namespace, next(self._serial), stock.hash_bytes) for _ in range(count)]
        try:
            stock.asked = self.client.reserve_behind(keys)
        except KVTierError as exc:  # not sent: the breaker is open
            self.calls.failed("reserve", exc)
            return
        stock.asked_at, stock.asked_mark = now, self._mark
