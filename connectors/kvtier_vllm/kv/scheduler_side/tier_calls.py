"""Whether the scheduler's calls into the tiers are failing, and the references it hands back.

A failed call is logged once when the tiers start failing, not at every call until they are
back; the engine serves meanwhile as if kvtier had missed. A reference a failed release, commit
or abort could not hand back is kept in `Unreturned` and handed back on a later step. Every part
of the scheduler side that calls the tiers reports its failures here (the draft pool and the
hidden-state manifests through `kvtier_vllm.shared.tier_access.TierAccess`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.core.errors import KVTierError
from kvtier.core.protocol import Answer, SlotRef, TierClient
from kvtier.rpc import DaemonStalledError
from kvtier_vllm.kv.scheduler_side.unreturned import Handback, Unreturned

log = logging.getLogger(__name__)


@dataclass
class _Sent:
    """Hand-backs on their way (`TierClient.settle_behind`), and its answer."""

    parts: list[tuple[Handback, list[SlotRef]]]
    answer: Answer[int]


class TierCalls:
    """The failure state of the calls over ``client``, and the hand-backs of what those calls
    took: leases released, reservations committed or aborted. Hand-backs go without waiting
    (`settle_behind`): an engine step never waits for kvtierd to answer one, and what a failed
    one held is handed back later. A `commit` that answers how many went waits, as before."""

    def __init__(self, client: TierClient | None, unreturned: Unreturned | None = None) -> None:
        self.client = client
        """The client in use (None: none is open, nothing is released)."""
        self.unreturned = unreturned if unreturned is not None else Unreturned()
        """References a failed call did not hand back: handed back on later steps."""
        self._failing = False
        self._sent: list[_Sent] = []

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
        self.settle_behind(release=refs)

    def release_later(self, refs: list[SlotRef]) -> None:
        self.unreturned.keep(Handback.RELEASE, refs)

    def commit(self, refs: list[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        """Make written reservations visible, waiting for the answer; returns how many were
        (0 where the call failed: they are committed on a later step)."""
        client = self.client
        if not refs or client is None:
            return 0
        try:
            return client.commit(refs, lineages)
        except KVTierError as exc:
            self.unreturned.keep(Handback.COMMIT, refs)
            self.failed(str(Handback.COMMIT), exc)
        return 0

    def abort(self, refs: list[SlotRef]) -> None:
        """Give reservations back unwritten; those a failed call could not are given later."""
        self.settle_behind(abort=refs)

    def settle_behind(
        self,
        commit: list[SlotRef] | None = None,
        lineages: Sequence[bytes] = (),
        abort: list[SlotRef] | None = None,
        release: list[SlotRef] | None = None,
    ) -> None:
        """Commit, abort and release without waiting; what a failed call could not hand back
        is handed back on a later step."""
        parts = [
            (kind, refs)
            for kind, refs in (
                (Handback.COMMIT, commit),
                (Handback.ABORT, abort),
                (Handback.RELEASE, release),
            )
            if refs
        ]
        client = self.client
        if not parts or client is None:
            return
        try:
            answer = client.settle_behind(
                commit=commit or (), lineages=lineages, abort=abort or (), release=release or ()
            )
        except KVTierError as exc:  # not sent: the breaker is open
            self._keep(parts, exc)
            return
        self._sent.append(_Sent(parts, answer))
        self._collect(0.0)

    def _collect(self, wait_s: float) -> None:
        """Take the answers there (waiting up to ``wait_s`` for them all); keep what a failed
        one held."""
        deadline = time.monotonic() + wait_s
        still: list[_Sent] = []
        for sent in self._sent:
            if not sent.answer.wait(max(0.0, deadline - time.monotonic())):
                still.append(sent)
                continue
            try:
                sent.answer.result()
            except KVTierError as exc:
                self._keep(sent.parts, exc)
        self._sent = still

    def _keep(self, parts: list[tuple[Handback, list[SlotRef]]], error: KVTierError) -> None:
        for kind, refs in parts:
            self.unreturned.keep(kind, refs)
        self.failed(" and ".join(str(kind) for kind, _ in parts), error)

    @property
    def in_flight(self) -> int:
        """Hand-backs sent and not yet answered."""
        return len(self._sent)

    def settle(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for the hand-backs on their way: an engine with nothing to
        run leaves the tiers as its last step left them (its commits visible to a lookup)."""
        self._collect(wait_s)

    def hand_back(self, force: bool = False, wait_s: float = 10.0) -> None:
        """Take the answers there, and hand back what failed calls kept, when due (everything
        with ``force``: at shutdown, after waiting up to ``wait_s`` for those on their way)."""
        self._collect(wait_s if force else 0.0)
        if self.client is not None:
            self.unreturned.retry(self.client, force=force)
