"""The sidecar client's deadlines, as the connector's config gives them."""

from __future__ import annotations

import pytest
from kvtier_vllm.shared.settings import parse

from kvtier.core.errors import ConfigError
from kvtier.rpc import Deadlines


def test_defaults_are_milliseconds_for_step_calls_and_longer_for_registering() -> None:
    deadlines = parse({}).deadlines()
    assert deadlines == Deadlines(
        lookup_s=0.05, store_s=0.1, register_s=2.0, probe_s=0.1, probe_every_s=0.5, misses_to_open=3
    )
    # a step waits at most a lookup's or a store's deadline, far under a second
    assert max(deadlines.lookup_s, deadlines.store_s) < 0.2 < deadlines.register_s


def test_each_deadline_is_set_in_the_extra_config() -> None:
    cfg = parse(
        {
            "lookup_deadline_ms": 20,
            "store_deadline_ms": 30,
            "register_deadline_ms": 500,
            "probe_deadline_ms": 40,
            "probe_interval_ms": 250,
            "breaker_misses": 1,
        }
    )
    assert cfg.deadlines() == Deadlines(
        lookup_s=0.02,
        store_s=0.03,
        register_s=0.5,
        probe_s=0.04,
        probe_every_s=0.25,
        misses_to_open=1,
    )


@pytest.mark.parametrize(
    "key", ["lookup_deadline_ms", "store_deadline_ms", "probe_interval_ms", "breaker_misses"]
)
def test_a_deadline_of_zero_is_refused_naming_its_key(key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse({key: 0})
    assert caught.value.key == f"kv_connector_extra_config.{key}"
