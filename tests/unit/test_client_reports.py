"""What the sidecar client reports besides its calls (`kvtier.rpc.reports.Reports`): hit
reports and what heartbeats carry, with a sender that records instead of calling kvtierd."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import pytest

from kvtier.api.v1 import tier_pb2
from kvtier.core.costs import EngineTimings
from kvtier.core.errors import TierUnavailableError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import FailedChunk, Failure, SlotRef, TierCode
from kvtier.rpc.calls import Pending
from kvtier.rpc.reports import MAX_REPORT, Reports

SERVED = tier_pb2.LookupRequest.SERVED_FIELD_NUMBER
AGAIN = tier_pb2.LookupRequest.AGAIN_FIELD_NUMBER


class Sent:
    """The reports sent, each answered when the test says."""

    def __init__(self) -> None:
        self.reports: list[tuple[list[ChunkKey], list[SlotRef], tuple[int, ...]]] = []
        self.answers: list[Future[Any]] = []

    def __call__(
        self, keys: Sequence[ChunkKey], release: Sequence[SlotRef], flags: tuple[int, ...]
    ) -> Pending[Any]:
        self.reports.append((list(keys), list(release), flags))
        self.answers.append(Future())
        return Pending(self.answers[-1], lambda response: response, "unix:test")


def _keys(n: int, first: int = 0) -> list[ChunkKey]:
    return [ChunkKey(i.to_bytes(16, "big")) for i in range(first, first + n)]


def _ref(i: int) -> SlotRef:
    return SlotRef(ChunkKey(i.to_bytes(16, "big")), i, i * 64, 64, 1, lease=i + 1)


def test_each_report_carries_one_kind_of_lookup_at_most_a_batch_of_keys() -> None:
    sent = Sent()
    reports = Reports(sent)
    reports.answered((), _keys(MAX_REPORT + 3))
    reports.answered((AGAIN,), _keys(2, first=10**6))
    for _ in range(3):
        reports.send_hits()
        sent.answers[-1].set_result(None)
    assert [(len(keys), flags) for keys, _, flags in sent.reports] == [
        (MAX_REPORT, (SERVED,)),
        (2, (SERVED, AGAIN)),  # what a full report left waits behind the other kinds
        (3, (SERVED,)),
    ]
    reports.send_hits()
    assert len(sent.reports) == 3  # nothing left: no call


def test_the_leases_a_failed_report_ended_go_with_the_next() -> None:
    sent = Sent()
    reports = Reports(sent)
    reports.answered((), _keys(1), ending=[_ref(1), _ref(2)])
    reports.send_hits()
    reports.send_hits()  # the first is in flight: none sent
    assert len(sent.reports) == 1
    sent.answers[0].set_exception(TierUnavailableError("kvtierd went away"))
    with pytest.raises(TierUnavailableError):
        reports.send_hits()
    reports.send_hits()
    assert sent.reports[1] == ([], [_ref(1), _ref(2)], (SERVED,))


def test_a_call_that_took_the_due_leases_and_failed_hands_them_back() -> None:
    sent = Sent()
    reports = Reports(sent)
    reports.answered((), [], ending=[_ref(1)])
    owned = reports.take_due()
    assert owned == [_ref(1)]
    reports.answered((), [], ending=[_ref(2)])
    reports.due_again(owned)
    reports.send_hits()
    assert sent.reports == [([], [_ref(1), _ref(2)], (SERVED,))]


def test_a_heartbeat_carries_what_came_since_the_last_and_failed_chunks_are_bounded() -> None:
    reports = Reports(Sent())
    timings = EngineTimings()
    timings.prefilled(100, 0.5)
    reports.add_timings(timings)
    reports.add_timings(timings)
    failed = FailedChunk(_keys(1)[0], TierCode.LMDB, Failure.PAYLOAD)
    reports.add_failed([failed] * (MAX_REPORT + 1))
    reports.set_busy(True)
    beat = reports.heartbeat("s1")
    assert (beat.session_id, beat.busy, beat.prefill_steps) == ("s1", True, 2)
    assert len(beat.failed_verification) == MAX_REPORT  # bounded while kvtierd is away
    again = reports.heartbeat("s1")
    assert (again.prefill_steps, len(again.failed_verification)) == (0, 0)
