"""A kvtierd that is alive but silent (SIGSTOP) never stalls the engine: the call that meets it
waits its deadline, later ones fail at once, outputs stay exact, and hits return after SIGCONT.
Real engine (the CPU build), in-process, against a real kvtierd process."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvtier.rpc import DaemonStalledError, Deadlines, GrpcTierClient
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, generate_tokens, running_llm
from tests.e2e.test_connector import kvtier_config
from tests.integration.daemon_harness import CHUNK, DaemonFiles, Processes, key_of
from tests.support import target_spec

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # each step's wait is held to a bound

LOOKUP_MS = 50
STORE_MS = 100
PROBE_EVERY_MS = 200
# what a loaded 2-core machine may add to the longest deadline; the stall fixed here is 10 s
MARGIN_S = 0.4
RECOVERY_S = 20.0

_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "take_events",
)


@dataclass
class Timings:
    """Seconds each scheduler-side connector call took, each engine step, and the connector's
    share of each step."""

    hooks: list[tuple[str, float]] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    in_steps: list[float] = field(default_factory=list)
    connectors: list[Any] = field(default_factory=list)
    _step_hooks: float = 0.0

    def clear(self) -> None:
        self.hooks.clear()
        self.steps.clear()
        self.in_steps.clear()

    def hook(self, name: str, seconds: float) -> None:
        self.hooks.append((name, seconds))
        self._step_hooks += seconds

    def step(self, seconds: float) -> None:
        self.steps.append(seconds)
        self.in_steps.append(self._step_hooks)
        self._step_hooks = 0.0

    def slowest(self) -> tuple[str, float]:
        return max(self.hooks, key=lambda h: h[1])

    def summary(self) -> str:
        name, worst = self.slowest()
        steps = sorted(self.steps)
        return (
            f"{len(self.hooks)} calls, slowest {name} {worst * 1000:.1f} ms; "
            f"{len(steps)} steps, median {steps[len(steps) // 2] * 1000:.1f} ms, "
            f"slowest {steps[-1] * 1000:.1f} ms, of which the connector's at most "
            f"{max(self.in_steps) * 1000:.1f} ms"
        )


def _timed(call: Callable[..., Any], record: Callable[[float], None]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            record(time.perf_counter() - started)

    return timed


@pytest.fixture
def timings(monkeypatch: pytest.MonkeyPatch) -> Timings:
    """Times every scheduler hook of the connector and every engine step (in-process)."""
    from kvtier_vllm.connector import KVTierConnector
    from vllm.v1.engine.core_client import InprocClient

    out = Timings()
    for hook in _HOOKS:
        real = getattr(KVTierConnector, hook)

        def hooked(self: Any, *args: Any, _real: Any = real, _hook: str = hook) -> Any:
            if self not in out.connectors and self._scheduler is not None:
                out.connectors.append(self)
            return _timed(_real, lambda s: out.hook(_hook, s))(self, *args)

        monkeypatch.setattr(KVTierConnector, hook, hooked)
    monkeypatch.setattr(InprocClient, "get_output", _timed(InprocClient.get_output, out.step))
    return out


def _client(timings: Timings) -> Any:
    (connector,) = timings.connectors
    return connector._scheduler.client


def test_a_stopped_kvtierd_costs_a_few_deadlines_then_nothing_and_hits_return_after_sigcont(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    fresh_prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
    timings: Timings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    daemon = procs.start_daemon(daemon_files)
    connector = {
        **kvtier_config(
            {
                "mode": "sidecar",
                "socket_path": str(daemon_files.socket),
                "lookup_deadline_ms": LOOKUP_MS,
                "store_deadline_ms": STORE_MS,
                "probe_interval_ms": PROBE_EVERY_MS,
            }
        ),
        "kv_load_failure_policy": "recompute",
    }
    expected, expected_fresh = baseline[: len(prompts)], baseline[len(prompts) :]
    bound = max(LOOKUP_MS, STORE_MS) / 1000 + MARGIN_S
    caplog.set_level(logging.WARNING, logger="kvtier.rpc")
    with running_llm(tiny_models.target, kv_transfer_config=connector, kv_events=True) as llm:
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
        # healthy: stored prompts hit, in the time a step takes anyway (a call that missed its
        # 50 ms on the loaded machine is a miss, by design: asked again until all hit)
        client = _client(timings)
        healthy_until = time.monotonic() + RECOVERY_S
        while True:
            timings.clear()
            llm.reset_prefix_cache()
            tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            assert tokens == expected
            if all(c >= 600 for c in cached) and client.serving:
                break
            assert time.monotonic() < healthy_until, f"stored prompts never all hit: {cached}"
            time.sleep(PROBE_EVERY_MS / 1000)
        healthy = timings.summary()
        opened_before = client.breaker.opened
        caplog.clear()  # the breaker's messages from here on are the stop's

        daemon.stop()
        try:
            # alive and silent: every call would have waited 10 s; none may wait much past
            # its deadline, and the engine computes what kvtier cannot give
            timings.clear()
            llm.reset_prefix_cache()
            started = time.perf_counter()
            tokens, _ = generate_tokens(llm, prompts + fresh_prompts, max_tokens=MAX_TOKENS)
            first_stopped = time.perf_counter() - started
            assert tokens == expected + expected_fresh
            stopped = timings.summary()
            name, worst = timings.slowest()
            assert worst < bound, f"{name} took {worst:.3f} s with kvtierd stopped ({stopped})"
            assert max(timings.in_steps) < bound, stopped
            # by now a call (or the heartbeat, at most 2 s later) has opened the breaker
            deadline = time.monotonic() + 5
            while client.serving:
                assert time.monotonic() < deadline, "the breaker never opened"
                time.sleep(0.05)
            # open: no call is made, so nothing waits at all, and nothing hits
            timings.clear()
            llm.reset_prefix_cache()
            tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
            assert tokens == expected
            assert cached == [0] * len(prompts)
            open_summary = timings.summary()
            name, worst = timings.slowest()
            assert worst < bound, f"{name} took {worst:.3f} s with the breaker open"
            assert max(timings.in_steps) < bound, open_summary
        finally:
            daemon.resume()

        # the probe notices kvtierd again (in a new session if the old one lapsed meanwhile)
        resumed = time.monotonic()
        while True:
            llm.reset_prefix_cache()
            tokens, cached = generate_tokens(llm, prompts[:1], max_tokens=MAX_TOKENS)
            assert tokens == expected[:1]
            if cached[0] > 0:
                break
            assert time.monotonic() - resumed < RECOVERY_S, "no hit after SIGCONT"
            time.sleep(0.1)
        recovered_s = time.monotonic() - resumed
        assert client.serving
    opened = [r for r in caplog.records if "not answering" in r.getMessage()]
    closed = [r for r in caplog.records if "answers again" in r.getMessage()]
    assert client.breaker.opened - opened_before == 1, [r.getMessage() for r in opened]
    assert (len(opened), len(closed)) == (1, 1), [r.getMessage() for r in caplog.records]
    print(
        f"\nhealthy: {healthy}\nstopped, first pass ({first_stopped:.2f} s): {stopped}\n"
        f"breaker open: {open_summary}\nhits again {recovered_s:.2f} s after SIGCONT"
    )


def test_an_engine_started_against_a_stopped_kvtierd_connects_later_without_a_step_waiting(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
    timings: Timings,
) -> None:
    daemon = procs.start_daemon(daemon_files)
    extra = {
        "mode": "sidecar",
        "socket_path": str(daemon_files.socket),
        "register_deadline_ms": 500,  # the engine's start waits this long, once
        "lookup_deadline_ms": LOOKUP_MS,
        "store_deadline_ms": STORE_MS,
        "probe_interval_ms": PROBE_EVERY_MS,
    }
    connector = {**kvtier_config(extra), "kv_load_failure_policy": "recompute"}
    expected = baseline[: len(prompts)]
    bound = max(LOOKUP_MS, STORE_MS) / 1000 + MARGIN_S
    daemon.stop()
    try:
        with running_llm(tiny_models.target, kv_transfer_config=connector, kv_events=True) as llm:
            # past the connector's retry interval (5 s): a retry runs while steps go on
            stopped_until = time.monotonic() + 6.0
            while time.monotonic() < stopped_until:
                tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
                assert tokens == expected
                assert cached == [0] * len(prompts)
                llm.reset_prefix_cache()
            stopped = timings.summary()
            name, worst = timings.slowest()
            assert worst < bound, f"{name} took {worst:.3f} s, kvtierd stopped ({stopped})"
            daemon.resume()
            # the next retry connects; then prompts are stored, then hit
            resumed = time.monotonic()
            while True:
                llm.reset_prefix_cache()
                tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
                assert tokens == expected
                if all(c > 0 for c in cached):
                    break
                assert time.monotonic() - resumed < RECOVERY_S, f"no hit after SIGCONT: {cached}"
                time.sleep(0.1)
            hit_after = time.monotonic() - resumed
            name, worst = timings.slowest()
            assert worst < bound, f"{name} took {worst:.3f} s ({timings.summary()})"
    finally:
        daemon.resume()
    print(f"\nstarted stopped: {stopped}\nhits {hit_after:.2f} s after SIGCONT")


def _seconds(call: Callable[[], Any]) -> tuple[float, BaseException | None]:
    started = time.perf_counter()
    try:
        call()
    except Exception as exc:
        return time.perf_counter() - started, exc
    return time.perf_counter() - started, None


def test_the_sidecar_client_waits_one_deadline_then_fails_at_once_until_a_probe_answers(
    procs: Processes, daemon_files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(daemon_files)
    deadlines = Deadlines(
        lookup_s=LOOKUP_MS / 1000, store_s=STORE_MS / 1000, probe_every_s=0.2, misses_to_open=1
    )
    client = GrpcTierClient(daemon_files.socket, "dp0", deadlines=deadlines)
    try:
        client.register_pool(target_spec(), CHUNK)
        keys = [key_of(i) for i in range(4)]
        refs = [r for r in client.reserve(keys) if r is not None]
        assert client.commit(refs) == len(keys)
        healthy, error = _seconds(lambda: client.lookup(keys))
        assert error is None
        daemon.stop()
        try:
            # the call that meets the stopped daemon waits its deadline, no longer
            waited, error = _seconds(lambda: client.lookup(keys))
            assert isinstance(error, DaemonStalledError), error
            assert LOOKUP_MS / 1000 * 0.9 <= waited < LOOKUP_MS / 1000 + MARGIN_S, waited
            assert not client.serving
            # every later call fails at once, making no call
            calls: list[Callable[[], Any]] = [
                lambda: client.lookup(keys),
                lambda: client.lookup(keys, lease=True),
                lambda: client.reserve(keys),
                lambda: client.commit(refs),
                lambda: client.release(refs),
                lambda: client.lease(keys),
                lambda: client.promote(keys),
                lambda: client.chunk_events(-1),
                lambda: client.report_hits(),
            ]
            failing = [_seconds(call) for call in calls]
            slowest = max(seconds for seconds, _ in failing)
            # waiting their deadlines instead, these calls would take 0.6 s together
            assert sum(seconds for seconds, _ in failing) < 0.1, failing
            assert all(isinstance(error, DaemonStalledError) for _, error in failing[:-1]), failing
        finally:
            daemon.resume()
        # the probe finds it again, within a few of its intervals
        resumed = time.monotonic()
        while not client.serving:
            assert time.monotonic() - resumed < 5.0, "the breaker never closed"
            time.sleep(0.02)
        recovered = time.monotonic() - resumed
        assert client.lookup(keys).hits == len(keys)
        assert client.breaker is not None
        assert client.breaker.opened == 1
        print(
            f"\nlookup healthy {healthy * 1000:.2f} ms, stopped {waited * 1000:.1f} ms, "
            f"open {slowest * 1000:.3f} ms at most; closed {recovered:.2f} s after SIGCONT"
        )
    finally:
        client.close()


def test_the_breaker_opens_after_misses_in_a_row_not_after_one_slow_call(
    procs: Processes, daemon_files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(daemon_files)
    # heartbeats far apart: only the calls below decide
    deadlines = Deadlines(lookup_s=LOOKUP_MS / 1000, probe_every_s=60.0, misses_to_open=3)
    client = GrpcTierClient(daemon_files.socket, "dp0", deadlines=deadlines)
    try:
        client.register_pool(target_spec(), CHUNK)
        keys = [key_of(i) for i in range(4)]

        def stopped_lookups(n: int) -> list[BaseException | None]:
            daemon.stop()
            try:
                return [_seconds(lambda: client.lookup(keys))[1] for _ in range(n)]
            finally:
                daemon.resume()

        def stalled(errors: list[BaseException | None]) -> bool:
            return all(isinstance(e, DaemonStalledError) for e in errors)

        # two late answers: each a miss, the breaker stays closed
        assert stalled(stopped_lookups(2))
        assert client.serving
        # an answer in time starts the count again
        assert client.lookup(keys).hits == 0
        assert client.breaker is not None
        assert client.breaker.misses == 0
        assert stalled(stopped_lookups(2))
        assert client.serving
        # a third in a row opens it: the next call fails at once, making none
        assert stalled(stopped_lookups(3))
        assert not client.serving
        assert client.breaker.opened == 1
        waited, error = _seconds(lambda: client.lookup(keys))
        assert isinstance(error, DaemonStalledError)
        assert waited < LOOKUP_MS / 1000 / 2
    finally:
        client.close()


def test_a_new_request_waits_for_a_stopped_kvtierd_without_holding_up_the_running_ones(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    fresh_prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
    timings: Timings,
) -> None:
    """A miss's lookup is asked in the background: while kvtierd cannot answer, the running
    request decodes a token every step and the lookup hook never waits for the answer (it
    would wait up to the lookup deadline, 1 s here, were it asked in the step)."""
    from tests.fixtures.engines import greedy

    daemon = procs.start_daemon(daemon_files)
    # lmdb's map not read here: only kvtierd can say whether lmdb holds the new prompt (where
    # the engine reads it, a prompt neither index holds is a miss at once)
    sidecar = {"mode": "sidecar", "socket_path": str(daemon_files.socket), "lmdb_loads": False}
    connector = kvtier_config(sidecar)
    running, new = prompts[0], fresh_prompts[0]
    stopped_steps = 4
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        engine = llm.llm_engine
        engine.add_request("running", {"prompt_token_ids": running}, greedy(MAX_TOKENS))
        tokens: dict[str, list[int]] = {}

        def step() -> None:
            for out in engine.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)

        while len(tokens.get("running", ())) < 2:  # prefilled, stored, committed
            step()
        daemon.stop()
        try:
            timings.clear()
            engine.add_request("new", {"prompt_token_ids": new}, greedy(MAX_TOKENS))
            for _ in range(stopped_steps):
                before = len(tokens["running"])
                step()
                assert len(tokens["running"]) == before + 1, "a step waited for kvtierd"
            lookups = [s for name, s in timings.hooks if name == "get_num_new_matched_tokens"]
            assert len(lookups) >= stopped_steps, timings.hooks  # asked again each step
            assert max(lookups) < 0.25, f"the lookup hook waited: {timings.summary()}"
            assert not tokens.get("new"), "served before kvtierd answered"
        finally:
            daemon.resume()
        while engine.has_unfinished_requests():
            step()
    assert tokens["running"] == baseline[0]
    assert tokens["new"] == baseline[len(prompts)]
    print(f"\nkvtierd stopped for {stopped_steps} steps: {timings.summary()}")
