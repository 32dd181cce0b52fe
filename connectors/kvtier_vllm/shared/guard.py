"""kvtier's failures stay inside the connector: vLLM sees a miss or a load error, never an
exception. A failure is logged with its traceback the first time per hook, then counted.

Every hook's time is added up per hook: vLLM waits for each hook on its engine loop, so that
time is what kvtier takes from serving, and `take_seconds` hands it to the connector's stats.
While torch's profiler runs, each hook is also a ``kvtier:<hook>`` range in its trace."""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import TypeVar

import torch.autograd.profiler as torch_profiler

log = logging.getLogger(__name__)
T = TypeVar("T")

REPORT_INTERVAL_S = 1.0
"""Hook time rides on the stats of every step that has other news, and at least this often
otherwise: a report is a message from each worker to vLLM's engine loop."""

failures: Counter[str] = Counter()
"""Failures contained, per hook (this process)."""
seconds: defaultdict[str, float] = defaultdict(float)
"""Seconds spent inside each hook, fallbacks included, since `take_seconds` last took them."""
_taken_at = time.monotonic()
_due = False


def contained(hook: str, call: Callable[[], T], fallback: Callable[[], T]) -> T:
    """``call()``; on any exception, log it and return ``fallback()`` (which must not raise)."""
    started = time.perf_counter()
    try:
        if torch_profiler._is_profiler_enabled:  # a flag read: nothing to pay unprofiled
            with torch_profiler.record_function(f"kvtier:{hook}"):
                return call()
        return call()
    except Exception:
        failures[hook] += 1
        if failures[hook] == 1:
            log.exception("kvtier: %s failed; vLLM goes on as if kvtier had missed", hook)
        else:
            log.warning("kvtier: %s failed again (%d times)", hook, failures[hook])
        return fallback()
    finally:
        seconds[hook] += time.perf_counter() - started


def report_with_next_stats() -> None:
    """Makes the next take due. A request finished: vLLM reads the stats of the step that
    finished it before the request's caller hears of it, so the time spent on its behalf is
    reported then, not a report interval later (never, for a run shorter than one)."""
    global _due
    _due = True


def take_seconds(due: bool = False) -> dict[str, float]:
    """The hook seconds added up since the last take, when ``due``, a request finished
    (`report_with_next_stats`) or `REPORT_INTERVAL_S` has passed since then; otherwise nothing
    (they wait for the next take)."""
    global _taken_at, _due
    now = time.monotonic()
    if not seconds or not (due or _due or now - _taken_at >= REPORT_INTERVAL_S):
        return {}
    _taken_at = now
    _due = False
    taken = dict(seconds)
    seconds.clear()
    return taken
