"""Finished requests whose blocks wait for their stores are reported sent once the stores
issued before them landed, and once only, however many steps after vLLM finished them they
are named (stores asked for and answered steps later), and whether vLLM asks for what was sent
before or after the step's stores are issued."""

from __future__ import annotations

from kvtier_vllm.kv.worker_side.sends import PendingSends
from kvtier_vllm.shared.copies import Fence


def test_a_request_named_steps_after_it_finished_is_sent_once_its_stores_landed() -> None:
    sends = PendingSends()
    landed = [False]
    assert sends.sent() == set(), "vLLM finished it: nothing named yet"
    assert sends.sent() == set(), "a later step, its stores still unanswered"
    sends.after(Fence(lambda: landed[0]), ["r"])
    assert sends.sent() == set(), "its stores are still landing"
    landed[0] = True
    sends.after(Fence(), ["r"])  # named again while it waits: still once
    assert sends.sent() == {"r"}
    assert sends.sent() == set(), "reported once"


def test_release_all_sends_every_request_waiting() -> None:
    sends = PendingSends()
    sends.after(Fence(lambda: False), ["a", "b"])
    assert sends.release_all() == {"a", "b"}
    assert sends.sent() == set()
