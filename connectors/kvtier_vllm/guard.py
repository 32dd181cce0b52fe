"""kvtier's failures stay inside the connector: vLLM sees a miss or a load error, never an
exception. A failure is logged with its traceback the first time per hook, then counted.

While torch's profiler runs, each hook is a ``kvtier:<hook>`` range in its trace, so kvtier's
share of an engine step can be read from it."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import torch.autograd.profiler as torch_profiler

log = logging.getLogger(__name__)
T = TypeVar("T")

failures: Counter[str] = Counter()
"""Failures contained, per hook (this process)."""


def contained(hook: str, call: Callable[[], T], fallback: Callable[[], T]) -> T:
    """``call()``; on any exception, log it and return ``fallback()`` (which must not raise)."""
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
