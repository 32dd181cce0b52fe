"""A failure that repeats on every request is logged at once, then at most once an interval,
with the count of lines left out (kvtier/core/log_limit.py)."""

from __future__ import annotations

import logging

import pytest

from kvtier.core.log_limit import LimitedLog
from tests.support import HandClock


def test_the_first_line_is_logged_the_rest_counted_until_the_interval_passes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, logger = HandClock(), logging.getLogger("kvtier.test.limited")
    limited = LimitedLog(logger, logging.WARNING, interval_s=30.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for i in range(500):
            limited.log("cannot read chunk %s: %s", f"k{i}", "readers full")
        clock.now += 29.9
        limited.log("cannot read chunk %s: %s", "late", "readers full")
        assert [r.getMessage() for r in caplog.records] == ["cannot read chunk k0: readers full"]
        clock.now += 0.2  # 30.1 s after the first line
        limited.log("cannot read chunk %s: %s", "k-next", "closed")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1] == "cannot read chunk k-next: closed (and 500 more like it since the last line)"
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.WARNING]


def test_a_failure_after_a_quiet_interval_is_logged_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, logger = HandClock(), logging.getLogger("kvtier.test.limited.quiet")
    limited = LimitedLog(logger, logging.ERROR, interval_s=30.0, clock=clock)
    with caplog.at_level(logging.ERROR, logger=logger.name):
        limited.log("first")
        clock.now += 3600
        limited.log("an hour later")
    assert [r.getMessage() for r in caplog.records] == ["first", "an hour later"]
