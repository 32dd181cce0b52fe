"""A benchmark's targets: a bound on a headline figure (``>=`` or ``<=``), whether a value meets
it, and how a report states it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Target = tuple[str, float]
"""``(">=" or "<=", bound)``."""


def met(value: float | None, op: str, bound: float) -> bool:
    """Whether ``value`` is within ``bound``; a figure that was not measured meets nothing."""
    if value is None:
        return False
    if op not in (">=", "<="):
        raise ValueError(f"a target's comparison is >= or <=, not {op!r}")
    return bool(value >= bound if op == ">=" else value <= bound)


def stated(targets: Mapping[str, Target]) -> dict[str, str]:
    """Each target as a report states it: ``">= 0.8"``."""
    return {key: f"{op} {bound:g}" for key, (op, bound) in targets.items()}


def judged(figures: Mapping[str, Any], targets: Mapping[str, Target]) -> dict[str, bool]:
    """For each target, whether its figure in ``figures`` meets it."""
    return {key: met(figures[key], op, bound) for key, (op, bound) in targets.items()}


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def ok_or_missed(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def judged_cell(targets: Mapping[str, Target], targets_met: Mapping[str, bool], key: str) -> str:
    """A report's target column: ``">= 0.8  ok"``; empty for a figure without a target."""
    if key not in targets:
        return ""
    op, bound = targets[key]
    return f"{op} {bound:g}  {ok_or_missed(targets_met[key])}"
