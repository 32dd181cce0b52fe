"""The connector's list of refs still to hand back: when it tries, how often, and when it gives
up; and the scheduler's releases, which keep what a failed one could not end. The client here
is a stand-in that fails on demand (the real daemon's side is in
tests/integration/test_daemon_bookkeeping.py and tests/faults/test_leaks.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls
from kvtier_vllm.kv.scheduler_side.unreturned import Handback, Unreturned

from kvtier.core.errors import TierUnavailableError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import Ready, SlotRef, settle
from tests.support import HandClock


class Client:
    """Records every call; fails while ``failing``."""

    def __init__(self) -> None:
        self.failing = False
        self.serving = True
        self.calls: list[tuple[str, list[int]]] = []

    def _call(self, what: str, refs: Sequence[SlotRef]) -> None:
        self.calls.append((what, [r.slot for r in refs]))
        if self.failing:
            raise TierUnavailableError("not answering")

    def release(self, refs: Sequence[SlotRef]) -> None:
        self._call("release", refs)

    def commit(self, refs: Sequence[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        self._call("commit", refs)
        return len(refs)

    def abort(self, refs: Sequence[SlotRef]) -> None:
        self._call("abort", refs)

    def settle_behind(
        self,
        *,
        commit: Sequence[SlotRef] = (),
        lineages: Sequence[bytes] = (),
        abort: Sequence[SlotRef] = (),
        release: Sequence[SlotRef] = (),
    ) -> Ready[int]:
        return Ready(settle(self, commit, lineages, abort, release))  # type: ignore[arg-type]


def _refs(*slots: int) -> list[SlotRef]:
    return [SlotRef(ChunkKey(b"k" * 24), s, 0, 1, 1) for s in slots]


def test_refs_go_back_on_a_later_try_in_the_order_they_failed() -> None:
    clock, client = HandClock(0.0), Client()
    owed = Unreturned(every_s=1.0, clock=clock)
    owed.keep(Handback.COMMIT, _refs(1, 2))
    owed.keep(Handback.RELEASE, _refs(3))
    owed.keep(Handback.ABORT, _refs(4))
    assert owed.retry(client) == 0  # not in the step that just failed
    clock.now = 1.0
    assert owed.retry(client) == 4
    assert client.calls == [("commit", [1, 2]), ("release", [3]), ("abort", [4])]
    assert len(owed) == 0


def test_a_failing_daemon_gets_one_call_per_try_and_a_bounded_number_of_tries() -> None:
    clock, client = HandClock(0.0), Client()
    owed = Unreturned(every_s=1.0, max_tries=3, clock=clock)
    owed.keep(Handback.RELEASE, _refs(1))
    owed.keep(Handback.RELEASE, _refs(2))
    client.failing = True
    for _ in range(10):
        clock.now += 1.0
        owed.retry(client)
    assert client.calls == [("release", [1])] * 3 + [("release", [2])] * 3
    assert len(owed) == 0
    assert owed.given_up == 2


def test_nothing_is_tried_while_the_client_says_the_daemon_is_not_serving() -> None:
    clock, client = HandClock(0.0), Client()
    owed = Unreturned(every_s=0.0, clock=clock)
    owed.keep(Handback.RELEASE, _refs(1))
    client.serving = False
    assert owed.retry(client) == 0
    assert client.calls == []
    assert owed.retry(client, force=True) == 1  # at shutdown: one last try regardless


def test_at_shutdown_one_failure_gives_up_the_rest() -> None:
    client = Client()
    owed = Unreturned(every_s=60.0, clock=HandClock(0.0))
    owed.keep(Handback.RELEASE, _refs(1))
    owed.keep(Handback.COMMIT, _refs(2))
    client.failing = True
    assert owed.retry(client, force=True) == 0
    assert client.calls == [("release", [1])]
    assert (len(owed), owed.given_up) == (0, 2)


def test_the_oldest_refs_are_given_up_past_the_bound() -> None:
    owed = Unreturned(max_refs=3, clock=HandClock(0.0))
    owed.keep(Handback.RELEASE, _refs(1, 2))
    owed.keep(Handback.RELEASE, _refs(3, 4))
    assert (len(owed), owed.given_up) == (2, 2)


def test_a_failed_release_is_handed_back_later_and_logged_once_while_the_tiers_fail(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = Client()
    calls = TierCalls(client)  # type: ignore[arg-type]
    client.failing = True
    with caplog.at_level(logging.ERROR, logger="kvtier_vllm.kv.scheduler_side.tier_calls"):
        calls.release(_refs(1))
        calls.release(_refs(2))
        assert len(caplog.records) == 1  # once, not at every call until they are back
        calls.answered()
        calls.release(_refs(3))
        assert len(caplog.records) == 2  # news again after an answer
    assert len(calls.unreturned) == 3
    client.failing = False
    calls.hand_back(force=True)
    assert client.calls[-3:] == [("release", [1]), ("release", [2]), ("release", [3])]
    assert len(calls.unreturned) == 0
    calls.client = None
    calls.release(_refs(4))  # no client open: nothing to end
    assert client.calls[-1] == ("release", [3])


def test_a_failed_commit_or_abort_is_handed_back_later_and_logged_once_with_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = Client()
    calls = TierCalls(client)  # type: ignore[arg-type]
    assert calls.commit(_refs(1, 2)) == 2
    client.failing = True
    with caplog.at_level(logging.ERROR, logger="kvtier_vllm.kv.scheduler_side.tier_calls"):
        assert calls.commit(_refs(3)) == 0
        calls.abort(_refs(4))
        calls.release(_refs(5))
        calls.failed("draft state", TierUnavailableError("not answering"))
    assert len(caplog.records) == 1  # one owner of "the tiers are failing", whoever called
    assert len(calls.unreturned) == 3
    client.failing = False
    calls.hand_back(force=True)
    assert client.calls[-3:] == [("commit", [3]), ("abort", [4]), ("release", [5])]
    assert len(calls.unreturned) == 0
