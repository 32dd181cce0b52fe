"""A step's stores are reserved in one call to the tiers, whatever number of requests filled
chunks in it, and a prefix two requests compute at once is stored once; what the workers
report written is committed without the step waiting for it, and an engine left with nothing
to run waits for those commits, so its last prompts hit at once. A real scheduler over embedded
tiers (no engine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvtier_vllm.kv.metadata import KVTierWorkerMetadata
from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler

from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import SlotRef
from tests.unit.test_scheduler_lookups import (
    BPC,
    CHUNK_TOKENS,
    chunk_keys,
    open_scheduler,
    request,
    step,
)


@pytest.fixture
def scheduler(shm_path: Path, tmp_path: Path) -> Iterator[KVTierScheduler]:
    s = open_scheduler(shm_path, tmp_path, load_policy="always")
    yield s
    s.shutdown()


def prompt(req_id: str, chunks: int, like: str = "") -> Any:
    """``request`` with its tokens; ``like``: the prompt of another request, under this id."""
    req = request(like or req_id, chunks)
    req.request_id = req_id
    req.all_token_ids = list(req.prompt_token_ids)
    return req


def reserved_keys(scheduler: KVTierScheduler, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The keys of each reserve call the scheduler's stores make, a list per call."""
    assert scheduler.stores is not None
    client = scheduler.stores.client
    calls: list[list[ChunkKey]] = []
    real = client.reserve

    def reserve(keys: list[ChunkKey], **kwargs: Any) -> Any:
        calls.append(list(keys))
        return real(keys, **kwargs)

    monkeypatch.setattr(client, "reserve", reserve)
    return calls


def test_a_steps_chunks_are_reserved_in_one_call_and_a_shared_prefix_once(
    scheduler: KVTierScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = reserved_keys(scheduler, monkeypatch)
    a, b, twin = prompt("a", 3), prompt("b", 2), prompt("twin", 3, like="a")
    new, scheduled, next_block = [], {}, 1
    for req in (a, b, twin):
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        blocks = list(range(next_block, next_block + len(req.block_hashes)))
        next_block += len(blocks)
        scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: []), 0)
        new.append(
            SimpleNamespace(req_id=req.request_id, block_ids=[blocks], num_computed_tokens=0)
        )
        scheduled[req.request_id] = req.num_prompt_tokens
    meta = scheduler.build_connector_meta(step(new, scheduled))

    ab = chunk_keys(scheduler, a, range(3)) + chunk_keys(scheduler, b, range(2))
    assert calls == [ab], "one call for the step, each chunk of a's prefix once"
    first_blocks = [c.block_ids[0] for c in meta.stores]
    b_first = 1 + len(a.block_hashes)
    assert first_blocks == [1, 1 + BPC, 1 + 2 * BPC, b_first, b_first + BPC]  # a's, then b's

    for req in (a, b, twin):
        scheduler.request_finished(req)
    written = KVTierWorkerMetadata(stored=[(c.slot, c.generation) for c in meta.stores])
    scheduler.update_connector_output(written)
    assert scheduler.calls.in_flight == 0, "an idle engine left its commits on their way"
    again = prompt("again", 2, like="b")
    assert scheduler.get_num_new_matched_tokens(again, 0)[0] == 2 * CHUNK_TOKENS


class Unanswered:
    """An answer that never comes (a daemon that does not answer in time); records how long
    each caller would have waited for it."""

    def __init__(self) -> None:
        self.waits: list[float | None] = []

    def done(self) -> bool:
        return False

    def wait(self, timeout_s: float | None) -> bool:
        self.waits.append(timeout_s)
        return False

    def result(self) -> int:
        raise AssertionError("not answered")


def test_commits_on_their_way_hold_up_no_step_while_requests_run(
    scheduler: KVTierScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = prompt("a", 2), prompt("b", 2)
    sent: list[list[SlotRef]] = []
    answer = Unanswered()

    def settle_behind(*, commit: list[SlotRef], **_: Any) -> Unanswered:
        sent.append(list(commit))
        return answer

    assert scheduler.client is not None
    for req in (a, b):
        scheduler.get_num_new_matched_tokens(req, 0)
        scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: []), 0)
    new = [
        SimpleNamespace(req_id=r.request_id, block_ids=[ids], num_computed_tokens=0)
        for r, ids in ((a, list(range(1, 9))), (b, list(range(9, 17))))
    ]
    meta = scheduler.build_connector_meta(step(new, {"a": 2 * CHUNK_TOKENS, "b": 1}))
    assert len(meta.stores) == 2  # a's two chunks; b has computed none yet
    monkeypatch.setattr(scheduler.client, "settle_behind", settle_behind)
    scheduler.request_finished(a)
    written = KVTierWorkerMetadata(stored=[(c.slot, c.generation) for c in meta.stores])
    scheduler.update_connector_output(written)
    assert [len(refs) for refs in sent] == [2]
    assert scheduler.calls.in_flight == 1
    assert not any(answer.waits), "a step waited for the commit while b runs"
    scheduler.request_finished(b)
    scheduler.update_connector_output(KVTierWorkerMetadata())
    assert max(w or 0.0 for w in answer.waits) > 0, "the idle engine did not wait for it"
