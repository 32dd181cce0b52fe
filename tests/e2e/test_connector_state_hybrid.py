"""Hybrid models whose state-space or linear-attention layers keep a state, not KV (vLLM's
MambaSpec groups), with prefix caching in vLLM's ``align`` mode: kvtier stores each chunk's
attention KV and every state layer's state at the chunk's end, and a hit is the last chunk
where both are held. Outputs must equal vLLM's own, top-3 logprobs included.

Each model builder comes with its state stride: vLLM raises the block size to it, and every
engine here computes at most one stride per step, so a state is kept at every boundary.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import pytest
from kvtier_vllm.kv.connector_stats import VERIFY_RESULTS

from kvtier.core.blockfmt import decode, peek_header
from kvtier.core.keys import Pool, namespace_of
from kvtier.tiers.lmdb_reader import DATABASES
from tests.e2e.models import (
    QWEN3_NEXT_ENGINE,
    ModelSet,
    build_mamba2_hybrid,
    build_qwen3_next_hybrid,
    mamba2_align_on_cpu,
    running_llm,
    shared_prefix_prompts,
    vocab_size_of,
)
from tests.e2e.test_connector import (
    TRANSFER_BYTES,
    VERIFIED,
    cached_by_source,
    counter,
    embedded_yaml,
    kvtier_config,
)
from tests.e2e.test_connector_hybrid import Run, generate
from tests.fixtures.engines import scheduler_of
from tests.integration.daemon_harness import Processes, RunningDaemon, wait_for, write_config

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class StateModel:
    build: Callable[..., Path]
    stride: int
    """Tokens between kept states: the block size vLLM raises this model's to."""
    dtype: str
    engine_patch: Callable[[], AbstractContextManager[None]] = nullcontext
    """Held around every engine of the model."""
    engine_args: dict[str, Any] = field(default_factory=dict)


STATE_MODELS = [
    pytest.param(
        StateModel(build_qwen3_next_hybrid, 544, "bfloat16", engine_args=QWEN3_NEXT_ENGINE),
        id="qwen3-next",
    ),
    # fp32 like its conv and ssm states; vLLM's CPU build keeps them at boundaries only patched
    pytest.param(StateModel(build_mamba2_hybrid, 96, "float32", mamba2_align_on_cpu), id="mamba2"),
]
STRIDES = 2
"""Whole strides in each prompt: a hit ends at one of two boundaries."""
SUFFIX = 40
"""Tokens past the last whole stride: under half of any stride, so a prompt's last kept state is
at its last whole stride, and one stride plus a suffix ends before a prompt diverging in the
middle of its second stride."""


@dataclass(frozen=True)
class Served:
    path: Path
    model: StateModel

    def engine(self, **kwargs: Any) -> dict[str, Any]:
        return {
            "dtype": self.model.dtype,
            "enable_prefix_caching": True,
            "max_num_batched_tokens": self.model.stride,
            **self.model.engine_args,
            **kwargs,
        }


@pytest.fixture(scope="module", params=STATE_MODELS)
def served(
    request: pytest.FixtureRequest, models_dir: Path, tiny_models: ModelSet
) -> Iterator[Served]:
    model: StateModel = request.param
    with model.engine_patch():
        yield Served(model.build(models_dir, tokenizer_dir=tiny_models.tokenizer), model)


@pytest.fixture(scope="module")
def state_prompts(served: Served) -> list[list[int]]:
    stride = served.model.stride
    return shared_prefix_prompts(
        2,
        vocab_size=vocab_size_of(served.path),
        prefix_len=STRIDES * stride,
        suffix_len=SUFFIX,
        num_prefixes=2,
        seed=11,
    )


@dataclass(frozen=True)
class Baseline:
    cold: Run
    hit: Run
    """Asked again, on vLLM's own prefix cache: what a kvtier hit must reproduce."""


@pytest.fixture(scope="module")
def baseline(served: Served, state_prompts: list[list[int]]) -> Baseline:
    with running_llm(served.path, **served.engine()) as llm:
        block = llm.llm_engine.vllm_config.cache_config.block_size
        assert block == served.model.stride, "the builder's stride is not vLLM's block size"
        cold = generate(llm, state_prompts)
        hit = generate(llm, state_prompts)
    assert hit.cached == [STRIDES * served.model.stride] * len(state_prompts)
    return Baseline(cold, hit)


