"""The scheduler side's calls into the tiers, as the parts beside the KV connector see them.

One object (the KV scheduler's `TierCalls`) knows whether the tiers are failing: it logs a failed
call once, not at every call until they are back, and hands back later the reservations a failed
commit or abort could not. The draft pool and the hidden-state manifests call the tiers through
it rather than keep a view of their own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvtier.core.errors import KVTierError
from kvtier.core.protocol import SlotRef, TierClient


class TierAccess(Protocol):
    @property
    def client(self) -> TierClient | None:
        """The client in use (None: none is open)."""

    def failed(self, what: str, error: KVTierError) -> None:
        """A call (``what``) failed."""

    def commit(self, refs: list[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        """Make written reservations visible; how many were (0: failed, committed later)."""

    def abort(self, refs: list[SlotRef]) -> None:
        """Give reservations back unwritten (later, where the call failed)."""
