"""Arena slots reserved ahead of the stores that fill them, so that a step's stores take their
slots without waiting for kvtierd.

Each slot is reserved under a blank key of its namespace (`kvtier.core.keys.blank_key`); the
store that takes it names its chunk when it commits, and kvtierd frees the slot instead where
the arena holds that chunk already or lmdb keeps it. kvtierd holds at most an eighth of a pool's
slots blank, so that a stock never crowds out the stores. The stock is topped up with calls that
go without waiting (`TierClient.reserve_behind`), answered by the next steps. Per namespace it
holds twice what the busiest of the last `DEMAND_STEPS` steps stored, at most `MAX_STOCK`. A
slot held `MAX_AGE_S` goes back at the next step; an engine gone idle keeps its stock for the
next burst of requests, until kvtierd aborts it after `server.reservation_timeout_s` (counted
apart from lost commits). A store the stock has no slot for is reserved in its step. An embedded
engine keeps no stock: its reservations are function calls.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace

from kvtier.core.errors import KVTierError
from kvtier.core.keys import (
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
MAX_AGE_S = 10.0
DEMAND_STEPS = 16


class _Namespace:
    """One namespace's stock: the slots held, when each came, and its recent demand."""

    def __init__(self, hash_bytes: int) -> None:
        self.hash_bytes = hash_bytes
        self.held: deque[tuple[SlotRef, float]] = deque()
        self.asked: Answer[list[SlotRef | None]] | None = None
        self.demand: deque[int] = deque(maxlen=DEMAND_STEPS)

    @property
    def target(self) -> int:
        return min(MAX_STOCK, 2 * max(self.demand, default=0))


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
        self.off = False
        """The client reserves by a function call (embedded): a step's stores reserve then."""

    def take(self, key: ChunkKey) -> SlotRef | None:
        """A slot held for ``key``'s namespace, named ``key``; None when none is held."""
        stock = self._by_namespace.get(namespace_of(key))
        if stock is None:
            return None
        self._age(stock, self.clock())
        if not stock.held:
            return None
        ref, _ = stock.held.popleft()
        return replace(ref, key=key)

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
        for namespace, stock in self._by_namespace.items():
            if stock.asked is None and len(stock.held) < stock.target:
                self._ask(namespace, stock, stock.target - len(stock.held))

    @property
    def held(self) -> int:
        """Slots held now, over every namespace."""
        return sum(len(stock.held) for stock in self._by_namespace.values())

    def give_back(self) -> None:
        """Abort every slot held (at shutdown: those still asked for end with the session)."""
        self.collect()
        refs = self._aged + [ref for stock in self._by_namespace.values() for ref, _ in stock.held]
        self._aged = []
        for stock in self._by_namespace.values():
            stock.held.clear()
        if refs:
            self.calls.abort(refs)

    def _age(self, stock: _Namespace, now: float) -> None:
        while stock.held and now - stock.held[0][1] > MAX_AGE_S:
            self._aged.append(stock.held.popleft()[0])

    def collect(self) -> None:
        """Take in the top-ups answered."""
        now = self.clock()
        for stock in self._by_namespace.values():
            if stock.asked is None or not stock.asked.done():
                continue
            answer, stock.asked = stock.asked, None
            try:
                stock.held.extend((ref, now) for ref in answer.result() if ref is not None)
            except KVTierError as exc:
                self.calls.failed("reserve", exc)

    def _ask(self, namespace: bytes, stock: _Namespace, count: int) -> None:
        keys = [blank_key(namespace, next(self._serial), stock.hash_bytes) for _ in range(count)]
        try:
            stock.asked = self.client.reserve_behind(keys)
        except KVTierError as exc:  # not sent: the breaker is open
            self.calls.failed("reserve", exc)
            return
        self.off = stock.asked is None
