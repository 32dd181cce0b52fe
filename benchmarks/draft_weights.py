"""Swapping a running engine's draft weights on the CPU build, as vLLM's draft-weight update does.

vLLM's update API needs a weight-transfer backend, and those are GPU-oriented; on the CPU the same
reload runs through `collective_rpc`: the worker's draft model gets a layerwise reload (a plain
`load_weights` fails after the CPU build repacks weights).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def checkpoint_weights(model_dir: Path) -> dict[str, Any]:
    """A model's weights as saved, by checkpoint name."""
    from safetensors.torch import load_file

    weights: dict[str, Any] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


def noisy(weights: dict[str, Any], scale: float = 1.0, seed: int = 1) -> dict[str, Any]:
    """Other weights of the same shapes: a draft that no longer predicts the target."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        # constant tensors (norm weights are all ones) move by their magnitude instead
        spread = w.std() if w.numel() > 1 and w.std() > 0 else w.abs().mean()
        out[name] = w + torch.randn(w.shape, generator=generator, dtype=w.dtype) * scale * spread
    return out


def swap_draft_weights(llm: Any, weights: dict[str, Any]) -> float:
    """Load ``weights`` into the engine's draft model in place; returns the seconds it took."""

    def reload(worker: Any) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        runner = worker.model_runner
        model = runner.get_draft_model()
        config = runner.vllm_config.speculative_config.draft_model_config
        initialize_layerwise_reload(model)
        model.load_weights(iter(weights.items()))
        finalize_layerwise_reload(model, config)

    started = time.perf_counter()
    llm.collective_rpc(reload)
    return time.perf_counter() - started
