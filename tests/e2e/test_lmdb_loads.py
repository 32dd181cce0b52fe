"""Hits held in lmdb, loaded by a real engine beside a real kvtierd straight from lmdb's map
(``lmdb_loads``): no promotion, no arena slot, each hit leased by its lookup in one call, outputs
vLLM's own; with it off, the same hits are promoted into the arena first. A chunk corrupted in
lmdb is recomputed, never served, and reported: kvtierd drops it, and the next engine stores a
good copy; with that many failing, lmdb is unhealthy, so the good copies stay in the arena and no
engine reads lmdb's map meanwhile."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.rpc import AdminClient
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, counter, generate_tokens, running_llm, untimed_transfers
from tests.e2e.test_connector import cached_by_source, kvtier_config
from tests.integration.daemon_harness import DaemonFiles, Processes, RunningDaemon

LOAD_ERRORS = "vllm:kvtier_transfer_errors"


def _stored_in_lmdb_only(
    models: ModelSet,
    prompts: list[list[int]],
    procs: Processes,
    files: DaemonFiles,
    extra: dict[str, Any],
) -> tuple[dict[str, Any], AdminClient, RunningDaemon]:
    """kvtierd started, ``prompts`` served by a first engine, and every chunk it stored written to
    lmdb and dropped from the arena; the connector's config (``extra`` set), an admin client
    and kvtierd."""
    daemon = procs.start_daemon(files)
    connector = {
        **kvtier_config({"mode": "sidecar", "socket_path": str(files.socket), **extra}),
        "kv_load_failure_policy": "recompute",  # a load error is recomputed, not failed
    }
    admin = daemon.admin()
    with running_llm(models.target, kv_transfer_config=connector) as llm:
        generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
    assert admin.drain().complete
    admin.evict(tier="cpu")
    cpu = next(t for t in admin.stats().tiers if t.tier == "cpu")
    assert cpu.usage.chunks == 0
    return connector, admin, daemon


def _leases_asked(daemon: RunningDaemon) -> float:
    """Lease calls kvtierd answered (a load's leases taken apart from its lookup)."""
    samples = daemon.metrics()
    return sum(
        v
        for name, labels, v in samples
        if name == "kvtier_requests_total" and labels["op"] == "prefetch"
    )


def _lmdb_chunks(admin: AdminClient) -> int:
    return int(next(t for t in admin.stats().tiers if t.tier == "lmdb").usage.chunks)


def _lmdb_counters(admin: AdminClient) -> dict[str, int]:
    tier = next(t for t in admin.stats().tiers if t.tier == "lmdb")
    return dict(tier.counters)


_CORRUPT_CHUNKS = """
import sys
import lmdb
from kvtier.tiers.lmdb_reader import DATABASES
env = lmdb.open(sys.argv[1], max_dbs=len(DATABASES), subdir=True)
chunks = env.open_db(b"chunks", create=False)
only = {bytes.fromhex(k) for k in sys.argv[2:]}
with env.begin(write=True, db=chunks) as txn:
    stored = [(bytes(k), bytearray(v)) for k, v in txn.cursor() if not only or bytes(k) in only]
    for key, value in stored:
        value[-1] ^= 0xFF
        txn.put(key, bytes(value))
print(len(stored))
"""


def corrupt_chunks(path: Path, keys: list[bytes] | None = None) -> int:
    """Flip the last payload byte of the stored chunks ``keys`` (default: every one), as a
    failing disk would; returns how many. Another process does it (this one has the environment
    open to read, through the engines' connector): LMDB takes its writer beside kvtierd's, one
    transaction at a time."""
    done = subprocess.run(
        [sys.executable, "-c", _CORRUPT_CHUNKS, str(path), *(k.hex() for k in keys or ())],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


@pytest.mark.parametrize("lmdb_loads", [True, False], ids=["from-lmdb", "promoted"])
def test_hits_held_only_in_lmdb_load_from_its_map_without_promotion(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
    lmdb_loads: bool,
) -> None:
    connector, admin, daemon = _stored_in_lmdb_only(
        tiny_models, prompts, procs, daemon_files, {"lmdb_loads": lmdb_loads}
    )
    try:
        before, leases_before = admin.stats().counters, _leases_asked(daemon)
        with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
            tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            from_disk = cached_by_source(llm, "disk")
            errors = counter(llm, LOAD_ERRORS, direction="load")
            untimed = untimed_transfers(llm)
        after, lease_calls = admin.stats().counters, _leases_asked(daemon) - leases_before
        lmdb_counters = _lmdb_counters(admin)
        arena_hits = next(t for t in admin.stats().tiers if t.tier == "cpu").counters["hits"]
    finally:
        admin.close()
    assert tokens == baseline[: len(prompts)]
    assert all(c >= 600 for c in cached), cached
    assert from_disk >= 600 * len(prompts)
    assert errors == 0
    assert not untimed  # each copy's seconds counted with its bytes
    promoted = after["promotions"] - before["promotions"]
    if lmdb_loads:
        assert promoted == 0
        assert arena_hits == 0  # nothing came up into the arena to be loaded
        assert lmdb_counters.get("load_leases", 0) >= 600 * len(prompts) // 32
        assert lease_calls == 0, "each hit leased by its lookup, in one call"
    else:
        assert promoted > 0
        assert lmdb_counters.get("load_leases", 0) == 0


def _unhealthy_after(files: DaemonFiles, failures: int) -> None:
    """kvtierd's configuration: lmdb unhealthy after ``failures`` chunks failing verification
    (within the default window, longer than this test)."""
    tree = yaml.safe_load(files.config.read_text())
    tree.setdefault("manager", {})["integrity_unhealthy_failures"] = failures
    files.config.write_text(yaml.safe_dump(tree))


def test_chunks_corrupted_in_lmdb_are_recomputed_reported_dropped_and_stored_again(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
) -> None:
    """An engine serves none of what failed verification and reports it; kvtierd counts each
    chunk hit and drops it, and marks lmdb unhealthy: the next engine reads nothing from lmdb,
    and stores those chunks again in the arena only, and the one after loads the good copies
    from there."""
    _unhealthy_after(daemon_files, 8)
    connector, admin, _ = _stored_in_lmdb_only(tiny_models, prompts, procs, daemon_files, {})
    try:
        assert corrupt_chunks(daemon_files.lmdb) > 0
        held = _lmdb_chunks(admin)
        with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
            tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            errors = counter(llm, LOAD_ERRORS, direction="load")
        leased = _lmdb_counters(admin).get("load_leases", 0)
        assert leased > 0  # the hits were leased in lmdb and read there
        assert errors > 0  # they failed verification, and vLLM recomputed them
        assert tokens == baseline[: len(prompts)]
        # reported with the engine's heartbeats: each chunk hit is counted once, and dropped
        deadline = time.monotonic() + 30
        while _lmdb_counters(admin).get("corrupt", 0) < errors:
            assert time.monotonic() < deadline, _lmdb_counters(admin)
            time.sleep(0.1)
        assert _lmdb_counters(admin).get("corrupt", 0) == errors
        assert _lmdb_chunks(admin) <= held - errors
        assert errors >= 8  # lmdb is unhealthy
        lmdb_before = _lmdb_counters(admin)
        # the next engine misses them, and the chunks of lmdb no engine read too: nothing is
        # leased in lmdb or fails, and it stores them again in the arena, not in lmdb
        with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
            tokens, _ = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            assert counter(llm, LOAD_ERRORS, direction="load") == 0
            assert cached_by_source(llm, "disk") == 0
        assert tokens == baseline[: len(prompts)]
        assert admin.drain().complete
        # and the one after loads the good copies from the arena, still reading no lmdb
        with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
            tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            assert counter(llm, LOAD_ERRORS, direction="load") == 0
            from_disk = cached_by_source(llm, "disk")
            from_arena = cached_by_source(llm, "host")
        lmdb_after = _lmdb_counters(admin)
    finally:
        admin.close()
    assert tokens == baseline[: len(prompts)]
    assert all(c >= 600 for c in cached), cached
    assert from_disk == 0
    assert from_arena >= 600 * len(prompts)
    for read_or_written in ("load_leases", "hits", "corrupt", "stores"):
        assert lmdb_after.get(read_or_written, 0) == lmdb_before.get(read_or_written, 0)
