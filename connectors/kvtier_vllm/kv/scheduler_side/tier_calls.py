"""Whether the scheduler's calls into the tiers are failing, and the references it hands back.

A failed call is logged once when the tiers start failing, not at every call until they are
back; the engine serves meanwhile as if kvtier had missed. A reference a failed release, commit
or abort could not hand back is kept in `Unreturned` and handed back on a later step. Every part
of the scheduler side that calls the tiers reports its failures here (the draft pool and the
hidden-state manifests through `kvtier_vllm.shared.tier_access.TierAccess`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.core.errors import KVTierError
from kvtier.core.protocol import SlotRef, TierClient
from kvtier.rpc import DaemonStalledError
from kvtier_vllm.kv.scheduler_side.unreturned import Handback, Unreturned

log = logging.getLogger(__name__)


class TierCalls:
    """The failure state of the calls over ``client``, and the hand-backs of what those calls
    took: leases released, reservations committed or aborted."""

    def __init__(self, client: TierClient | None, unreturned: Unreturned | None = None) -> None:
        self.client = client
        """The client in use (None: none is open, nothing is released)."""
        self.unreturned = unreturned if unreturned is not None else Unreturned()
        """References a failed call did not hand back: handed back on later steps."""
        self._failing = False

    def failed(self, what: str, error: KVTierError) -> None:
        """A call (``what``) failed: logged unless the tiers were failing already."""
        if not self._failing and not isinstance(error, DaemonStalledError):  # the client said
            log.error("kvtier %s failed; serving without it until it is back: %s", what, error)
        self._failing = True

    def answered(self) -> None:
        """A lookup was answered: the next failure is news again."""
        self._failing = False

    def release(self, refs: list[SlotRef]) -> None:
        """End leases; those a failed call could not end are handed back later."""
        self._settle(Handback.RELEASE, refs)

    def release_later(self, refs: list[SlotRef]) -> None:
        self.unreturned.keep(Handback.RELEASE, refs)

    def commit(self, refs: list[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        """Make written reservations visible; returns how many were (0 where the call failed:
        they are committed on a later step)."""
        return self._settle(Handback.COMMIT, refs, lineages)

    def abort(self, refs: list[SlotRef]) -> None:
        """Give reservations back unwritten; those a failed call could not are given later."""
        self._settle(Handback.ABORT, refs)

    def _settle(self, kind: Handback, refs: list[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        client = self.client
        if not refs or client is None:
            return 0
        try:
            if kind is Handback.COMMIT:
                return client.commit(refs, lineages)
            if kind is Handback.RELEASE:
                client.release(refs)
            else:
                client.abort(refs)
        except KVTierError as exc:
            self.unreturned.keep(kind, refs)
            self.failed(str(kind), exc)
        return 0

    def hand_back(self, force: bool = False) -> None:
        """Hand back what failed calls kept, when due (everything with ``force``: at shutdown)."""
        if self.client is not None:
            self.unreturned.retry(self.client, force=force)
