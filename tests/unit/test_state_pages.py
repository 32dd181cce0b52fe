"""A state layer's cache as kvtier copies it, and the chunk size of an engine with state layers
(vLLM's own spec classes, no engine)."""

from __future__ import annotations

import torch
from kvtier_vllm.layout.states import state_chunking, state_pages
from kvtier_vllm.shared.settings import ConnectorConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

PAGE, PADDED, BLOCKS = 96, 128, 5


def test_a_state_page_is_the_unpadded_bytes_of_its_block() -> None:
    # as vLLM hands a state layer to a connector: [blocks, 1, 1, state bytes] at the padded
    # page's stride
    raw = torch.arange(BLOCKS * PADDED, dtype=torch.int32).to(torch.int8)
    cache = raw.as_strided((BLOCKS, 1, 1, PAGE), (PADDED, PAGE, PAGE, 1))
    pages = state_pages(cache)
    assert pages is not None
    assert pages.shape == (BLOCKS, PAGE)
    assert pages.dtype == torch.uint8
    for block in range(BLOCKS):
        want = raw[block * PADDED : block * PADDED + PAGE].view(torch.uint8)
        assert torch.equal(pages[block], want)
    pages[2] = 0  # a load writes the block in place
    assert not raw[2 * PADDED : 2 * PADDED + PAGE].any()
    assert raw[2 * PADDED + PAGE : 3 * PADDED].any()  # the padding is never written


def test_a_state_layer_handed_over_otherwise_is_not_copied() -> None:
    assert state_pages([torch.zeros(BLOCKS, PAGE)]) is None
    scattered = torch.zeros(PAGE, BLOCKS).t()  # a block's bytes not contiguous
    assert state_pages(scattered) is None


def test_an_engine_with_state_layers_stores_one_block_per_chunk() -> None:
    mamba = MambaSpec(block_size=544, shapes=((4,),), dtypes=(torch.float32,))
    full = FullAttentionSpec(block_size=544, num_kv_heads=2, head_size=32, dtype=torch.float32)

    def engine(*specs: object) -> KVCacheConfig:
        groups = [KVCacheGroupSpec([f"model.layers.{i}.x"], s) for i, s in enumerate(specs)]
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)

    cfg = ConnectorConfig(blocks_per_chunk=4)
    assert state_chunking(cfg, engine(mamba, full), announce=False).blocks_per_chunk == 1
    assert state_chunking(cfg, engine(full), announce=False).blocks_per_chunk == 4
