"""A connector hook that fails never reaches vLLM: the blocks it would have loaded are recomputed.
Real engine (the CPU build), in-process, so the test can break the hooks it runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, counter_value, generate_tokens, running_llm
from tests.e2e.test_connector import EXTERNAL_HITS, embedded_yaml, kvtier_config

pytestmark = pytest.mark.slow


def recomputing(extra: dict[str, Any]) -> dict[str, Any]:
    """The connector with the failure policy kvtier's README asks for."""
    return {**kvtier_config(extra), "kv_load_failure_policy": "recompute"}


class Breaker:
    """Makes one connector hook raise, once, on a call that carries a load, after scrambling
    the blocks that load was for: if the failure were swallowed without reporting them, the
    engine would read noise."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        from kvtier_vllm.kv.worker_side.worker import KVTierWorker

        self.workers: list[Any] = []
        self.raised: list[str] = []
        register = KVTierWorker.register_kv_caches

        def recording(worker: Any, kv_caches: dict[str, Any]) -> None:
            register(worker, kv_caches)
            self.workers.append(worker)

        mp.setattr(KVTierWorker, "register_kv_caches", recording)
        self.mp = mp

    def scramble(self, blocks: list[int]) -> None:
        for worker in self.workers:
            for pages in worker.pages.values():
                for layer in pages:
                    layer[blocks] = torch.randint_like(layer[blocks], 0, 255)

    def arm(self, owner: type, hook: str, loads: Callable[..., list[int]]) -> None:
        """``owner.hook`` raises the first time ``loads(self, *args)`` names blocks."""
        real = getattr(owner, hook)

        def breaking(obj: Any, *args: Any) -> Any:
            blocks = [] if self.raised else loads(obj, *args)
            if blocks:
                self.scramble(blocks)
                self.raised.append(hook)
                raise RuntimeError(f"{hook} broken by the test")
            return real(obj, *args)

        self.mp.setattr(owner, hook, breaking)


def _load_blocks(meta: Any) -> list[int]:
    return [b for job in meta.loads for b in job.block_ids if b]


def _arm(breaker: Breaker, hook: str, load_mode: str) -> None:
    from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler
    from kvtier_vllm.kv.worker_side.worker import KVTierWorker

    if hook == "start_load_kv":
        breaker.arm(KVTierWorker, hook, lambda w, meta: _load_blocks(meta))
    elif hook == "finished_loads":
        breaker.arm(
            KVTierWorker,
            hook,
            # waits for each batch to land, as the hook itself may: a batch still copying
            # would otherwise be left for a later call, and this one raise for nothing
            lambda w: [
                b
                for batch in w._receiving
                if batch.done.wait(60) and batch.issued is not None
                for j, _ in batch.issued.copies
                for b in j.block_ids
            ],
        )
    elif hook == "block_ids_with_load_errors":
        breaker.arm(
            KVTierWorker,
            hook,
            lambda w: [b for i in w._loads for j, _ in i.copies for b in j.block_ids],
        )
    elif hook == "update_state_after_alloc":

        def external(s: Any, request: Any, blocks: Any, n: int) -> list[int]:
            # the blocks promised whole (a partial last block would be computed anyway)
            return [b for ids in blocks.get_block_ids() for b in ids[: n // s.block_size] if b]

        breaker.arm(KVTierScheduler, hook, external)
    elif load_mode == "async":
        # the loads granted since the last step go out with this one's metadata
        breaker.arm(KVTierScheduler, hook, lambda s, out: _load_blocks(s.pending.queued))
    else:

        def ready(s: Any, out: Any) -> list[int]:
            bpc = s.cfg.blocks_per_chunk
            return [
                b
                for new in out.scheduled_new_reqs
                if new.req_id in s.pending._ready
                for ids in new.block_ids
                for b in ids[: s.pending._ready[new.req_id].chunks * bpc]
                if b
            ]

        breaker.arm(KVTierScheduler, hook, ready)


@pytest.mark.parametrize(
    ("hook", "load_mode"),
    [
        ("update_state_after_alloc", "async"),
        ("build_connector_meta", "sync"),
        ("build_connector_meta", "async"),
        ("start_load_kv", "async"),
        ("block_ids_with_load_errors", "sync"),
        ("finished_loads", "async"),
    ],
)
def test_a_hook_that_raises_costs_a_recompute_never_an_error(
    hook: str,
    load_mode: str,
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    breaker = Breaker(monkeypatch)
    tiers = str(embedded_yaml(tmp_path, shm_path))
    # every hit loads (always): this tests the hooks, not the load-or-recompute decision
    connector = recomputing(
        {"kvtier_config": tiers, "load_mode": load_mode, "load_policy": "always"}
    )
    expected = baseline[: len(prompts)]
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
        _arm(breaker, hook, load_mode)
        llm.reset_prefix_cache()  # the next lookups go to kvtier
        tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert breaker.raised == [hook]
        assert tokens == expected
        # the hook works again: later requests hit
        hits = counter_value(llm, EXTERNAL_HITS)
        llm.reset_prefix_cache()
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
        assert counter_value(llm, EXTERNAL_HITS) > hits
