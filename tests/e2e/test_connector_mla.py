"""MLA (a DeepSeek-V2-shaped model) in the real vLLM engine: the latent cache is the same on every
TP rank, so rank 0 stores one copy per chunk, every rank loads it, and engines of either TP degree
share it.

vLLM's CPU build runs MLA on its reference backend (CPU_MLA, named here so that a machine with
AMX does not pick the bf16-only AMX backend), with 16-token blocks and its own prefix caching
off: every hit below comes from kvtier. A prompt of 690 tokens hits its 43 full blocks (688).
Each engine reports what its workers hold in their KV caches (a digest per written block and
layer), so the test sees that the bytes every rank loaded are the bytes a rank computed.

At TP=2 the first token's logprob after a hit is compared with vLLM's own ExampleConnector's under
the same schedule: vLLM's CPU path computes a prompt's last tokens with another float order when
they share a step with another prompt's than when they have one of their own (ExampleConnector
itself moves the logprob by 4e-6 in one and 3.5e-3 in the other), so only the same schedule
makes the logprobs comparable, and there they are equal bit for bit.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.models import (
    ModelSet,
    build_deepseek_mla,
    counter,
    counter_value,
    greedy,
    running_llm,
    untimed_transfers,
)
from tests.e2e.test_connector import EXTERNAL_HITS
from tests.e2e.test_connector_tp import sidecar
from tests.e2e.test_engine_baseline import example_connector
from tests.integration.daemon_harness import DaemonFiles, Processes

# five engines in the first test, three of them TP=2 with a process per rank
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

PROMPT_TOKENS = 690
HIT_TOKENS = 688  # 43 blocks of 16
LATENT_CHUNK_BYTES = 16 * 576 * 4 * 3  # one block of a 576-wide fp32 latent, 3 layers
LOGPROB_GAP = 1.3e-4
"""How far vLLM's own ExampleConnector moved the first token's logprob in one run: loaded KV
computes the last tokens through another kernel path than a whole prefill, nothing more."""


@pytest.fixture(scope="module")
def mla_model(models_dir: Path, tiny_models: ModelSet) -> Path:
    return build_deepseek_mla(models_dir, tokenizer_dir=tiny_models.tokenizer)


@pytest.fixture(scope="module")
def mla_prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 1999) for _ in range(PROMPT_TOKENS)] for _ in range(2)]


@contextmanager
def mla_engine(model: Path, tp: int, connector: dict[str, Any] | None) -> Iterator[Any]:
    kwargs: dict[str, Any] = {"block_size": 16, "attention_config": {"backend": "CPU_MLA"}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # `written_blocks` runs in workers
        if tp > 1:
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
            kwargs |= {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
        with running_llm(model, kv_transfer_config=connector, **kwargs) as llm:
            yield llm


def written_blocks(worker: Any) -> dict[str, set[str]]:
    """Per layer, a digest of every block this worker's KV cache holds that was written."""
    context = worker.vllm_config.compilation_config.static_forward_context
    out: dict[str, set[str]] = {}
    for name, layer in context.items():
        cache = getattr(layer, "kv_cache", None)
        if cache is None:
            continue
        cache = cache[0] if isinstance(cache, list | tuple) else cache
        written = cache.flatten(1).abs().sum(dim=1).nonzero().flatten().tolist()
        out[name] = {hashlib.sha256(cache[b].numpy().tobytes()).hexdigest() for b in written}
    return out


def generate(llm: Any, prompts: list[list[int]]) -> tuple[list[list[int]], list[float], list[int]]:
    """Greedy tokens, the first token's logprob and the cached tokens, per prompt."""
    params = greedy(4)
    params.logprobs = 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return (
        [list(o.outputs[0].token_ids) for o in outs],
        [next(iter(o.outputs[0].logprobs[0].values())).logprob for o in outs],
        [o.num_cached_tokens or 0 for o in outs],
    )


@contextmanager
def steps(llm: Any) -> Iterator[list[list[int]]]:
    """The tokens each step scheduled, per request (sorted), of an in-process engine."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule
    scheduled: list[list[int]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            scheduled.append(sorted(out.num_scheduled_tokens.values()))
        return out

    scheduler.schedule = recording
    try:
        yield scheduled
    finally:
        scheduler.schedule = schedule


def schedules(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Greedy tokens, first-token logprobs and cached tokens of ``prompts`` submitted together,
    then one at a time; and the steps that computed the tokens past each hit."""
    with steps(llm) as together_steps:
        together = generate(llm, prompts)
    with steps(llm) as alone_steps:
        alone = [generate(llm, [p]) for p in prompts]
    return {
        "together": together,
        "alone": tuple([a[i][0] for a in alone] for i in range(3)),
        "steps": (
            [s for s in together_steps if max(s) > 1],
            [s for s in alone_steps if max(s) > 1],
        ),
    }


