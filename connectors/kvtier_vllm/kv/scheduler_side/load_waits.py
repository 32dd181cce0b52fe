"""How long a request with a hit waited for its KV: from its first ask to its first load landing.

A synchronous load lands in the step that schedules its request, which vLLM counts as prefill
from then on, so its wait ends when the scheduler hands the copies out. An asynchronous load
ends when the workers report it done; vLLM counts that wait as the request's queue time. Only a
request's first load is counted: a preempted request that loads again has its first token."""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvtier_vllm.kv.connector_stats import KVTierStats
from kvtier_vllm.kv.scheduler_side.requests import RequestState


class LoadWaits:
    """Requests whose asynchronous load is out, with the state that knows when each asked."""

    def __init__(self) -> None:
        self._out: dict[str, RequestState] = {}

    def handed_out(self, state: RequestState, stats: KVTierStats) -> None:
        """A synchronous load goes to the workers with the step that schedules its request."""
        self._landed(state, stats)

    def waiting(self, state: RequestState) -> None:
        """An asynchronous load was granted; its request waits until the workers report it."""
        if state.asked_at is not None:
            self._out[state.request.request_id] = state

    def reported(self, done: Iterable[str], failed: Iterable[str], stats: KVTierStats) -> None:
        """The workers finished these loads (``failed``: without the KV, which is recomputed)."""
        for req_id in failed:
            self._out.pop(req_id, None)
        for req_id in done:
            state = self._out.pop(req_id, None)
            if state is not None:
                self._landed(state, stats)

    def forget(self, req_id: str) -> None:
        self._out.pop(req_id, None)

    @staticmethod
    def _landed(state: RequestState, stats: KVTierStats) -> None:
        if state.asked_at is not None:
            stats.load_waited(time.perf_counter() - state.asked_at)
            state.asked_at = None