def test_a_fresh_engine_hits_the_kv_and_state_another_stored(
    served: Served,
    state_prompts: list[list[int]],
    baseline: Baseline,
    procs: Processes,
    tmp_path: Path,
    shm_path: Path,
) -> None:
    files = write_config(
        tmp_path, shm_path, {"arena": {"size_bytes": 64 << 20, "min_slot_bytes": 16 << 10}}
    )
    sidecar = kvtier_config({"mode": "sidecar", "socket_path": str(files.socket)})
    procs.start_daemon(files)
    hit_tokens = STRIDES * served.model.stride
    with running_llm(served.path, **served.engine(kv_transfer_config=sidecar)) as llm:
        first = generate(llm, state_prompts)
        stored = counter(llm, TRANSFER_BYTES, direction="store", pool="state")
    assert first.same_output(baseline.cold)
    assert stored > 0
    with running_llm(served.path, **served.engine(kv_transfer_config=sidecar)) as llm:
        run = generate(llm, state_prompts)
        loaded = counter(llm, TRANSFER_BYTES, direction="load", pool="state")
        from_arena = cached_by_source(llm, "host")
    assert run.cached == [hit_tokens] * len(state_prompts)
    assert from_arena == hit_tokens * len(state_prompts)
    assert loaded > 0
    assert run.same_output(baseline.hit)


