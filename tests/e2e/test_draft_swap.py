"""Draft-weight swaps in a running vLLM engine (the CPU build), with the target as its own draft.

The target as its own draft accepts every proposal, and noisy weights accept almost none, so
acceptance shows which draft KV an engine used. Weights are swapped with the recipe in
`tests.fixtures.draft_weights`; vLLM's `reset_prefix_cache(reset_connector=True)` is what
`pause_generation(clear_cache=True)` does around a weight update.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli.main import main as kvtier_cli
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import (
    EagleModels,
    ModelSet,
    counter_value,
    generate_tokens,
    running_llm,
    shared_prefix_prompts,
    vocab_size_of,
)
from tests.e2e.test_connector import counter, embedded_yaml, kvtier_config
from tests.fixtures.draft_weights import checkpoint_weights, noisy, swap_draft_weights
from tests.integration.daemon_harness import DaemonFiles, Processes

pytestmark = pytest.mark.slow

ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTED = "vllm:spec_decode_num_draft_tokens"
STALE = "vllm:kvtier_stale_draft_chunks_served"
FILLS = "vllm:kvtier_draft_fill_chunks"
SWAPS = "vllm:kvtier_draft_swaps"


def spec_config(models: ModelSet) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(models.target), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def fresh_prompts(tiny_models: ModelSet) -> list[list[int]]:  # this module's own
    return shared_prefix_prompts(
        2, vocab_size=vocab_size_of(tiny_models.target), prefix_len=320, seed=11
    )


@pytest.fixture(scope="module")
def weights(tiny_models: ModelSet) -> dict[str, dict[str, Any]]:
    original = checkpoint_weights(tiny_models.target)
    return {"original": original, "noisy": noisy(original)}


class Round:
    """One generation: outputs, tokens cached per prompt, and acceptance."""

    def __init__(self, llm: Any, prompts: list[list[int]]) -> None:
        accepted, drafted = counter_value(llm, ACCEPTED), counter_value(llm, DRAFTED)
        self.tokens, self.cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        self.accepted = counter_value(llm, ACCEPTED) - accepted
        self.drafted = counter_value(llm, DRAFTED) - drafted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def kvtier(capsys: pytest.CaptureFixture[str], address: str, *args: str) -> dict[str, Any]:
    capsys.readouterr()
    assert kvtier_cli([args[0], "--address", address, "--json", *args[1:]]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def revision_info(llm: Any) -> dict[str, float]:
    from vllm.v1.metrics.reader import Gauge

    return {
        m.labels["draft_revision"]: m.value
        for m in llm.get_metrics()
        if isinstance(m, Gauge) and m.name == "vllm:kvtier_draft_revision_info"
    }


def heard_of(llm: Any, revision: str) -> None:
    """Until the engine's client has heard, by a heartbeat, that ``revision`` is committed:
    its next step follows that. A fixed wait would count on heartbeats arriving on time."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    deadline = time.monotonic() + 30.0
    while not any(
        state.revision == revision and not state.swapping
        for state in scheduler.client.draft_states().values()
    ):
        assert time.monotonic() < deadline, f"the engine never heard {revision} committed"
        time.sleep(0.05)


def connector_acceptance(llm: Any, revision: str) -> tuple[float, float]:
    """(drafted, accepted) the connector recorded for one draft revision."""
    return (
        counter(llm, "vllm:kvtier_spec_drafted_tokens", draft_revision=revision),
        counter(llm, "vllm:kvtier_spec_accepted_tokens", draft_revision=revision),
    )


