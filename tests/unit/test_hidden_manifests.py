"""The manifests written beside captured hidden states, over real embedded tiers: a manifest
whose commit failed is committed on a later step, so the request is still listed from the
tiers. The failure is the only stand-in: a client that refuses its first commit."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from kvtier_vllm.hidden_capture.tails import Capture, Manifests
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls
from kvtier_vllm.layout.plans import PoolPlan

from kvtier.client import InProcessClient
from kvtier.core.errors import TierUnavailableError
from kvtier.core.keys import NamespaceSpec, PageLayout, Pool
from kvtier.core.protocol import SlotRef
from kvtier.hidden.reader import HEADS_FIRST, HiddenStatesReader, manifest_name, manifest_parts
from kvtier.tiering.manager import TierManager
from tests.support import manager_config

BLOCK, BPC, LAYERS, HIDDEN = 16, 4, 3, 128  # 96 KiB chunks: an arena slot class
SPEC = NamespaceSpec(
    model="m",
    model_revision="r",
    pool=Pool.HIDDEN,
    kv_dtype="float32",
    layout=PageLayout(BLOCK, BPC, LAYERS, (HIDDEN,), ("cache_only_layers.2",), HEADS_FIRST),
    attention="hidden_states=0,2,5",
)
PLAN = PoolPlan(Pool.HIDDEN, SPEC.layout.layer_names, BLOCK * LAYERS * HIDDEN * 4, SPEC, BPC)


class FirstCommitFails(InProcessClient):
    """The real tiers, but the first commit is refused, as by a daemon paused for a moment."""

    refused = False

    def commit(self, refs: Sequence[SlotRef], lineages: Sequence[bytes] = ()) -> int:
        if not self.refused:
            self.refused = True
            raise TierUnavailableError("not answering")
        return super().commit(refs, lineages)


@pytest.fixture
def client(shm_path: Path, tmp_path: Path) -> Iterator[FirstCommitFails]:
    c = FirstCommitFails(TierManager(manager_config(shm_path, tmp_path)), "r0")
    yield c
    c.close()


def test_a_manifest_whose_commit_failed_is_committed_on_a_later_step(
    client: FirstCommitFails,
) -> None:
    namespace = client.register_pool(SPEC, PLAN.chunk_bytes)
    calls = TierCalls(client)
    manifests = Manifests(calls)
    tokens = 3 * BLOCK * BPC + 1  # three whole chunks and a tail
    request = SimpleNamespace(
        request_id="a",
        prompt_token_ids=list(range(tokens)),
        all_token_ids=list(range(tokens + 1)),
        block_hashes=[(i + 1).to_bytes(32, "big") for i in range(tokens // BLOCK)],
        kv_transfer_params=None,
    )
    ref, _ = manifests.reference(Capture(PLAN), request)
    assert ref.namespace == namespace
    parts = len(manifest_parts(ref))
    assert len(calls.unreturned) == parts  # kept, not left to the reservations' timeout
    calls.hand_back(force=True)
    assert len(calls.unreturned) == 0
    reader = HiddenStatesReader(client, timeout_s=1.0)
    try:
        assert reader.manifest(namespace, manifest_name(ref)) == ref
    finally:
        reader.close()
        manifests.close()