def diverging(prompt: list[int], stride: int) -> list[int]:
    """``prompt`` up to the middle of its second stride, then other tokens: a hit ends at the
    boundary before the divergence."""
    other = shared_prefix_prompts(1, prefix_len=stride, suffix_len=0, seed=99)[0]
    return prompt[: stride + stride // 2] + other


def test_embedded_hits_the_stored_state_and_a_diverging_prompt_the_boundary_before(
    served: Served,
    state_prompts: list[list[int]],
    baseline: Baseline,
    tmp_path: Path,
    shm_path: Path,
) -> None:
    stride = served.model.stride
    diverged = diverging(state_prompts[0], stride)
    with running_llm(served.path, **served.engine()) as llm:
        # vLLM keeps a finished prompt's last boundary state only: one ending past the first
        generate(llm, [state_prompts[0][: stride + SUFFIX]])
        reference = generate(llm, [diverged])  # on vLLM's own prefix cache
    assert reference.cached == [stride]
    # hits from lmdb wait for their promotion: room for a slow machine
    connector = kvtier_config(
        {"kvtier_config": str(embedded_yaml(tmp_path, shm_path)), "promote_wait_ms": 20000}
    )
    with running_llm(served.path, **served.engine(kv_transfer_config=connector)) as llm:
        first = generate(llm, state_prompts)
    assert first.same_output(baseline.cold)
    # the first engine closed its tiers: a fresh one hits what lmdb kept
    with running_llm(served.path, **served.engine(kv_transfer_config=connector)) as llm:
        partial = generate(llm, [diverged])
        run = generate(llm, state_prompts)
        loaded = counter(llm, TRANSFER_BYTES, direction="load", pool="state")
        verified, swapped = verify_states(llm, state_prompts, baseline)
    assert partial.cached == [stride]
    assert partial.same_output(reference)
    # the first prompt's first stride is in vLLM's own cache now; kvtier loads the rest
    assert run.cached == [STRIDES * stride] * len(state_prompts)
    assert run.same_output(baseline.hit)
    assert loaded > 0
    # every hit's last state compared part by part: none left unchecked
    assert verified == {"match": len(state_prompts), "mismatch": 0, "unchecked": 0}
    assert swapped["mismatch"] >= 1


def verify_states(
    llm: Any, prompts: list[list[int]], baseline: Baseline
) -> tuple[dict[str, float], dict[str, float]]:
    """With every hit verified, ``prompts`` asked again, then again once lmdb's state chunks
    were stored anew each with another's payload (`rotate_lmdb_chunks`); the state chunks'
    verdicts each time. The wrong states' namespace ends quarantined, every output vLLM's
    own."""
    scheduler = scheduler_of(llm)
    [plan] = [key for key in scheduler.namespaces if key.startswith(str(Pool.STATE))]
    scheduler.verifier.rate = 1.0

    def verdicts() -> dict[str, float]:
        return {r: counter(llm, VERIFIED, pool="state", result=r) for r in VERIFY_RESULTS}

    assert llm.reset_prefix_cache()  # the lookups go to kvtier: sampled, computed, compared
    right = generate(llm, prompts)
    counted = verdicts()
    state_errors = [e for pool, e in scheduler.verifier.errors if pool == "state"]
    print(f"relative errors of right states: {state_errors}")
    assert right.cached == [0] * len(prompts)
    assert right.same_tokens_and_top(baseline.cold, tolerance=1e-3)
    assert rotate_lmdb_chunks(scheduler, plan) >= len(prompts)
    assert llm.reset_prefix_cache()
    wrong = generate(llm, prompts)
    assert wrong.same_tokens_and_top(baseline.cold, tolerance=1e-3)
    assert list(scheduler.verifier.quarantined) == [bytes(scheduler.namespaces[plan])]
    after = verdicts()
    return counted, {r: after[r] - counted[r] for r in VERIFY_RESULTS}


def rotate_lmdb_chunks(scheduler: Any, plan: str) -> int:
    """Store each chunk of ``plan`` (a plan key) that an embedded engine's lmdb holds again
    with the next one's payload, through lmdb's own store path (a fresh header and checksum),
    as a store path filing payloads under the wrong keys would: only a recomputation can tell
    them wrong. Returns how many chunks changed."""
    namespace = scheduler.namespaces[plan]
    store = scheduler.session.client.manager.lmdb
    held = store.keys()  # the tier's chunks: no mapping to iterate
    keys = sorted(k for k in held if namespace_of(k) == namespace)
    payloads = []
    for key in keys:
        value = bytearray(store.encoded_length(key))
        assert store.copy_encoded(key, memoryview(value))
        payloads.append(bytes(decode(value, key)))
    rotated = payloads[1:] + payloads[:1]
    store.delete(keys)
    assert all(store.put_many(list(zip(keys, rotated, strict=True))))
    return sum(new != old for new, old in zip(rotated, payloads, strict=True))


def corrupt_states(lmdb_dir: Path) -> int:
    """Flip the last payload byte of every state chunk in lmdb (kvtierd stopped), as a failing
    disk would; how many there were."""
    env = lmdb.open(str(lmdb_dir), max_dbs=len(DATABASES), subdir=True)
    flipped = 0
    try:
        with env.begin(write=True, db=env.open_db(b"chunks", create=False)) as txn:
            for key, stored in list(txn.cursor()):
                if peek_header(stored).pool is not Pool.STATE:
                    continue
                value = bytearray(stored)
                value[-1] ^= 0xFF
                txn.put(key, bytes(value))
                flipped += 1
    finally:
        env.close()
    return flipped


def integrity_failures(daemon: RunningDaemon, pool: str) -> float:
    return sum(
        value
        for name, labels, value in daemon.metrics()
        if name == "kvtier_integrity_failures_total" and labels.get("pool") == pool
    )


def test_a_corrupted_state_is_never_served_and_is_counted(
    served: Served,
    state_prompts: list[list[int]],
    baseline: Baseline,
    procs: Processes,
    tmp_path: Path,
    shm_path: Path,
) -> None:
    files = write_config(
        tmp_path, shm_path, {"arena": {"size_bytes": 64 << 20, "min_slot_bytes": 16 << 10}}
    )
    sidecar = kvtier_config(
        {"mode": "sidecar", "socket_path": str(files.socket), "promote_wait_ms": 20000}
    )
    # what every deployment runs: a load that failed is recomputed
    sidecar["kv_load_failure_policy"] = "recompute"
    daemon = procs.start_daemon(files)
    with running_llm(served.path, **served.engine(kv_transfer_config=sidecar)) as llm:
        generate(llm, state_prompts)
    assert daemon.signal_and_wait(signal.SIGTERM, 60) == 0  # drains the arena to lmdb
    # every boundary's state, each prompt's two: the attention KV beside them is intact
    assert corrupt_states(files.lmdb) == STRIDES * len(state_prompts)
    daemon = procs.start_daemon(files)
    with running_llm(served.path, **served.engine(kv_transfer_config=sidecar)) as llm:
        run = generate(llm, state_prompts)
    # the workers read each state from lmdb, find it corrupt and recompute from the first
    # block: with no state at any boundary, KV alone is never a hit
    assert run.cached == [0] * len(state_prompts)
    # recomputed in other batches than the baseline's, which round bf16 otherwise
    assert run.same_tokens_and_top(baseline.cold, tolerance=1e-3)
    wait_for(lambda: integrity_failures(daemon, "state") > 0, 30, "the corrupt states counted")
