"""A release or commit the connector could not make is made on a later step: kvtierd ends up
holding no lease or reservation for the engine, whose session stays alive, every chunk can be
evicted, and the chunk whose commit failed is stored. Real engine (the CPU build), in-process,
against a real kvtierd process; the calls fail in the engine's own client, before they are sent.
"""

from __future__ import annotations

import random
import time
from contextlib import closing
from typing import Any

import pytest

from kvtier.core.errors import TierUnavailableError
from kvtier.core.protocol import IndexedRef, SlotRef
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.models import ModelSet, generate_tokens, running_llm
from tests.e2e.test_connector import kvtier_config
from tests.integration.daemon_harness import DaemonFiles, Processes, RunningDaemon

pytestmark = pytest.mark.slow

SETTLE_S = 30.0


class FailOnce:
    """The engine client's first `release` and first `commit` that carry refs fail as a timed-out
    call would, without reaching kvtierd."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        import kvtier.rpc.arena_view
        from kvtier.rpc import GrpcTierClient

        self.failed: dict[str, list[SlotRef]] = {"release": [], "commit": []}
        self.client: Any = None
        for name in self.failed:
            real = getattr(GrpcTierClient, name)

            def failing(
                client: Any, refs: list[SlotRef], _real: Any = real, _name: str = name
            ) -> Any:
                sent = [r for r in refs if not isinstance(r, IndexedRef)]
                if sent and not self.failed[_name]:
                    self.client = client
                    self.failed[_name].extend(sent)
                    raise TierUnavailableError(f"{_name}: deadline exceeded (injected)")
                return _real(client, refs)

            mp.setattr(GrpcTierClient, name, failing)
        # every hit is then leased by a call, as on a host that cannot read the arena's index
        mp.setattr(kvtier.rpc.arena_view, "readable_here", lambda: False)


def _held(daemon: RunningDaemon) -> tuple[int, int, float]:
    stats = daemon.stats()
    (reservations,) = [v for n, _, v in daemon.metrics() if n == "kvtier_reservations"]
    return stats.sessions, stats.leases, reservations


def _step_until_settled(llm: Any, daemon: RunningDaemon, rng: random.Random) -> None:
    """Run engine steps (prompts too short to look up or store: they take nothing) until
    kvtierd holds nothing for the engine but its session."""
    deadline = time.monotonic() + SETTLE_S
    while (held := _held(daemon)) != (1, 0, 0):
        assert time.monotonic() < deadline, f"(sessions, leases, reservations): {held}"
        generate_tokens(llm, [[rng.randrange(100, 1000) for _ in range(4)]], max_tokens=4)
        time.sleep(0.2)


def test_refs_a_failed_call_did_not_hand_back_are_handed_back_on_later_steps(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    baseline: list[list[int]],
    procs: Processes,
    daemon_files: DaemonFiles,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    daemon = procs.start_daemon(daemon_files)
    faults = FailOnce(monkeypatch)
    connector = kvtier_config({"mode": "sidecar", "socket_path": str(daemon_files.socket)})
    expected = baseline[: len(prompts)]
    rng = random.Random(7)
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        assert generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)[0] == expected
        assert faults.failed["commit"], "no commit was made"
        _step_until_settled(llm, daemon, rng)
        committed = [r.key for r in faults.failed["commit"]]
        assert faults.client.lookup(committed).hits == len(committed), "the commit was lost"

        llm.reset_prefix_cache()  # the next lookups go to kvtier: leases, then releases
        tokens, cached = generate_tokens(llm, prompts, max_tokens=MAX_TOKENS)
        assert tokens == expected
        assert all(c >= 600 for c in cached), cached
        assert faults.failed["release"], "no release was made"
        _step_until_settled(llm, daemon, rng)
        chunks = next(t.usage.chunks for t in daemon.stats().tiers if t.tier == "cpu")
        assert chunks > 0
        with closing(daemon.admin()) as admin:
            assert admin.evict(tier="cpu") == {"cpu": chunks}, "a chunk is still leased"
