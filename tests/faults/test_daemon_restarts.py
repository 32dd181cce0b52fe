"""One engine outlives kvtierd restarts (SIGTERM and SIGKILL, arenas of other sizes at the same
path): outputs stay exact, each new arena is mapped again and serves hits, and a store planned
in the old arena is never written into the new one. Real engine (the CPU build), in-process,
against real kvtierd processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers.arena import ArenaMemory
from tests.e2e.conftest import MAX_TOKENS, set_engine_env
from tests.e2e.models import (
    ModelSet,
    generate_tokens,
    running_llm,
    shared_prefix_prompts,
    vocab_size_of,
)
from tests.e2e.test_connector import kvtier_config
from tests.integration.daemon_harness import DaemonFiles, Processes, RunningDaemon, write_config

pytestmark = pytest.mark.slow

MiB = 1 << 20
# each restart: how the old daemon ends, the arena size of the new one, and whether it happens
# between planning a step's stores and writing them
RESTARTS = [
    (signal.SIGTERM, 24 * MiB, False),  # smaller: slots the engine knew lie past its end
    (signal.SIGKILL, 96 * MiB, True),  # larger: old offsets still fit, only generations differ
    (signal.SIGKILL, 64 * MiB, False),
    (signal.SIGTERM, 40 * MiB, False),
]
FIRST_SIZE = 64 * MiB
BACK_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def round_prompts(tiny_models: ModelSet) -> list[list[list[int]]]:
    """Two prompts per daemon (the first and each restart), none sharing a block with another
    daemon's: a hit on them can only come from the arena they were stored in."""
    vocab = vocab_size_of(tiny_models.target)
    return [
        shared_prefix_prompts(2, vocab_size=vocab, prefix_len=320, suffix_len=40, seed=100 + i)
        for i in range(len(RESTARTS) + 1)
    ]


@pytest.fixture(scope="module")
def round_baseline(
    tiny_models: ModelSet,
    round_prompts: list[list[list[int]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[list[list[int]]]:
    """Greedy tokens of each round's prompts with no connector."""
    with pytest.MonkeyPatch.context() as mp:
        set_engine_env(mp, tmp_path_factory.mktemp("round-baseline"))
        with running_llm(tiny_models.target) as llm:
            flat, _ = generate_tokens(
                llm, [p for r in round_prompts for p in r], max_tokens=MAX_TOKENS
            )
    return [flat[i : i + 2] for i in range(0, len(flat), 2)]


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The connector's workers, as they register their caches."""
    from kvtier_vllm.kv.worker_side.worker import KVTierWorker

    found: list[Any] = []
    register = KVTierWorker.register_kv_caches

    def recording(worker: Any, kv_caches: dict[str, Any]) -> None:
        register(worker, kv_caches)
        found.append(worker)

    monkeypatch.setattr(KVTierWorker, "register_kv_caches", recording)
    return found


def _config(tmp_path: Path, shm_path: Path, size: int) -> DaemonFiles:
    """The same paths (socket, arena, lmdb) every time; only the arena size changes."""
    return write_config(
        tmp_path, shm_path, {"arena": {"size_bytes": size, "min_slot_bytes": 16 << 10}}
    )


def _sidecar(files: DaemonFiles) -> dict[str, Any]:
    extra = {"mode": "sidecar", "socket_path": str(files.socket), "probe_interval_ms": 200}
    return {**kvtier_config(extra), "kv_load_failure_policy": "recompute"}


def _stop(daemon: RunningDaemon, signum: int) -> None:
    if signum == signal.SIGTERM:
        assert daemon.signal_and_wait(signum, timeout_s=30) == 0  # drained to lmdb
    else:
        daemon.signal_and_wait(signum, timeout_s=30)


def _store_then_hit(llm: Any, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """Exact outputs until the connector is back: its prompts stored, then hit."""
    deadline = time.monotonic() + BACK_WITHIN_S
    while True:
        llm.reset_prefix_cache()
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
        llm.reset_prefix_cache()
        tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert tokens == expected
        if all(c > 0 for c in cached):
            return
        assert time.monotonic() < deadline, f"no hit within {BACK_WITHIN_S} s: {cached}"
        time.sleep(0.2)


class MidStore:
    """Replaces the daemon between planning a step's stores and writing them, once armed: their
    slots then name free slots of a fresh arena, which must stay as they were."""

    def __init__(self, mp: pytest.MonkeyPatch, procs: Processes) -> None:
        from kvtier_vllm.kv.worker_side.worker import KVTierWorker

        self.procs = procs
        self.armed: tuple[RunningDaemon, DaemonFiles] | None = None
        self.daemon: RunningDaemon | None = None
        self.untouched: list[bool] = []
        save = KVTierWorker.wait_for_save

        def replacing(worker: Any, meta: Any) -> None:
            if not meta.stores or self.armed is None:
                save(worker, meta)
                return
            old, files = self.armed
            self.armed = None
            old.signal_and_wait(signal.SIGKILL, timeout_s=30)
            self.daemon = procs.start_daemon(files)
            successor = ArenaMemory.attach(self.daemon.arena, populate=False)
            try:
                spans = [(j.offset, worker.plans[j.plan].chunk_bytes) for j in meta.stores]
                spans = [(o, n) for o, n in spans if o + n <= successor.size]
                before = [bytes(successor.view(o, n)) for o, n in spans]
                save(worker, meta)
                self.untouched.extend(
                    bytes(successor.view(o, n)) == b
                    for (o, n), b in zip(spans, before, strict=True)
                )
            finally:
                successor.close()

        mp.setattr(KVTierWorker, "wait_for_save", replacing)


def test_one_engine_outlives_kvtierd_restarts_and_hits_from_each_new_arena(
    tiny_models: ModelSet,
    round_prompts: list[list[list[int]]],
    round_baseline: list[list[list[int]]],
    tmp_path: Path,
    shm_path: Path,
    procs: Processes,
    workers: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mid_store = MidStore(monkeypatch, procs)
    files = _config(tmp_path, shm_path, FIRST_SIZE)
    daemon = procs.start_daemon(files)
    with running_llm(tiny_models.target, kv_transfer_config=_sidecar(files)) as llm:
        _store_then_hit(llm, round_prompts[0], round_baseline[0])
        (worker,) = workers
        for i, (signum, size, during_a_step) in enumerate(RESTARTS, start=1):
            files = _config(tmp_path, shm_path, size)
            if during_a_step:
                mid_store.armed = (daemon, files)
                llm.reset_prefix_cache()
                tokens, _ = generate_tokens(llm, round_prompts[i], max_tokens=MAX_TOKENS)
                assert tokens == round_baseline[i]
                assert mid_store.daemon is not None, "no step stored anything"
                daemon = mid_store.daemon
                assert mid_store.untouched, "no store planned in the old arena fits the new one"
                stale = mid_store.untouched.count(False)
                assert not stale, f"{stale} stores planned in the old arena written into the new"
            else:
                _stop(daemon, signum)
                daemon = procs.start_daemon(files)
            _store_then_hit(llm, round_prompts[i], round_baseline[i])
            # the worker copies through the new file's mapping, sized as the new daemon's
            mapped = worker._arena
            assert mapped is not None
            assert mapped.size == size == os.stat(daemon.arena).st_size
            assert worker._arena_inode == os.stat(daemon.arena).st_ino
        # what earlier daemons stored and drained still gives exact outputs
        for prompts, expected in zip(round_prompts, round_baseline, strict=True):
            llm.reset_prefix_cache()
            assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
