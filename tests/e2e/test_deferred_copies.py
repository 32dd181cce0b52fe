"""A slot rewritten while its load is still on its way must cost a recompute, never wrong KV.

On a GPU, loads are queued on a side stream and the bytes are read later; an arena-index hit
holds no lease, so kvtierd may evict its slot and store another chunk there in between. Here
the worker runs on `DeferredCopies`, which lands copies as late as a device could, and kvtierd
rewrites every slot a load reads between the queueing and the landing: vLLM must be told of
every such load, recompute it, and give the outputs it gives without a connector.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvtier_vllm.connector import KVTierConnector
from kvtier_vllm.kv.metadata import KVTierMetadata
from kvtier_vllm.kv.worker_side import worker as worker_module
from kvtier_vllm.kv.worker_side.worker import KVTierWorker
from kvtier_vllm.shared.copies import DeferredCopies, Pair

from benchmarks.harness.connector import kvtier_connector
from kvtier.core.protocol import SlotRef
from kvtier.rpc import GrpcTierClient
from kvtier.tiers.arena import ArenaMemory
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import (
    ModelSet,
    counter,
    counter_value,
    generate_tokens,
    running_llm,
    untimed_transfers,
)
from tests.e2e.test_connector import EVERY_LOAD, NO_VERIFICATION, SHARED_CORE_DEADLINES
from tests.integration.daemon_harness import DaemonFiles, Processes, RunningDaemon
from tests.support import keys_for, layout, target_spec

KiB = 1 << 10

EXTERNAL_HITS = "vllm:external_prefix_cache_hits"


class Rewriter:
    """Runs as copies out of the arena are about to land: evicts every chunk the arena holds,
    then stores chunks of another model in the slots they left, each with the bytes of another
    evicted chunk. The queued loads then read real KV of the wrong chunk, from slots whose
    generation moved."""

    def __init__(self, daemon: RunningDaemon, socket: Path, chunk_bytes: int) -> None:
        self.admin = daemon.admin()
        self.client = GrpcTierClient(socket, "rewriter")
        # as many heads as make the engine's chunk size, so its slots fit another model's chunks
        another = target_spec(model="another", layout=layout(heads=chunk_bytes // (16 * KiB)))
        self.namespace = self.client.register_pool(another, chunk_bytes)
        self.arena = ArenaMemory.attach(self.client.arena_path)
        self.reads = 0
        """Copies out of the arena that landed."""
        self.rewritten = 0
        """Of those, the ones whose slot was rewritten after they were queued."""
        self.leases: list[int] = []
        """Leases kvtierd held each time, before evicting."""
        self._stored = 0

    def __call__(self, copies: DeferredCopies, pairs: list[Pair]) -> None:
        reads = [at for _, src in pairs if (at := copies.arena_offset(src)) is not None]
        if not reads:
            return  # stores
        self.leases.append(self.admin.stats().leases)
        evicted = sum(self.admin.evict(tier="cpu").values())
        # an extent whose slots were all evicted goes back to the arena, and may come back in any
        # order: reserve until every slot a copy reads from is taken again, or the arena is full
        refs: list[SlotRef] = []
        while not all(any(r.offset <= at < r.offset + r.nbytes for r in refs) for at in reads):
            keys = keys_for(self.namespace, max(evicted, 1), start=self._stored)
            self._stored += len(keys)
            taken = [r for r in self.client.reserve(keys) if r is not None]
            if not taken:
                break
            refs += taken
        old = [bytes(self.arena.view(r.offset, r.nbytes)) for r in refs]
        for i, ref in enumerate(refs):
            self.arena.view(ref.offset, ref.nbytes)[:] = old[(i + 1) % len(old)]
        assert self.client.commit(refs) == len(refs)
        spans = [(r.offset, r.offset + r.nbytes) for r in refs]
        self.reads += len(reads)
        self.rewritten += sum(any(a <= at < b for a, b in spans) for at in reads)

    def close(self) -> None:
        self.client.close()
        self.arena.close()
        self.admin.close()


def sidecar(socket: Path) -> dict[str, Any]:
    return kvtier_connector(
        {
            "mode": "sidecar",
            "socket_path": str(socket),
            **SHARED_CORE_DEADLINES,
            **NO_VERIFICATION,
            **EVERY_LOAD,
        }
    )


def test_a_slot_rewritten_before_its_load_landed_is_recomputed(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    daemon = procs.start_daemon(daemon_files)
    connector = sidecar(daemon_files.socket)
    expected = baseline[: len(prompts)]
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
    cpu = next(t for t in daemon.stats().tiers if t.tier == "cpu")
    stored = next(p.usage for p in cpu.pools if p.pool == "target")
    assert stored.chunks > 0

    rewriter = Rewriter(daemon, daemon_files.socket, stored.used_bytes // stored.chunks)
    monkeypatch.setattr(worker_module, "copies_for", lambda device: DeferredCopies(rewriter))
    loaded: set[int] = set()
    reported: set[int] = set()
    start_load_kv = KVTierWorker.start_load_kv
    load_errors = KVTierConnector.get_block_ids_with_load_errors

    def loading(self: KVTierWorker, meta: KVTierMetadata) -> None:
        loaded.update(b for job in meta.loads for b in job.block_ids if b)
        start_load_kv(self, meta)

    def reporting(self: KVTierConnector) -> set[int]:
        errors = load_errors(self)
        reported.update(errors)
        return errors

    monkeypatch.setattr(KVTierWorker, "start_load_kv", loading)
    monkeypatch.setattr(KVTierConnector, "get_block_ids_with_load_errors", reporting)
    try:
        with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
            tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            hits = counter_value(llm, EXTERNAL_HITS)
            chunks = counter(llm, "vllm:kvtier_transfer_chunks", direction="load")
            errors = counter(llm, "vllm:kvtier_transfer_errors", direction="load")
            untimed = untimed_transfers(llm)
    finally:
        rewriter.close()
    # the fresh engine found the first one's chunks in kvtierd's arena, from its key index:
    # no lease stood behind them
    assert hits > 0
    assert rewriter.leases
    assert rewriter.leases[0] == 0
    # every load read a slot rewritten after it was queued, and vLLM heard of every block
    assert rewriter.reads > 0
    assert rewriter.rewritten == rewriter.reads
    assert loaded
    assert reported == loaded
    assert errors == chunks > 0
    assert not untimed  # failed copies too: each timed with its bytes
    # and recomputed them: the outputs of an engine without kvtier
    assert tokens == expected
