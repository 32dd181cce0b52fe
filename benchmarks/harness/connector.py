"""The ``kv_transfer_config`` an engine runs kvtier's connector with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def kvtier_connector(
    extra: Mapping[str, Any], *, recompute_failed_loads: bool = True
) -> dict[str, Any]:
    """`KVTierConnector` loading and storing, with ``extra`` as its own settings. A failed load
    is recomputed, never an error (the setting every deployment should use), unless a benchmark
    runs vLLM's default."""
    config: dict[str, Any] = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier_vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": dict(extra),
    }
    if recompute_failed_loads:
        config["kv_load_failure_policy"] = "recompute"
    return config


def connector_knows(setting: str) -> bool:
    """Whether `KVTierConnector`'s settings have ``setting``: a benchmark passes a setting only
    to a connector that takes it (an unknown one is refused)."""
    from kvtier_vllm.shared.settings import ConnectorConfig

    return setting in ConnectorConfig.model_fields
