"""The chunk size kvtierd expects of a registration is the one each producer of chunks makes: the
connector's KV pools (any TP rank, MLA, a quantised cache), the hidden pool stored as it is or in
fp8, its manifests, and encoder outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kvtier_vllm.layout.fp8 import FP8, Fp8Layout
from kvtier_vllm.layout.plans import kv_groups, plan_pools
from kvtier_vllm.shared.settings import ConnectorConfig

from kvtier.core.chunk_size import chunk_payload_bytes
from kvtier.core.encoder import DTYPE_BYTES, PartLayout, encoder_spec
from kvtier.core.keys import NamespaceSpec, PageLayout, Pool
from kvtier.hidden.reader import MANIFEST_PART_BYTES, manifest_spec
from tests.support import target_spec


class Model:
    """The part of vLLM's ModelConfig the connector's plans read."""

    def __init__(self, heads: int, head: int, dtype: torch.dtype, mla: bool) -> None:
        self.model, self.dtype, self.use_mla = "m", dtype, mla
        self._heads, self._head = heads, head

    def get_num_layers(self, parallel: object) -> int:
        return 4

    def get_head_size(self) -> int:
        return self._head

    def get_total_num_kv_heads(self) -> int:
        return self._heads

    def get_num_kv_heads(self, parallel: SimpleNamespace) -> int:
        return 1 if self.use_mla else max(1, self._heads // parallel.tensor_parallel_size)


@pytest.mark.parametrize("cache_dtype", ["auto", "float16", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize(
    ("heads", "head", "mla", "tp", "rank"),
    [(8, 128, False, 1, 0), (8, 64, False, 4, 3), (2, 64, False, 8, 5), (1, 576, True, 2, 1)],
)
def test_the_connectors_kv_pools(
    cache_dtype: str, heads: int, head: int, mla: bool, tp: int, rank: int
) -> None:
    vllm_config = SimpleNamespace(
        model_config=Model(heads, head, torch.bfloat16, mla),
        cache_config=SimpleNamespace(
            block_size=16, cache_dtype=cache_dtype, prefix_caching_hash_algo="sha256"
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, rank=rank, pipeline_parallel_size=1
        ),
        speculative_config=None,
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    (plan,) = plan_pools(
        vllm_config, kv_groups(None, names), ConnectorConfig(blocks_per_chunk=4), named=False
    )
    assert chunk_payload_bytes(plan.spec) == plan.chunk_bytes


@pytest.mark.parametrize("fp8", [False, True])
def test_the_hidden_pool_stored_as_it_is_or_in_fp8(fp8: bool) -> None:
    block, blocks, aux, hidden = 16, 4, 3, 256
    spec = NamespaceSpec(
        model="m",
        model_revision="",
        pool=Pool.HIDDEN,
        kv_dtype=f"{FP8}:bfloat16" if fp8 else "bfloat16",
        layout=PageLayout(block, blocks, aux, (hidden,), ("cache_only_layers.4",)),
        attention="hidden_states=1,2,3",
    )
    if fp8:
        expected = blocks * Fp8Layout(blocks, (aux, block, hidden)).page_bytes
    else:
        expected = blocks * block * aux * hidden * 2
    assert chunk_payload_bytes(spec) == expected
    assert chunk_payload_bytes(manifest_spec(spec.digest())) == MANIFEST_PART_BYTES


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_encoder_parts(dtype: str) -> None:
    spec = encoder_spec(
        model="m", encoder_revision="e", dtype=dtype, width=1152, rows_per_part=7, processor="p"
    )
    assert chunk_payload_bytes(spec) == PartLayout.of(spec).part_bytes


def test_a_dtype_of_unknown_width_is_refused_not_guessed() -> None:
    assert chunk_payload_bytes(target_spec()) == 256 << 10
    with pytest.raises(ValueError, match="'mystery4' has no known element size"):
        chunk_payload_bytes(target_spec(kv_dtype="mystery4"))