def test_an_admin_swap_keeps_the_target_pool_and_a_swap_back_restores_acceptance(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    fresh_prompts: list[list[int]],
    baseline: list[list[int]],
    weights: dict[str, dict[str, Any]],
    procs: Processes,
    daemon_files: DaemonFiles,
    capsys: pytest.CaptureFixture[str],
) -> None:
    daemon = procs.start_daemon(daemon_files)
    connector = kvtier_config({"mode": "sidecar", "socket_path": str(daemon_files.socket)})
    spec = spec_config(tiny_models)
    # one engine stores both pools of every prefix (the draft checkpoint's fingerprint)
    with running_llm(
        tiny_models.target, kv_transfer_config=connector, speculative_config=spec
    ) as seeding:
        assert Round(seeding, prompts).tokens == baseline[: len(prompts)]
        (original,) = list(revision_info(seeding))
    assert original.startswith("fp-")
    kvtier(capsys, daemon.admin_address, "drain")

    with running_llm(
        tiny_models.target, kv_transfer_config=connector, speculative_config=spec
    ) as llm:
        before = Round(llm, prompts)  # a fresh engine: every hit comes from kvtier
        assert before.tokens == baseline[: len(prompts)]
        assert min(before.cached) >= 600, before.cached
        assert before.acceptance == 1.0

        begun = kvtier(capsys, daemon.admin_address, "draft-swap", "--revision", "d2", "--begin")
        assert begun["previousRevision"] == original
        assert llm.reset_prefix_cache(reset_connector=True)
        swap_draft_weights(llm, weights["noisy"])
        done = kvtier(capsys, daemon.admin_address, "draft-swap", "--commit", begun["swapId"])
        assert done["revision"] == "d2"
        heard_of(llm, "d2")

        after = Round(llm, prompts)  # vLLM's own cache was reset: hits come from kvtier
        assert after.tokens == baseline[: len(prompts)]
        assert sum(after.cached) >= 0.95 * sum(before.cached), (after.cached, before.cached)
        assert after.acceptance < 0.5  # the new draft is another model
        assert counter(llm, FILLS, policy="previous") > 0  # d2 had no draft chunk yet
        assert revision_info(llm) == {original: 0, "d2": 1}
        assert counter(llm, SWAPS, source="admin") == 1
        # new prefixes store draft chunks of the new revision
        assert Round(llm, fresh_prompts).tokens == baseline[len(prompts) :]

        stats = kvtier(capsys, daemon.admin_address, "stats")
        revisions = {d["revision"]: d for d in stats["draftRevisions"]}
        assert revisions["d2"]["current"]
        assert not revisions[original].get("current", False)
        assert int(revisions["d2"]["chunks"]["cpu"]) > 0
        assert int(revisions[original]["chunks"]["cpu"]) > 0  # kept, evicted first

        # swap back to the original weights and revision: its draft chunks load again
        begun = kvtier(
            capsys, daemon.admin_address, "draft-swap", "--revision", original, "--begin"
        )
        assert llm.reset_prefix_cache(reset_connector=True)
        swap_draft_weights(llm, weights["original"])
        kvtier(capsys, daemon.admin_address, "draft-swap", "--commit", begun["swapId"])
        heard_of(llm, original)
        back = Round(llm, prompts)
        assert back.tokens == baseline[: len(prompts)]
        assert back.acceptance >= 0.95 * before.acceptance
        assert sum(back.cached) >= 0.95 * sum(before.cached)

        # no chunk of another revision was loaded as current
        assert STALE in {m.name for m in llm.get_metrics()}
        assert counter(llm, STALE) == 0
        # acceptance per revision, recorded by the connector, adds up to vLLM's own counters
        drafted = sum(connector_acceptance(llm, r)[0] for r in (original, "d2"))
        accepted = sum(connector_acceptance(llm, r)[1] for r in (original, "d2"))
        assert (drafted, accepted) == (counter_value(llm, DRAFTED), counter_value(llm, ACCEPTED))
        assert connector_acceptance(llm, "d2")[1] < connector_acceptance(llm, "d2")[0]


