"""KVTierConnector: the thin facade vLLM loads; each role's work lives in its own module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier_vllm.adapter import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    cache_hit_source,
    transfer_results,
)
from kvtier_vllm.config import parse
from kvtier_vllm.metadata import KVTierMetadata
from kvtier_vllm.stats import KVTierPromMetrics, KVTierStats

if TYPE_CHECKING:
    import torch

    from kvtier_vllm.scheduler import KVTierScheduler
    from kvtier_vllm.worker import KVTierWorker


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = parse(self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler: KVTierScheduler | None = None
        self._worker: KVTierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvtier_vllm.scheduler import KVTierScheduler

            self._scheduler = KVTierScheduler(vllm_config, kv_cache_config, cfg)
        else:
            from kvtier_vllm.worker import KVTierWorker

            self._worker = KVTierWorker(vllm_config, cfg, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a miss is always fine

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        assert self._scheduler is not None
        sources = self._scheduler.hit_sources(request, num_external_tokens)
        if not sources:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {cache_hit_source(name): tokens for name, tokens in sources.items()}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(
            connector_output.kv_connector_worker_meta,
            getattr(connector_output, "failed_recving", None) or (),
        )

    def reset_cache(self) -> bool | None:
        if self._scheduler is not None:
            self._scheduler.reset_cache()
        return True

    def take_events(self) -> Any:
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.request_finished(request)
        return False, None  # stores copy in the step that computed them: blocks may go

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.request_finished(request)
        return False, None

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # stores run once per step, after the draft's forward too

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._worker.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Asynchronous loads (several KV-cache groups) done, and those that failed."""
        if self._worker is None:
            return transfer_results(set(), set())
        return transfer_results(*self._worker.finished_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.block_ids_with_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        return self._worker.worker_meta() if self._worker is not None else None

    def get_kv_connector_stats(self) -> Any:
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
