"""kvtierd's measured costs and `kvtier locate`: an engine's timings reach kvtierd with its
heartbeats, show in the admin API and the Prometheus gauges, and a prompt's block hashes are
answered with the leading tokens each tier holds and their expected load time against
recompute."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest
from kvtier_vllm.kv.metadata import ChunkCopy
from kvtier_vllm.kv.worker_side.load_times import RequestLoads

from kvtier.core.costs import EngineTimings
from kvtier.core.errors import InvalidRequestError, UnknownPoolError
from kvtier.core.load_choice import CostChooser
from kvtier.rpc import GrpcTierClient
from tests.integration.daemon_harness import CHUNK, DaemonFiles, Processes, RunningDaemon
from tests.support import keys_for, target_spec

BLOCKS_PER_CHUNK = 4  # tests.support.layout
TOKENS_PER_CHUNK = 64


def prompt_hashes(chunks: int) -> list[bytes]:
    """Block hashes whose every chunk's last block is `keys_for`'s chunk hash."""
    hashes = []
    for c in range(chunks):
        hashes += [bytes([0xEE, c, j]) * 8 for j in range(BLOCKS_PER_CHUNK - 1)]
        hashes.append(c.to_bytes(32, "big"))
    return hashes


def reported(daemon: RunningDaemon) -> None:
    deadline = time.monotonic() + 10.0
    while daemon.stats().costs.prefill_samples == 0:
        assert time.monotonic() < deadline, "no heartbeat carried the engine's timings"
        time.sleep(0.05)


def fitted(daemon: RunningDaemon) -> dict[str, float]:
    """kvtierd's fit of the engine's prefill steps, once a heartbeat carried them."""
    deadline = time.monotonic() + 10.0
    while True:
        fit = {
            labels["part"]: value
            for name, labels, value in daemon.metrics()
            if name == "kvtier_prefill_fit_seconds"
        }
        if fit:
            return fit
        assert time.monotonic() < deadline, "no heartbeat carried the engine's steps"
        time.sleep(0.05)


def cost_gauges(daemon: RunningDaemon) -> dict[tuple[str, str], float]:
    return {
        (labels.get("tier", ""), labels["stat"]): value
        for name, labels, value in daemon.metrics()
        if name in ("kvtier_load_per_chunk_seconds", "kvtier_prefill_per_token_seconds")
    }


def locate_cli(daemon: RunningDaemon, model: str, hashes: list[bytes]) -> dict[str, Any]:
    """`kvtier locate --json`, run as an operator would."""
    argv = ["locate", "--address", daemon.admin_address, "--model", model, "--json"]
    cli = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *argv, *(h.hex() for h in hashes)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    found: dict[str, Any] = json.loads(cli.stdout)
    return found


def test_locate_answers_each_tiers_leading_tokens_and_their_measured_costs(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    client = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    admin = daemon.admin()
    try:
        keys = keys_for(client.register_pool(target_spec(), CHUNK), 3)
        refs = [r for r in client.reserve(keys) if r is not None]
        assert client.commit(refs) == 3
        assert admin.drain().complete  # lmdb holds them too
        timings = EngineTimings()
        timings.loaded("cpu", 4, 4 * CHUNK, 0.004)
        timings.loaded("lmdb", 2, 2 * CHUNK, 0.010)
        timings.prefill_tokens, timings.prefill_seconds = 1000, 0.5
        client.report_timings(timings)
        reported(daemon)

        found = admin.locate("tiny-llama", prompt_hashes(4))
        assert found.tokens == 4 * TOKENS_PER_CHUNK
        spans = {s.tier: s for s in found.tiers}
        assert (spans["cpu"].chunks, spans["cpu"].tokens) == (3, 3 * TOKENS_PER_CHUNK)
        assert spans["cpu"].load_seconds == pytest.approx(0.003)
        assert spans["lmdb"].tokens == 3 * TOKENS_PER_CHUNK
        assert spans["lmdb"].load_seconds == pytest.approx(0.015)
        assert found.recompute_measured
        assert found.recompute_seconds == pytest.approx(3 * TOKENS_PER_CHUNK * 0.0005)
        # a prompt that leaves the stored prefix after one chunk holds one
        other = prompt_hashes(1) + [b"\x01" * 32] * BLOCKS_PER_CHUNK
        assert {s.tier: s.chunks for s in admin.locate("tiny-llama", other).tiers} == {
            "cpu": 1,
            "lmdb": 1,
        }

        assert not daemon.stats().costs.HasField("prefill_fit"), "no steps timed yet: no fit"
        gauges = cost_gauges(daemon)
        assert gauges[("cpu", "mean")] == pytest.approx(0.001)
        assert gauges[("lmdb", "mean")] == pytest.approx(0.005)
        assert gauges[("", "mean")] == pytest.approx(0.0005)
        assert ("object", "mean") not in gauges  # nothing timed: no estimate shown
        totals = {  # never decaying: a window's mean is its increase over the loads'
            (name, labels.get("tier", "")): value
            for name, labels, value in daemon.metrics()
            if name.startswith(("kvtier_loaded_chunks", "kvtier_load_seconds", "kvtier_prefill_"))
            and not name.endswith("_created")
        }
        assert totals[("kvtier_loaded_chunks_total", "lmdb")] == 2
        assert totals[("kvtier_load_seconds_total", "lmdb")] == pytest.approx(0.010)
        assert totals[("kvtier_loaded_chunks_total", "object")] == 0
        assert totals[("kvtier_prefill_tokens_total", "")] == 1000
        assert totals[("kvtier_prefill_seconds_total", "")] == pytest.approx(0.5)

        # steps of two lengths: their fixed part is told from their part per token, and a
        # recompute is priced at the part per token (the step runs for the rest anyway)
        steps = EngineTimings()
        for tokens in (800, 64) * 4:
            steps.prefilled(tokens, 0.02 + 0.0004 * tokens)
        client.report_timings(steps)
        fit = fitted(daemon)
        assert fit == {"step": pytest.approx(0.02), "token": pytest.approx(0.0004)}
        shown = daemon.stats().costs.prefill_fit  # and in `kvtier stats`
        assert (shown.per_step, shown.per_token) == (pytest.approx(0.02), pytest.approx(0.0004))
        refit = admin.locate("tiny-llama", prompt_hashes(4))
        assert refit.recompute_seconds == pytest.approx(3 * TOKENS_PER_CHUNK * 0.0004)

        with pytest.raises(UnknownPoolError):
            admin.locate("another-model", prompt_hashes(1))
        with pytest.raises(InvalidRequestError):
            admin.locate("tiny-llama", [b""])

        shown = locate_cli(daemon, "tiny-llama", prompt_hashes(4))
        assert {t["tier"]: int(t["tokens"]) for t in shown["tiers"]} == {
            "cpu": 3 * TOKENS_PER_CHUNK,
            "lmdb": 3 * TOKENS_PER_CHUNK,
        }
    finally:
        admin.close()
        client.close()


def test_heartbeats_bring_kvtierds_costs_back_to_the_engine(
    procs: Processes, files: DaemonFiles
) -> None:
    """The engine reads kvtierd's costs without a call: each heartbeat reply carries them, the
    load fit of a fixed part per load included, and they decide a hit's load against its
    recompute."""
    daemon = procs.start_daemon(files)
    client = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    try:
        client.register_pool(target_spec(), CHUNK)
        timings = EngineTimings()
        for chunks, tokens in [(1, 64), (8, 512), (2, 128), (12, 768)] * 2:
            timings.loaded("lmdb", chunks, chunks * CHUNK, 0.030 + 0.001 * chunks)
            timings.prefilled(tokens, 0.01 + 0.0002 * tokens)
        client.report_timings(timings)
        deadline = time.monotonic() + 10.0
        while (costs := client.costs()) is None or costs.prefill_fit is None:
            assert time.monotonic() < deadline, "no heartbeat reply carried kvtierd's costs"
            time.sleep(0.05)
        fit = costs.tiers["lmdb"].load_fit
        assert fit is not None
        assert (fit.per_load, fit.per_chunk) == (pytest.approx(0.030), pytest.approx(0.001))
        assert costs.prefill_fit.per_token == pytest.approx(0.0002)
        chooser = CostChooser(client.costs)
        # one chunk: a 30 ms load against 13 ms of recompute; twelve: 42 ms against 154 ms
        assert chooser.tokens_to_load([("lmdb", 1)], TOKENS_PER_CHUNK) == 0
        assert chooser.tokens_to_load([("lmdb", 12)], TOKENS_PER_CHUNK) == 12 * TOKENS_PER_CHUNK
        assert load_fit_gauges(daemon) == {
            ("lmdb", "load"): pytest.approx(0.030),
            ("lmdb", "chunk"): pytest.approx(0.001),
        }
    finally:
        client.close()


def test_registrations_reply_brings_kvtierds_costs_before_any_heartbeat(
    procs: Processes, files: DaemonFiles
) -> None:
    """An engine that registers after kvtierd measured its costs decides its first lookup by
    them: the registration's reply carries them, no heartbeat needed."""
    procs.start_daemon(files)
    measured = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    late = GrpcTierClient(files.socket, "dp1", timeout_s=10.0)
    try:
        measured.register_pool(target_spec(), CHUNK)
        timings = EngineTimings()
        for chunks, tokens in [(1, 64), (8, 512), (2, 128), (12, 768)] * 2:
            timings.loaded("lmdb", chunks, chunks * CHUNK, 0.030 + 0.001 * chunks)
            timings.prefilled(tokens, 0.01 + 0.0002 * tokens)
        measured.report_timings(timings)
        deadline = time.monotonic() + 10.0
        while (fit := measured.costs()) is None or fit.prefill_fit is None:
            assert time.monotonic() < deadline, "no heartbeat carried the engine's timings"
            time.sleep(0.05)
        late.register_pool(target_spec(), CHUNK)
        costs = late.costs()  # at once: its first heartbeat is a heartbeat interval away
        assert costs is not None, "the registration's reply carried no costs"
        assert costs.prefill_fit is not None
        chooser = CostChooser(late.costs)
        # one chunk: a 30 ms load against 13 ms of recompute; twelve: 42 ms against 154 ms
        assert chooser.tokens_to_load([("lmdb", 1)], TOKENS_PER_CHUNK) == 0
        assert chooser.tokens_to_load([("lmdb", 12)], TOKENS_PER_CHUNK) == 12 * TOKENS_PER_CHUNK
    finally:
        late.close()
        measured.close()