@pytest.mark.parametrize("policy", ["previous", "zeros"])
def test_fill_policies_write_defined_draft_pages_and_swaps_are_found_without_kvtier(
    policy: str,
    tiny_models: ModelSet,
    prompts: list[list[int]],
    fresh_prompts: list[list[int]],
    baseline: list[list[int]],
    weights: dict[str, dict[str, Any]],
    tmp_path: Path,
    shm_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier_vllm.kv.metadata import KVTierMetadata
    from kvtier_vllm.kv.worker_side.worker import KVTierWorker

    poison = 0x7F  # 3.4e38 in every float32 lane: no fill or KV ever holds it
    seen: dict[str, int] = {"poisoned": 0, "zero": 0, "loaded": 0, "left": 0}
    start_load_kv = KVTierWorker.start_load_kv

    def poisoned_first(self: KVTierWorker, meta: KVTierMetadata) -> None:
        blocks = sorted({b for job in meta.loads if job.plan == "target" for b in job.block_ids})
        pages = self.pages.get("draft", [])
        if blocks and pages:
            for layer in pages:
                layer[blocks] = poison
            seen["poisoned"] += len(blocks)
        start_load_kv(self, meta)
        for batch in self._receiving:  # asynchronous loads land on the loading thread
            batch.done.wait(60)
        for layer in pages if blocks else ():
            filled = layer[blocks]
            seen["left"] += int((filled == poison).all(dim=1).sum())
            seen["zero"] += int((filled == 0).all(dim=1).sum())
            seen["loaded"] += int(((filled != 0) & (filled != poison)).any(dim=1).sum())

    monkeypatch.setattr(KVTierWorker, "start_load_kv", poisoned_first)
    extra = {"kvtier_config": str(embedded_yaml(tmp_path, shm_path)), "draft_fill": policy}
    with running_llm(
        tiny_models.target,
        kv_transfer_config=kvtier_config(extra),
        speculative_config=spec_config(tiny_models),
    ) as llm:
        first = Round(llm, prompts)  # stores both pools of the checkpoint's revision
        assert first.tokens == baseline[: len(prompts)]
        (original,) = list(revision_info(llm))
        # a swap with no admin call, as vLLM's weight update does it
        assert llm.reset_prefix_cache(reset_connector=True)
        swap_draft_weights(llm, weights["noisy"])
        after = Round(llm, prompts)
        assert after.tokens == baseline[: len(prompts)]
        assert min(after.cached) >= 600, after.cached  # target chunks hit
        assert counter(llm, SWAPS, source="fingerprint") == 1
        (current,) = [r for r, v in revision_info(llm).items() if v == 1]
        assert current.startswith(f"{original}+fp-")
        fills = counter(llm, FILLS, policy=policy)
        assert fills > 0
        assert counter(llm, FILLS) == fills  # previous chunks exist for every hit
        # every draft page the fill touched holds defined data: the previous revision's KV,
        # or zeros; none is left as it was
        assert seen["poisoned"] > 0
        assert seen["left"] == 0
        if policy == "zeros":
            assert seen["loaded"] == 0
        else:
            assert seen["loaded"] > 0

        # back to the original weights, without reset_cache: the workers see it before storing
        swap_draft_weights(llm, weights["original"])
        assert Round(llm, fresh_prompts).tokens == baseline[len(prompts) :]
        assert counter(llm, SWAPS, source="fingerprint") == 2
        assert revision_info(llm)[original] == 1
        assert counter(llm, STALE) == 0


def test_an_eagle_head_swap_is_found_and_target_chunks_keep_hitting(
    eagle_models: EagleModels, tmp_path: Path, shm_path: Path
) -> None:
    target = eagle_models.target
    prompts = shared_prefix_prompts(
        4, vocab_size=vocab_size_of(target), prefix_len=640, suffix_len=48, num_prefixes=4
    )
    spec = {"method": "eagle", "model": str(eagle_models.head), "num_speculative_tokens": 3}
    head = checkpoint_weights(eagle_models.head)
    connector = kvtier_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path))})
    with running_llm(target, kv_transfer_config=connector, speculative_config=spec) as llm:
        first = Round(llm, prompts)  # computes and stores both pools
        assert first.acceptance > 0.5  # the head guesses well: lost draft KV would show
        assert llm.reset_prefix_cache(reset_connector=True)
        swap_draft_weights(llm, noisy(head))
        after = Round(llm, prompts)
        assert after.tokens == first.tokens
        assert min(after.cached) >= 600, after.cached
        assert counter(llm, SWAPS, source="fingerprint") == 1
        assert counter(llm, FILLS, policy="previous") > 0
        assert after.acceptance < first.acceptance
        # the head's own weights again: its stored draft chunks are current once more
        assert llm.reset_prefix_cache(reset_connector=True)
        swap_draft_weights(llm, head)
        back = Round(llm, prompts)
        assert back.tokens == first.tokens
        assert min(back.cached) >= 600, back.cached
        assert back.acceptance >= 0.95 * first.acceptance
        assert counter(llm, STALE) == 0
