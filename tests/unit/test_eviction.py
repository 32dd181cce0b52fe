"""Eviction orders checked against a plain-list model with a Hypothesis state machine."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.tiers.eviction import POLICIES, make_policy

SLOTS = 12
QUEUES = 3


class PolicyModel(RuleBasedStateMachine):
    policy_name = "lru"

    def __init__(self) -> None:
        super().__init__()
        # the slots are spread over a larger arena: nodes exist for the added ones only
        self.policy = make_policy(self.policy_name, [0] * (3 * SLOTS))
        self.policy.add_slots(range(SLOTS, 2 * SLOTS))
        self.model: dict[int, list[int]] = {q: [] for q in range(QUEUES)}
        self.order: list[int] = []  # every present slot, next victim first, across queues

    def _queue_of(self, slot: int) -> int | None:
        return next((q for q, slots in self.model.items() if slot in slots), None)

    @rule(slot=st.integers(SLOTS, 2 * SLOTS - 1), queue=st.integers(0, QUEUES - 1))
    def insert(self, slot: int, queue: int) -> None:
        if self._queue_of(slot) is None:
            self.policy.insert(slot, queue)
            self.model[queue].append(slot)
            self.order.append(slot)

    @rule(slot=st.integers(SLOTS, 2 * SLOTS - 1))
    def access(self, slot: int) -> None:
        self.policy.access(slot)
        q = self._queue_of(slot)
        if q is not None and self.policy_name == "lru":
            self.model[q].remove(slot)
            self.model[q].append(slot)
            self.order.remove(slot)
            self.order.append(slot)

    @rule(slot=st.integers(SLOTS, 2 * SLOTS - 1))
    def remove(self, slot: int) -> None:
        self.policy.remove(slot)
        q = self._queue_of(slot)
        if q is not None:
            self.model[q].remove(slot)
            self.order.remove(slot)

    @precondition(lambda self: any(self.model.values()))
    @rule()
    def ranks_order_heads_across_queues(self) -> None:
        heads = [slots[0] for slots in self.model.values() if slots]
        assert min(heads, key=self.policy.rank) == self.order[0]

    @invariant()
    def order_matches_model(self) -> None:
        for q in range(QUEUES):
            assert list(self.policy.candidates(q)) == self.model[q]


class FIFOModel(PolicyModel):
    policy_name = "fifo"


TestLRU = PolicyModel.TestCase
TestFIFO = FIFOModel.TestCase


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown eviction policy 'arc'.*fifo.*lru"):
        make_policy("arc", [0] * 4)
    assert set(POLICIES) == {"lru", "fifo"}
