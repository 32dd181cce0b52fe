"""What this engine measures for kvtier's cost estimates: the workers' loads per tier, and the
time its steps take per token while prefill dominates them (the cost of recomputing a prefix
instead of loading it)."""

from __future__ import annotations

import time
from typing import Any

from kvtier.core.costs import EngineTimings, Estimate, StepSums, per_token

PREFILL_TOKENS_PER_REQUEST = 8
"""A step counts as prefill where it schedules at least this many tokens per request: decode
steps schedule one (or a few drafted) per request."""


class StepTimings:
    def __init__(self, wait_share: float = 0.0) -> None:
        self.pending = EngineTimings()
        self.prefill = Estimate()
        """This engine's seconds per prefilled token, decaying (kvtierd keeps the same)."""
        self.steps = StepSums()
        """Its prefill steps, for a fixed part and a part per token (kvtierd fits the same)."""
        self.wait_share = wait_share
        self.busy = Estimate()
        """Seconds of this engine's steps that ran requests, decaying: what a request waiting
        for an asynchronous load waits through."""
        self.running = 0
        """Requests the last step ran."""
        self._began = 0.0
        self._tokens = 0
        self._requests = 0

    def began(self, scheduler_output: Any) -> None:
        """The scheduler handed the step to the workers (its forward starts now)."""
        tokens = int(scheduler_output.total_num_scheduled_tokens)
        requests = len(scheduler_output.num_scheduled_tokens)
        prefill = requests and tokens >= PREFILL_TOKENS_PER_REQUEST * requests
        self._tokens = tokens if prefill else 0
        self._requests = requests if tokens else 0
        self._began = time.perf_counter()

    def ended(self, worker_timings: EngineTimings | None) -> None:
        """The step's output came back, with what the workers timed."""
        seconds = time.perf_counter() - self._began
        if self._requests:
            self.busy.observe(seconds)
        self.running, self._requests = self._requests, 0
        if self._tokens:
            self.pending.prefilled(self._tokens, seconds)
            self.prefill.observe(seconds / self._tokens, self._tokens)
            step = EngineTimings()
            step.prefilled(self._tokens, seconds)
            self.steps.add(step)
            self._tokens = 0
        if worker_timings:
            self.pending.merge(worker_timings)

    def take(self) -> EngineTimings | None:
        if not self.pending:
            return None
        taken, self.pending = self.pending, EngineTimings()
        return taken

    def recompute_wait(self, tokens: int) -> float:
        """How long a hit of ``tokens`` is worth waiting for (its loads, a probe of the object
        store): ``wait_share`` of what recomputing it would take here, as measured (the part
        per token of the steps' fit, else their mean per token); 0 before a prefill was
        timed."""
        return self.wait_share * per_token(self.steps.fit(), self.prefill.mean) * tokens
