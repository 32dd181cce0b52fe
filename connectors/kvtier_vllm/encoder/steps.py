"""The encoder cache's steps in flight: what each step's plan holds (leases, reservations),
until the workers' report of that step settles it.

Reports come back in step order, but not every step is reported: vLLM may run the next step's
plan before the last one's report arrives (asynchronous scheduling), and some model runners
drop the report altogether (vLLM's V1 runner for an ``ec_producer``). A step older than
``MAX_UNREPORTED_STEPS`` without its report is expired: what it read is given back (later
steps' reports prove its forward ran), what it wrote is aborted (never committed unseen).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.core.protocol import SlotRef
from kvtier_vllm.encoder.metadata import ECReport, ECStepPlan, ItemSlots

log = logging.getLogger(__name__)

MAX_UNREPORTED_STEPS = 8


@dataclass
class Settlement:
    """What one report (or an expiry) decides."""

    commit: list[SlotRef] = field(default_factory=list)
    abort: list[SlotRef] = field(default_factory=list)
    release: list[SlotRef] = field(default_factory=list)
    checked: list[tuple[ItemSlots, float]] = field(default_factory=list)
    """Sampled hits and their relative error."""
    read: list[str] = field(default_factory=list)
    """Items loaded by the settled steps."""


class StepLedger:
    def __init__(self) -> None:
        self._steps: OrderedDict[int, ECStepPlan] = OrderedDict()
        self._next = 0
        self._said = False

    def record(self, plan: ECStepPlan) -> None:
        plan.step = self._next
        self._next += 1
        if plan.loads or plan.stores or plan.checks:
            self._steps[plan.step] = plan

    def settle(self, report: ECReport) -> Settlement:
        """Settle the reported step; expire the steps the report shows were never reported."""
        out = Settlement()
        plan = self._steps.pop(report.step, None)
        if plan is not None:
            out.commit = [r for s in plan.stores if s.identifier in report.stored for r in s.refs]
            out.abort = [
                r for s in plan.stores if s.identifier not in report.stored for r in s.refs
            ]
            out.release = [r for s in (*plan.loads, *plan.checks) for r in s.refs]
            out.checked = [
                (s, report.errors[s.identifier])
                for s in plan.checks
                if s.identifier in report.errors
            ]
            out.read = [s.identifier for s in plan.loads]
        self._expire(report.step, out)
        return out

    def expire(self) -> Settlement:
        """Steps too old to be reported any more (called once a step)."""
        out = Settlement()
        self._expire(self._next - MAX_UNREPORTED_STEPS, out)
        return out

    def _expire(self, before: int, out: Settlement) -> None:
        while self._steps and next(iter(self._steps)) < before:
            _, plan = self._steps.popitem(last=False)
            out.release += [r for s in (*plan.loads, *plan.checks) for r in s.refs]
            out.read += [s.identifier for s in plan.loads]
            if plan.stores:
                out.abort += [r for s in plan.stores for r in s.refs]
                if not self._said:
                    self._said = True
                    log.error(
                        "kvtier: the workers did not report a step that wrote encoder "
                        "outputs: they are not stored (vLLM's V1 model runner drops an "
                        "ec_producer's report; use ec_both, or the V2 model runner)"
                    )

    def drain(self) -> Settlement:
        """Every step in flight, expired (at shutdown: nothing reports any more)."""
        out = Settlement()
        self._expire(self._next, out)
        return out
