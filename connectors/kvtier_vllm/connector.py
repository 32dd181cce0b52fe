"""KVTierConnector: the thin facade vLLM loads; each role's work lives in its own module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier_vllm.kv.connector_stats import KVTierPromMetrics, KVTierStats
from kvtier_vllm.kv.metadata import KVTierMetadata
from kvtier_vllm.layout.states import state_chunking
from kvtier_vllm.shared.build_check import say_build_once
from kvtier_vllm.shared.guard import contained, report_with_next_stats
from kvtier_vllm.shared.settings import parse
from kvtier_vllm.shared.vllm_compat import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    cache_hit_source,
    transfer_results,
)
from kvtier_vllm.shared.vllm_stats import prom_metrics_hook, stats_hook

if TYPE_CHECKING:
    import torch

    from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler
    from kvtier_vllm.kv.worker_side.worker import KVTierWorker


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        say_build_once()
        cfg = parse(self._kv_transfer_config.kv_connector_extra_config)
        scheduler = role == KVConnectorRole.SCHEDULER
        cfg = state_chunking(cfg, kv_cache_config, announce=scheduler)
        self._scheduler: KVTierScheduler | None = None
        self._worker: KVTierWorker | None = None
        if scheduler:
            from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler

            self._scheduler = KVTierScheduler(vllm_config, kv_cache_config, cfg)
        else:
            from kvtier_vllm.kv.worker_side.worker import KVTierWorker

            self._worker = KVTierWorker(vllm_config, cfg, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a miss is always fine

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        scheduler = self._scheduler
        assert scheduler is not None
        return contained(
            "get_num_new_matched_tokens",
            lambda: scheduler.get_num_new_matched_tokens(request, num_computed_tokens),
            lambda: (0, False),
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        scheduler = self._scheduler
        assert scheduler is not None
        contained(
            "update_state_after_alloc",
            lambda: scheduler.update_state_after_alloc(request, blocks, num_external_tokens),
            lambda: contained(
                "abandon_load",
                lambda: scheduler.abandon_load(request, blocks, num_external_tokens),
                lambda: None,
            ),
        )

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        scheduler = self._scheduler
        assert scheduler is not None
        none: dict[str, int] = {}
        sources = contained(
            "get_external_cache_hit_sources",
            lambda: scheduler.hit_sources(request, num_external_tokens),
            none.copy,
        )
        if not sources:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {cache_hit_source(name): tokens for name, tokens in sources.items()}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        scheduler = self._scheduler
        assert scheduler is not None
        return contained(
            "build_connector_meta",
            lambda: scheduler.build_connector_meta(scheduler_output),
            lambda: contained(
                "abandon_step",
                lambda: scheduler.abandon_step(scheduler_output),
                KVTierMetadata,
            ),
        )

    def update_connector_output(self, connector_output: Any) -> None:
        scheduler = self._scheduler
        assert scheduler is not None
        contained(
            "update_connector_output",
            lambda: scheduler.update_connector_output(
                connector_output.kv_connector_worker_meta,
                getattr(connector_output, "failed_recving", None) or (),
                getattr(connector_output, "invalid_block_ids", None) or (),
                getattr(connector_output, "finished_recving", None) or (),
            ),
            lambda: None,
        )

    def reset_cache(self) -> bool | None:
        scheduler = self._scheduler
        if scheduler is not None:
            contained("reset_cache", scheduler.reset_cache, lambda: None)
        return True

    def take_events(self) -> Any:
        scheduler = self._scheduler
        return contained("take_events", scheduler.take_events, list) if scheduler else ()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, [list(block_ids)])

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, [list(ids) for ids in block_ids])

    def _finished(
        self, request: Any, block_ids: list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Stores copy in the step that computed them, so blocks may go; only a request whose
        hidden states end in a partial chunk keeps them until that tail is stored."""
        scheduler = self._scheduler
        assert scheduler is not None
        finished = contained(
            "request_finished",
            lambda: scheduler.request_finished(request, block_ids),
            lambda: (False, None),
        )
        report_with_next_stats()
        return finished

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._worker
        assert worker is not None
        contained(
            "register_kv_caches", lambda: worker.register_kv_caches(kv_caches), worker.plans.clear
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self._worker
        assert worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        contained(
            "start_load_kv",
            lambda: worker.start_load_kv(meta),
            lambda: worker.fail_step(meta, True),
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # synchronous loads complete in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # stores run once per step, after the draft's forward too

    def wait_for_save(self) -> None:
        worker = self._worker
        assert worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        contained(
            "wait_for_save",
            lambda: worker.wait_for_save(meta),
            lambda: worker.fail_step(meta, False),
        )

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Asynchronous loads done, and those that failed as a whole; finished
        requests whose last stores landed."""
        worker = self._worker
        if worker is None:
            return transfer_results(set(), set())
        done = contained("get_transfer_results", worker.finished_loads, worker.fail_receiving)
        sent = contained(
            "get_transfer_results",
            worker.finished_sends,
            worker.all_sends,
        )
        return transfer_results(*done, sent)

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._worker
        if worker is None:
            return set()
        return contained(
            "get_block_ids_with_load_errors",
            worker.block_ids_with_load_errors,
            worker.unchecked_errors,
        )

    def build_connector_worker_meta(self) -> Any:
        worker = self._worker
        return (
            contained("build_connector_worker_meta", worker.worker_meta, lambda: None)
            if worker
            else None
        )

    def get_kv_connector_stats(self) -> Any:
        role = self._scheduler or self._worker
        return (
            contained("get_kv_connector_stats", role.take_stats, lambda: None)
            if role is not None
            else None
        )

    build_kv_connector_stats = stats_hook(KVTierStats)
    build_prom_metrics = prom_metrics_hook(KVTierPromMetrics)

    def shutdown(self) -> None:
        for role in (self._worker, self._scheduler):
            if role is not None:
                contained("shutdown", role.shutdown, lambda: None)
