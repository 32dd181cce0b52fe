"""Stores over the in-process client (a real TierManager, a small arena in /dev/shm, LMDB under
tmp_path), with no engine: a reservation is asked for without waiting, handed to the workers
when the next step is planned, and committed with the call after the workers reported it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvtier_vllm.draft import DraftTracker
from kvtier_vllm.events import KVEventFeed
from kvtier_vllm.metadata import KVTierMetadata
from kvtier_vllm.stats import KVTierStats
from kvtier_vllm.stores import Stores
from kvtier_vllm.unreturned import Unreturned

from kvtier.client import InProcessClient
from kvtier.errors import KVTierError, TierUnavailableError
from kvtier.keys import ChunkKey
from kvtier.manager import TierManager
from kvtier.protocol import SlotRef
from tests.support import draft_spec, manager_config
from tests.unit.test_planner import BPC, CHUNK_TOKENS, DRAFT, HASHES, TARGET, keys

REQUEST = SimpleNamespace(block_hashes=HASHES, all_token_ids=list(range(len(HASHES) * 16)))
BLOCKS = [list(range(1, len(HASHES) + 1))]  # one group; block 0 is vLLM's null block


class Later:
    """An answer still on its way: the call is made when it is read."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.read = False
        self.arrived = False

    def done(self) -> bool:
        return self.arrived or self.read

    def result(self) -> tuple[int, list[SlotRef | None]]:
        self.read = True
        return self.call()  # type: ignore[no-any-return]


class LateClient(InProcessClient):
    """Answers reservations only when they are read; ``fail`` makes them raise then."""

    def __init__(self, manager: TierManager) -> None:
        super().__init__(manager, "r0")
        self.asked: list[Later] = []
        self.commits: list[int] = []
        self.fail: KVTierError | None = None

    def reserve_async(self, keys: Sequence[ChunkKey], *, commit: Sequence[SlotRef]) -> Any:
        keys, commit = list(keys), list(commit)
        self.commits.append(len(commit))

        def call() -> tuple[int, list[SlotRef | None]]:
            if self.fail is not None:
                raise self.fail
            return self.reserve(keys, commit=commit)

        self.asked.append(Later(call))
        return self.asked[-1]


@pytest.fixture
def client(shm_path: Path, tmp_path: Path) -> Iterator[LateClient]:
    c = LateClient(TierManager(manager_config(shm_path, tmp_path)))
    yield c
    c.close()


def stores_over(
    client: LateClient, draft: DraftTracker | None = None
) -> tuple[Stores, dict[str, bytes], list[str]]:
    plans = [TARGET, DRAFT] if draft is not None else [TARGET]
    namespaces = {p.key: client.register_pool(p.spec, p.chunk_bytes) for p in plans}
    if draft is not None:
        draft.namespace = namespaces[DRAFT.key]
    errors: list[str] = []
    stores = Stores(
        client,
        plans,
        namespaces,
        KVEventFeed(16),
        Unreturned(),
        lambda what, exc: errors.append(what),
        chunk_tokens=CHUNK_TOKENS,
        blocks_per_chunk=BPC,
        draft=draft,
    )
    return stores, namespaces, errors


def ask(stores: Stores, chunks: range, block_ids: list[list[int]] = BLOCKS) -> None:
    stores.reserve(REQUEST, block_ids, chunks, chunks.stop, 0, KVTierStats())


def report_written(stores: Stores, meta: KVTierMetadata) -> None:
    stores.reported([(c.slot, c.generation) for c in meta.stores], [])


def test_a_reservation_waits_for_nothing_and_its_copies_go_out_with_the_next_step(
    client: LateClient,
) -> None:
    stores, namespaces, errors = stores_over(client)
    target = keys(namespaces[TARGET.key], range(2))
    ask(stores, range(2))
    assert [a.read for a in client.asked] == [False]  # asked, not waited for
    assert stores.busy  # an idle engine takes one more step
    assert all(stores.storing(k) for k in target)
    assert not stores.storing(keys(namespaces[TARGET.key], range(2, 3))[0])
    meta = KVTierMetadata()
    stores.hand_out(meta, step=2)
    assert [c.block_ids for c in meta.stores] == [(1, 2, 3, 4), (5, 6, 7, 8)]
    assert client.lookup(target).hits == 0  # reserved, not written yet
    report_written(stores, meta)
    assert all(stores.storing(k) for k in target)  # written, its commit not sent
    # the commit goes with the next step's reservation: one call
    ask(stores, range(2, 3))
    assert client.commits == [0, 2]
    stores.hand_out(KVTierMetadata(), step=3)
    assert client.lookup(target).hits == 2
    assert not any(stores.storing(k) for k in target)
    assert errors == []


def test_commits_no_reservation_took_along_go_alone(client: LateClient) -> None:
    stores, namespaces, _ = stores_over(client)
    ask(stores, range(2))
    meta = KVTierMetadata()
    stores.hand_out(meta, step=2)
    report_written(stores, meta)
    stores.flush()
    assert client.commits == [0, 2]
    assert not stores.busy
    client.asked[-1].result()
    assert client.lookup(keys(namespaces[TARGET.key], range(2))).hits == 2


def test_commits_sent_alone_that_fail_are_kept_for_a_retry(client: LateClient) -> None:
    stores, namespaces, errors = stores_over(client)
    chunk = keys(namespaces[TARGET.key], range(1))
    ask(stores, range(1))
    meta = KVTierMetadata()
    stores.hand_out(meta, step=2)
    report_written(stores, meta)
    client.fail = TierUnavailableError("kvtierd is gone")
    stores.flush()
    assert stores.storing(chunk[0])  # committing: not answered yet
    client.asked[-1].arrived = True
    assert not stores.storing(chunk[0])  # failed: a lookup does not wait for the retry
    assert errors == ["reserve"]
    assert len(stores.unreturned) == 1
    client.fail = None
    assert stores.unreturned.retry(client, force=True) == 1
    assert client.lookup(chunk).hits == 1


def test_a_failed_reservation_stores_nothing_and_keeps_its_commits(client: LateClient) -> None:
    stores, namespaces, errors = stores_over(client)
    ask(stores, range(1))
    meta = KVTierMetadata()
    stores.hand_out(meta, step=2)
    report_written(stores, meta)
    client.fail = TierUnavailableError("kvtierd is gone")
    ask(stores, range(1, 2))  # carries the commit of chunk 0
    late = KVTierMetadata()
    stores.hand_out(late, step=3)
    assert late.stores == []
    assert errors == ["reserve"]
    assert len(stores.unreturned) == 1  # the commit, tried again later
    client.fail = None
    assert stores.unreturned.retry(client, force=True) == 1
    assert client.lookup(keys(namespaces[TARGET.key], range(1))).hits == 1


def test_a_draft_swap_before_the_copies_go_out_voids_the_draft_chunks(
    client: LateClient,
) -> None:
    draft = DraftTracker(draft_spec(), lambda spec: spec.digest())
    stores, namespaces, _ = stores_over(client, draft)
    draft_keys = keys(namespaces[DRAFT.key], range(2))
    ask(stores, range(2), [BLOCKS[0], BLOCKS[0]])
    namespaces[DRAFT.key] = b"\x01" * len(namespaces[DRAFT.key])  # another revision now
    meta = KVTierMetadata()
    stores.hand_out(meta, step=2)
    assert {c.plan for c in meta.stores} == {TARGET.key}
    # the draft's reservations were given back: the same chunks can be reserved again
    assert all(client.reserve(draft_keys))