def unmatched(computed: list[dict[str, set[str]]], held: list[dict[str, set[str]]]) -> int:
    """The most blocks, in any rank and layer, that a rank computed and the other engine's rank
    does not hold bit for bit (rank 0's where the degrees differ: the latent is the same on
    every rank)."""
    missing = 0
    for rank, layers in enumerate(held):
        source = computed[rank] if len(computed) == len(held) else computed[0]
        missing = max([missing, *(len(source[name] - blocks) for name, blocks in layers.items())])
    return missing


def test_mla_chunks_hold_the_latent_tp2_computed_and_hit_at_tp2_and_tp1(
    mla_model: Path,
    mla_prompts: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
    tmp_path: Path,
) -> None:
    with mla_engine(mla_model, 1, None) as llm:
        alone_tp1 = generate(llm, mla_prompts)
    # vLLM's own ExampleConnector at TP=2: its first round computes every token, as vLLM alone
    # does; the later ones load its files (vLLM's prefix caching is off for MLA on the CPU)
    with mla_engine(mla_model, 2, example_connector(tmp_path / "example")) as llm:
        reference = generate(llm, mla_prompts)
        example = schedules(llm, mla_prompts)
    assert example["together"][2] == [HIT_TOKENS, HIT_TOKENS]
    # the last tokens of both prompts in one step, then each in a step of its own
    assert example["steps"] == ([[2, 2]], [[2], [2]])
    procs.start_daemon(daemon_files)
    connector = sidecar(daemon_files)
    with mla_engine(mla_model, 2, connector) as llm:
        # nothing to hit yet: this engine computes every token, as vLLM alone does
        tokens, first, cached = generate(llm, mla_prompts)
        assert cached == [0, 0]
        assert (tokens, first) == reference[:2]
        computed = llm.collective_rpc(written_blocks)
        stored = counter(llm, "vllm:kvtier_transfer_chunks", direction="store")
        stored_bytes = counter(llm, "vllm:kvtier_transfer_bytes", direction="store")
    # one latent copy per chunk: rank 0 wrote it, rank 1 wrote nothing
    assert stored == 2 * HIT_TOKENS // 16
    assert stored_bytes == stored * LATENT_CHUNK_BYTES
    # the float order of TP=2 against TP=1, without kvtier
    degrees = max(abs(a - b) for a, b in zip(alone_tp1[1], first, strict=True))
    with mla_engine(mla_model, 2, connector) as llm:
        # twice: the second round loads the chunks again into blocks the first one freed
        for _ in range(2):
            hits = schedules(llm, mla_prompts)
            # kvtier's asynchronous loads land in one step, so the tokens past the hits are
            # computed as ExampleConnector's are: in one step together, alone one at a time
            assert hits["steps"] == example["steps"]
            assert hits["together"][2] == [HIT_TOKENS, HIT_TOKENS]
            assert hits["alone"][2] == [HIT_TOKENS, HIT_TOKENS]
            # every rank holds the 43 full blocks of each prompt as TP=2 computed them; what
            # may differ is each prompt's last block, with tokens computed after the hit
            assert unmatched(computed, llm.collective_rpc(written_blocks)) <= len(mla_prompts)
            # the same tokens and logprobs as ExampleConnector's, bit for bit, in each schedule:
            # what moves them from vLLM alone's is vLLM's float order over the batch
            assert hits["together"][:2] == example["together"][:2]
            assert hits["alone"][:2] == example["alone"][:2]
            assert hits["together"][0] == tokens
        assert counter_value(llm, EXTERNAL_HITS) == 2 * 2 * 2 * HIT_TOKENS
        # both ranks' loads timed with their bytes
        assert not untimed_transfers(llm)
    with mla_engine(mla_model, 1, connector) as llm:
        cross, cross_first, cached = generate(llm, mla_prompts)
        held = llm.collective_rpc(written_blocks)
    assert cached == [HIT_TOKENS, HIT_TOKENS]
    assert unmatched(computed, held) <= len(mla_prompts)
    # the TP=1 engine computes its last tokens over TP=2's latent: within the gap between
    # the two degrees without kvtier
    assert max(abs(a - b) for a, b in zip(cross_first, first, strict=True)) <= degrees + LOGPROB_GAP
    assert len(cross) == 2


def test_mla_tp1_chunks_hit_in_a_fresh_tp1_engine_with_vllm_alone_outputs(
    mla_model: Path,
    mla_prompts: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
) -> None:
    procs.start_daemon(daemon_files)
    connector = sidecar(daemon_files)
    with mla_engine(mla_model, 1, connector) as llm:
        tokens, first, cached = generate(llm, mla_prompts)  # as vLLM alone: nothing to hit
        assert cached == [0, 0]
        computed = llm.collective_rpc(written_blocks)
    with mla_engine(mla_model, 1, connector) as llm:
        for _ in range(2):
            again, again_first, cached = generate(llm, mla_prompts)
            assert cached == [HIT_TOKENS, HIT_TOKENS]
            assert again == tokens
            assert max(abs(a - b) for a, b in zip(again_first, first, strict=True)) <= LOGPROB_GAP
        held = llm.collective_rpc(written_blocks)
    assert unmatched(computed, held) <= len(mla_prompts)