def test_requests_loads_as_the_worker_reports_them_show_both_parts_for_the_arena(
    procs: Processes, files: DaemonFiles
) -> None:
    """The worker reports each request's chunks from the arena as one load: reaching a real
    kvtierd with the heartbeats, they show in kvtier_load_fit_seconds as a fixed part and a
    part per chunk for the arena, as for lmdb."""
    daemon = procs.start_daemon(files)
    client = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    try:
        client.register_pool(target_spec(), CHUNK)
        timings = EngineTimings()
        for chunks in (1, 8, 2, 12, 4):
            loads = RequestLoads()
            for i in range(chunks):
                first = 0.0004 if i == 0 else 0.0
                loads.add(ChunkCopy("target", i, 0, 1, (i + 1,), request="r"), CHUNK, first + 1e-4)
            loads.report(timings)
        client.report_timings(timings)
        deadline = time.monotonic() + 10.0
        while not (gauges := load_fit_gauges(daemon)):
            assert time.monotonic() < deadline, "no heartbeat carried the engine's loads"
            time.sleep(0.05)
        assert gauges == {
            ("cpu", "load"): pytest.approx(0.0004),
            ("cpu", "chunk"): pytest.approx(1e-4),
        }
    finally:
        client.close()


def load_fit_gauges(daemon: RunningDaemon) -> dict[tuple[str, str], float]:
    return {
        (labels["tier"], labels["part"]): value
        for name, labels, value in daemon.metrics()
        if name == "kvtier_load_fit_seconds"
    }
