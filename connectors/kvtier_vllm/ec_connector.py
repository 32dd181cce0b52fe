"""KVTierECConnector: multimodal encoder outputs through kvtier's tiers, the facade vLLM loads
with ``--ec-transfer-config``.

Load it with ``"ec_connector": "KVTierECConnector"`` and
``"ec_connector_module_path": "kvtier_vllm.ec_connector"``. Every role works: ``ec_producer``
only stores, ``ec_consumer`` only loads, ``ec_both`` does both. A failure of the tiers means the
encoder runs; it never fails a request.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvtier_vllm.encoder.connector_stats import Deltas, KVTierECPromMetrics, KVTierECStats
from kvtier_vllm.encoder.metadata import ECReport, ECStepPlan
from kvtier_vllm.encoder.settings import parse
from kvtier_vllm.shared.build_check import say_build_once
from kvtier_vllm.shared.guard import contained
from kvtier_vllm.shared.vllm_compat import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorStats,
    ECConnectorWorkerMetadata,
    tensor_parallel_rank,
)
from kvtier_vllm.shared.vllm_stats import prom_metrics_hook, stats_hook

log = logging.getLogger(__name__)


class KVTierECMetadata(ECConnectorMetadata):
    def __init__(self, plan: ECStepPlan) -> None:
        self.plan = plan


class KVTierECReport(ECConnectorWorkerMetadata):
    def __init__(self, report: ECReport) -> None:
        self.report = report

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, KVTierECReport)
        return KVTierECReport(self.report.merge(other.report))


class KVTierECConnector(ECConnectorBase):
    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        say_build_once()
        transfer = vllm_config.ec_transfer_config
        cfg = parse(transfer.ec_connector_extra_config)
        self._deltas = Deltas()
        if role == ECConnectorRole.SCHEDULER:
            from kvtier_vllm.encoder.identity import encoder_specs
            from kvtier_vllm.encoder.scheduler import EncoderCacheScheduler

            replica = cfg.replica_id or f"dp{vllm_config.parallel_config.data_parallel_index}"
            self._scheduler: EncoderCacheScheduler | None = EncoderCacheScheduler(
                cfg,
                encoder_specs(vllm_config, cfg),
                replica,
                producer=self.is_producer,
                consumer=self.is_consumer,
            )
            self._worker = None
        else:
            from kvtier_vllm.encoder.worker import EncoderCacheWorker

            device = torch.device(vllm_config.device_config.device)
            writes = self.is_producer and tensor_parallel_rank() == 0
            self._scheduler = None
            self._worker = EncoderCacheWorker(device, writes)

    # -- scheduler side -------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        scheduler = self._scheduler
        assert scheduler is not None
        return contained("ec_has_cache_item", lambda: scheduler.has_cache_item(identifier), _no)

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        scheduler = self._scheduler
        assert scheduler is not None
        return contained(
            "ec_ensure_cache_available",
            lambda: scheduler.ensure_cache_available(request, num_computed_tokens),
            _yes,
        )

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        scheduler = self._scheduler
        assert scheduler is not None
        contained(
            "ec_update_state_after_alloc",
            lambda: scheduler.update_state_after_alloc(request, index),
            _nothing,
        )

    def build_connector_meta(self, scheduler_output: Any) -> ECConnectorMetadata:
        scheduler = self._scheduler
        assert scheduler is not None
        plan = contained("ec_build_connector_meta", scheduler.build_plan, ECStepPlan)
        return KVTierECMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        scheduler = self._scheduler
        assert scheduler is not None
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        report = meta.report if isinstance(meta, KVTierECReport) else None
        contained("ec_update_connector_output", lambda: scheduler.settle(report), _nothing)

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        scheduler = self._scheduler
        if scheduler is None:
            return None  # the scheduler side reports the workers' figures too
        return self._deltas.take(scheduler.counters)

    build_ec_connector_stats = stats_hook(KVTierECStats)
    build_prom_metrics = prom_metrics_hook(KVTierECPromMetrics)

    def take_unavailable_requests(self) -> set[str]:
        scheduler = self._scheduler
        return scheduler.take_unavailable() if scheduler is not None else set()

    # -- worker side ----------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # every role's step starts here (a producer's loads nothing, and saves)
        if self._worker is not None and isinstance(connector_metadata, KVTierECMetadata):
            self._worker.bind(connector_metadata.plan)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        worker = self._worker
        assert worker is not None
        worker.load(encoder_cache)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        worker = self._worker
        assert worker is not None
        contained("ec_save_caches", lambda: worker.save(encoder_cache, mm_hash), _nothing)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        worker = self._worker
        assert worker is not None
        return KVTierECReport(worker.report())

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()


def _no() -> bool:
    return False


def _yes() -> bool:
    return True


def _nothing() -> None:
    return None
