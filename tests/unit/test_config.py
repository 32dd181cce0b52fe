from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.config import KVTierConfig, describe, from_mapping, load_config
from kvtier.core.cpus import format_cpu_list, parse_cpu_list


def test_defaults_need_no_file() -> None:
    cfg = load_config(env={})
    assert cfg.arena.path == Path("/dev/shm/kvtier-arena")
    assert cfg.arena.size_bytes is None
    assert cfg.lmdb.enabled
    assert set(cfg.arena.pools) == {"target", "draft", "hidden", "encoder", "state"}


def test_yaml_then_environment_overrides(tmp_path: Path) -> None:
    f = tmp_path / "kvtier.yaml"
    f.write_text("arena:\n  size_bytes: 1GiB\nlmdb:\n  high_water: 0.9\n  low_water: 0.5\n")
    cfg = load_config(f, env={"KVTIER_ARENA__SIZE_BYTES": "2GiB", "KVTIER_LMDB__ENABLED": "false"})
    assert cfg.arena.size_bytes == 2 << 30
    assert cfg.lmdb.high_water == 0.9
    assert not cfg.lmdb.enabled


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"KVTIER_ARENA__SIZE_BYTES": "lots"}, "arena.size_bytes"),
        ({"KVTIER_ARENA__BOGUS": "1"}, "arena.bogus"),
        ({"KVTIER_LMDB__HIGH_WATER": "1.5"}, "lmdb.high_water"),
        ({"KVTIER_LMDB__LOW_WATER": "0.99"}, "lmdb"),
        ({"KVTIER_MANAGER__DEMOTE_MODE": "sometimes"}, "manager.demote_mode"),
        ({"KVTIER_ARENA__EVICTION_POLICY": "arc"}, "arena.eviction_policy"),
        ({"KVTIER_LMDB__EVICTION_POLICY": "arc"}, "lmdb.eviction_policy"),
        ({"KVTIER_ARENA__POOLS__DRAFT__MAX_SHARE": "0"}, "arena.pools.draft.max_share"),
    ],
)
def test_invalid_values_name_their_key(env: dict[str, str], key: str) -> None:
    with pytest.raises(ValueError, match=rf"^{key}\b"):
        load_config(env=env)


def test_bad_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--config: cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping at the top level"):
        load_config(bad, env={})


def test_every_key_has_a_default_and_a_description() -> None:
    KVTierConfig()  # every key has a default
    keys = dict(describe())
    assert len(keys) > 15
    assert all(keys.values()), [k for k, d in keys.items() if not d]


def test_the_reference_page_documents_every_key() -> None:
    page = (Path(__file__).parents[2] / "docs" / "reference" / "configuration.md").read_text()
    missing = [key for key, _ in describe() if f"`{key}`" not in page]
    assert not missing, f"docs/reference/configuration.md lacks {missing}"


@pytest.mark.parametrize(
    ("value", "cpus"),
    [("1", {1}), ("2-5,8", {2, 3, 4, 5, 8}), (" 0 , 3-4 ", {0, 3, 4}), (3, {3}), ([0, 2], {0, 2})],
)
def test_server_cpus_take_linux_cpu_lists(value: object, cpus: set[int]) -> None:
    cfg = from_mapping({"server": {"cpus": value}})
    assert cfg.server.cpus == frozenset(cpus)
    assert parse_cpu_list(format_cpu_list(frozenset(cpus))) == frozenset(cpus)


def test_server_cpus_from_the_environment_and_back_as_a_list() -> None:
    cfg = load_config(env={"KVTIER_SERVER__CPUS": "0-2,7"})
    assert cfg.server.cpus == {0, 1, 2, 7}
    assert format_cpu_list(cfg.server.cpus) == "0-2,7"
    assert load_config(env={}).server.cpus is None


@pytest.mark.parametrize("value", ["", "x", "3-1", "1,,2", "-1", [], [-1], True])
def test_a_bad_cpu_list_names_server_cpus(value: object) -> None:
    with pytest.raises(ValueError, match=r"^server\.cpus\b"):
        from_mapping({"server": {"cpus": value}})
