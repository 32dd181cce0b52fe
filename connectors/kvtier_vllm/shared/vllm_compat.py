"""The connectors' side of vLLM's connector APIs, the one module that imports vLLM: the KV and
encoder-cache connectors' base, metadata and metrics types, what they read from a ``VllmConfig``
and vLLM's state (replica, drafter block drop, load failure policy, KV cache dtype, tensor
parallel rank), and the KV events, cache-hit sources and transfer results the KV connector hands
back, each written once for the vLLM versions we support (0.32 CPU build, 0.33)."""

from __future__ import annotations

from typing import Any

import vllm
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = [
    "ECConnectorBase",
    "ECConnectorMetadata",
    "ECConnectorPromMetrics",
    "ECConnectorRole",
    "ECConnectorStats",
    "ECConnectorWorkerMetadata",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "SupportsHMA",
    "block_removed_event",
    "block_stored_event",
    "cache_hit_source",
    "eagle_block_drop",
    "failure_policy_warning",
    "kv_cache_dtype_bytes",
    "preemptions",
    "replica_of",
    "tensor_parallel_rank",
    "transfer_results",
    "vllm_version",
]


def vllm_version() -> str:
    """The running vLLM's version, as its package says it."""
    return str(vllm.__version__)


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


def kv_cache_dtype_bytes(cache_dtype: str, model_config: Any) -> int:
    """Bytes per element of the KV cache, for ``--kv-cache-dtype`` (``auto``: the model's)."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    return int(kv_cache_dtype_str_to_dtype(cache_dtype, model_config).itemsize)


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank, once vLLM has set up its parallel state."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


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


def preemptions(request: Any) -> int:
    """How often vLLM preempted ``request``: each time, it freed the request's blocks."""
    return int(getattr(request, "num_preemptions", 0))
