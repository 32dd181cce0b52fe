"""The leases a scheduler holds for planned loads, kept by step until vLLM's copies are done."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from kvtier.core.protocol import SlotRef


class Leases:
    """Leases of planned loads, by the step that took them: given back a few steps later, as a
    load's leases outlive the step that copies it. The oldest step's go back with the next call
    that releases (a lookup takes them along)."""

    def __init__(self, steps: int) -> None:
        self._steps: deque[list[SlotRef]] = deque([[] for _ in range(steps)])

    def __iter__(self) -> Iterator[list[SlotRef]]:
        return iter(self._steps)

    @property
    def newest(self) -> list[SlotRef]:
        return self._steps[-1]

    def step(self, taken: list[SlotRef]) -> list[SlotRef]:
        """A new step whose loads hold ``taken``; returns the oldest step's, due now."""
        due = self._steps.popleft()
        self._steps.append(taken)
        return due

    def take_due(self) -> list[SlotRef]:
        due, self._steps[0] = self._steps[0], []
        return due

    def give_back(self, refs: Iterable[SlotRef]) -> None:
        """Leases not used: they go back with the next call that releases."""
        self._steps[0].extend(refs)
