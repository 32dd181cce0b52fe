"""Which stored tiers kvtierd serves: an unhealthy one is left out, the object store with an
unhealthy lmdb too (its chunks reach the arena through lmdb), the arena never; each change is
logged once."""

from __future__ import annotations

import logging

import pytest

from kvtier.tiering.health import TierHealth


def test_an_unhealthy_tier_is_left_out_and_each_change_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unhealthy: set[str] = set()
    health = TierHealth(lambda: set(unhealthy))
    caplog.set_level(logging.WARNING, logger="kvtier.tiering.health")
    assert all(health.serves(t) for t in ("cpu", "lmdb", "object"))

    unhealthy.update({"cpu", "object"})
    assert health.serves("cpu")  # the arena is never left out
    assert health.serves("lmdb")
    assert not health.serves("object")

    unhealthy.symmetric_difference_update({"object", "lmdb"})  # now cpu and lmdb
    assert not health.serves("lmdb")
    assert not health.serves("object")  # reached through lmdb
    assert health.shunned() == {"lmdb"}

    unhealthy.clear()
    assert all(health.serves(t) for t in ("cpu", "lmdb", "object"))
    said = [r.getMessage().split(" (")[0].split(":")[0] for r in caplog.records]
    assert said == [
        "object is unhealthy",
        "lmdb is unhealthy",
        "object is healthy again",
        "lmdb is healthy again",
    ]
