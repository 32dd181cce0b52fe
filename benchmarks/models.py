"""The models the serving benchmark runs (built locally by tests/fixtures/models.py), each with
the engine sizes and the multi-round workload it is measured with (``--model``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.sizes import MiB
from tests.fixtures import models


@dataclass(frozen=True)
class ServingModel:
    name: str
    label: str
    shape: Mapping[str, Any]
    """``build_llama``'s arguments."""
    kv_cache_bytes: int
    """Every server's KV cache: a quarter of the multi-round working set or less."""
    max_model_len: int
    """What the KV cache holds, or less."""
    doc_tokens: int
    question_tokens: int
    answer_tokens: int
    gpu_ratio: bool = False
    """Shaped to a GPU's recompute:load ratio: the run measures its ratios and the targets
    that hold on a GPU node."""
    level_scale: int = 1
    """Each level runs this many times the users (multi-round) or requests (no-reuse): shorter
    documents than the model's own (fitted to the machine) would make a level too short to
    measure against the machine's drift."""

    @property
    def dtype(self) -> str:
        return str(self.shape["dtype"])

    def build(self, root: Path, tokenizer_dir: Path) -> Path:
        return models.build_llama(root, tokenizer_dir=tokenizer_dir, **self.shape)

    def build_draft(self, root: Path, tokenizer_dir: Path) -> Path:
        """The same build with one layer (the speculative servers' draft)."""
        return models.build_draft(root, tokenizer_dir=tokenizer_dir, **self.shape)


PRESENT = ServingModel(
    "present",
    "12 layers, hidden 768, bf16: recompute hundreds of times a load",
    models.BENCHMARK_SHAPE,
    kv_cache_bytes=48 * MiB,  # 4,096 tokens of the 12 layers
    max_model_len=3744,  # what 48 MiB holds with the draft's layer beside the target's 12
    doc_tokens=1664,
    question_tokens=32,
    answer_tokens=64,
)
GPU_RATIO = ServingModel(
    "gpu-ratio",
    "2 layers, 8 KV heads x 128, fp32 KV: a GPU's recompute:load ratio",
    models.GPU_RATIO_SHAPE,
    kv_cache_bytes=40 * MiB,  # 2,560 tokens of 16 KiB: a quarter of the working set
    max_model_len=2048,
    # the longest documents the fit tries (benchmarks/gpu_ratio_fit.py), where a CPU with
    # AVX-512 prefills a token at 14-20x an arena load; a slower one gets shorter ones
    doc_tokens=960,
    question_tokens=32,
    answer_tokens=32,
    gpu_ratio=True,
)
MODELS = {model.name: model for model in (PRESENT, GPU_RATIO)}
