"""A tier is unhealthy while its integrity failures within the window reach the threshold, and
healthy again once they fall out of it."""

from __future__ import annotations

from typing import cast

from kvtier.core.config import ManagerConfig
from kvtier.tiering.integrity import IntegrityReports
from kvtier.tiers.base import Tier


class _Counted:
    """A tier's failure count, as the window reads it."""

    def __init__(self) -> None:
        self.failures = 0

    def corrupt_chunks(self) -> int:
        return self.failures


def test_a_tier_is_unhealthy_while_its_failures_in_the_window_reach_the_threshold() -> None:
    now = [0.0]
    lmdb, cpu = _Counted(), _Counted()
    tiers = cast(dict[str, Tier], {"lmdb": lmdb, "cpu": cpu})
    config = ManagerConfig(integrity_window_s=60.0, integrity_unhealthy_failures=3)
    reports = IntegrityReports(tiers, None, config, clock=lambda: now[0])
    assert reports.unhealthy() == set()
    now[0] = 10.0
    lmdb.failures = 2
    cpu.failures = 5
    assert reports.unhealthy() == {"cpu"}
    now[0] = 20.0
    lmdb.failures = 3
    assert reports.unhealthy() == {"lmdb", "cpu"}
    now[0] = 75.0  # the window (15 s, 75 s] holds one lmdb failure and no cpu one
    assert reports.unhealthy() == set()
    now[0] = 90.0
    cpu.failures = 8  # three more: unhealthy again at once
    assert reports.unhealthy() == {"cpu"}
