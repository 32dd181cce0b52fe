"""Connector logic that needs no engine: pool splitting, its settings, process-local keys."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvtier_vllm.layout.plans import is_draft_layer, split_layers
from kvtier_vllm.shared.settings import Mode, parse

from kvtier.core.errors import ConfigError
from kvtier.core.keys import Pool


def test_draft_layers_by_prefix_and_by_numbering() -> None:
    names = [
        "model.layers.1.self_attn.attn",
        "model.layers.0.self_attn.attn",
        "draft_model.model.layers.0.self_attn.attn",
    ]
    pools = split_layers(names, target_layers=2)
    assert pools[Pool.TARGET] == ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
    assert pools[Pool.DRAFT] == ("draft_model.model.layers.0.self_attn.attn",)
    # EAGLE-style heads continue the target's numbering
    assert is_draft_layer("model.layers.2.self_attn.attn", target_layers=2)
    assert not is_draft_layer("model.layers.1.self_attn.attn", target_layers=2)
    assert set(split_layers(names[:2], target_layers=2)) == {Pool.TARGET}


def test_settings_are_validated_with_the_key_named() -> None:
    assert parse(None).mode is Mode.EMBEDDED
    assert parse({"mode": "sidecar", "blocks_per_chunk": 4}).blocks_per_chunk == 4
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.blocks_per_chunk"):
        parse({"blocks_per_chunk": 0})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.modee"):
        parse({"modee": "sidecar"})


@pytest.mark.parametrize(
    ("algo", "seeded", "shared"),
    [
        ("sha256", False, True),
        ("xxhash", True, True),
        ("xxhash", False, False),
    ],
)
def test_keys_stay_process_local_when_hashes_are_seeded_per_process(
    monkeypatch: pytest.MonkeyPatch, algo: str, seeded: bool, shared: bool
) -> None:
    from kvtier_vllm.kv.scheduler_side.prompt_keys import stable_tenant

    if seeded:
        monkeypatch.setenv("PYTHONHASHSEED", "0")
    else:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo))
    cfg = parse({})
    stable = stable_tenant(cfg, vllm_config)
    assert (stable.tenant == cfg.tenant) is shared
    if not shared:
        assert stable.tenant != stable_tenant(cfg, vllm_config).tenant


@pytest.mark.parametrize(("policy", "warned"), [("fail", True), ("recompute", False)])
def test_an_engine_that_fails_requests_on_load_errors_is_warned(policy: str, warned: bool) -> None:
    from kvtier_vllm.shared.vllm_compat import failure_policy_warning

    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy))
    assert bool(failure_policy_warning(config)) is warned
    assert ("recompute" in failure_policy_warning(config)) is warned
