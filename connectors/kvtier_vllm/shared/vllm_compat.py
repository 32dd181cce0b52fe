"""The connector's side of vLLM's connector API: its base and metadata types, what the connector
reads from a ``VllmConfig`` (replica, drafter block drop, load failure policy), and the KV
events, cache-hit sources and transfer results it hands back, each written once for the vLLM
versions we support (0.32 CPU build, 0.33). `stats` imports vLLM's connector metrics types."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

__all__ = [
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorWorkerMetadata",
    "SupportsHMA",
    "block_removed_event",
    "block_stored_event",
    "cache_hit_source",
    "eagle_block_drop",
    "failure_policy_warning",
    "replica_of",
    "transfer_results",
]


def replica_of(vllm_config: object) -> str:
    """The data-parallel replica: dense DP engines reset data_parallel_rank to 0, so the index
    is what tells them apart."""
    parallel = vllm_config.parallel_config  # type: ignore[attr-defined]
    index = getattr(parallel, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel, "data_parallel_rank", 0)
    return f"dp{index}"


def eagle_block_drop(vllm_config: object) -> bool:
    """Whether vLLM drops the last block of a prefix-cache hit: its drafter (EAGLE, MTP,
    DFlash) wrote that block's last draft KV from the token after it, which another request
    need not share. 0.32 and 0.33 name it ``use_eagle_block_drop``; older builds only
    ``use_eagle``."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    check = getattr(spec, "use_eagle_block_drop", None) or spec.use_eagle
    return bool(check())


def failure_policy_warning(vllm_config: object) -> str:
    """What to tell an operator whose engine ends a request when a load fails; "" when vLLM
    recomputes it. kvtier reports a load it cannot complete (an evicted slot, a dead daemon)
    as failed, which is only harmless with ``kv_load_failure_policy: recompute``."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    policy = getattr(transfer, "kv_load_failure_policy", "recompute")
    if policy == "recompute":
        return ""
    return (
        f"kv_load_failure_policy={policy}: a request whose kvtier load fails (an evicted slot, "
        'a daemon gone) ends with an error; set "kv_load_failure_policy": "recompute" in '
        "--kv-transfer-config to have vLLM compute it instead"
    )


def cache_hit_source(name: str) -> object:
    """vLLM's CacheHitSource member for "host" or "disk" (a plain string where it is absent)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return name
    return CacheHitSource(name)


def publishes_kv_events(vllm_config: object) -> bool:
    """Whether vLLM publishes KV events: without a publisher the ones the connector makes are
    dropped, so it makes none."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


def block_stored_event(
    hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int, medium: str
) -> object:
    """A KV event telling routers these blocks are now held in ``medium``: "CPU" (the arena)
    or "STORAGE" (lmdb)."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    return BlockStored(
        block_hashes=[maybe_convert_block_hash(BlockHash(h)) for h in hashes],
        parent_block_hash=None if parent is None else maybe_convert_block_hash(BlockHash(parent)),
        token_ids=token_ids,
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def block_removed_event(hashes: list[bytes], medium: str) -> object:
    """A KV event telling routers ``medium`` no longer holds these blocks."""
    from vllm.distributed.kv_events import BlockRemoved
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    return BlockRemoved(
        block_hashes=[maybe_convert_block_hash(BlockHash(h)) for h in hashes], medium=medium
    )


def transfer_results(
    done: set[str], failed: set[str], sent: set[str] | None = None
) -> KVConnectorTransferResults:
    """Loads finished (a failed one is also finished, so vLLM stops waiting for it), and the
    finished requests whose blocks may go now."""
    return KVConnectorTransferResults(
        finished_sending=sent or set(), finished_recving=done | failed, failed_recving=failed
    )
