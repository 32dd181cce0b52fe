"""A state layer's cache as kvtier copies it, the chunk size of an engine with state layers, and
a state chunk's verification compare, part by part (vLLM's own spec classes, no engine)."""

from __future__ import annotations

import pytest
import torch
from kvtier_vllm.kv.worker_side.state_compare import StateCompare
from kvtier_vllm.layout.states import StateShape, state_chunking, state_pages, state_shape
from kvtier_vllm.shared.settings import ConnectorConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

PAGE, PADDED, BLOCKS = 96, 128, 5
DEFAULT_MAX_ERROR = ConnectorConfig().verify_max_error


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


def _test_model_states() -> dict[str, MambaSpec]:
    """The state layers of tests/fixtures/state_models.py's hybrids, as vLLM sizes them."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator as Dtypes,
    )
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateShapeCalculator as Shapes,
    )

    def spec(shapes: tuple[tuple[int, ...], ...], dtypes: tuple[torch.dtype, ...]) -> MambaSpec:
        return MambaSpec(block_size=96, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align")

    return {
        # gated delta nets: 1 key head and 2 value heads of 128, conv kernel 4; bf16 model
        # with the recurrent state in fp32
        "qwen3-next": spec(
            Shapes.gated_delta_net_state_shape(1, 1, 2, 128, 128, 4),
            Dtypes.gated_delta_net_state_dtype(torch.bfloat16, "auto", "float32"),
        ),
        # Mamba-2: 8 heads of 32, state 32, one group, conv kernel 4; fp32
        "mamba2": spec(
            Shapes.mamba2_state_shape(1, 8 * 32, 1, 8, 32, 32, 4),
            Dtypes.mamba2_state_dtype(torch.float32, "auto", "auto"),
        ),
    }


def _pages(shape: StateShape, blocks: int) -> torch.Tensor:
    """``blocks`` state pages as vLLM lays them out: each tensor's part, one after another."""
    generator = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(blocks):
        parts = [
            torch.randn(size, generator=generator).to(getattr(torch, dtype)).view(torch.uint8)
            for size, dtype in zip(shape.shapes, shape.dtypes, strict=True)
        ]
        rows.append(torch.cat([p.flatten() for p in parts]))
    return torch.stack(rows)


def _flip_exponent(pages: torch.Tensor, start: int, dtype: torch.dtype, index: int) -> None:
    """Flip the top exponent bit of value ``index`` of the part at byte ``start`` of page 0."""
    size = torch.empty(0, dtype=dtype).element_size()
    top_byte = start + (index + 1) * size - 1  # little-endian: the sign and top exponent bits
    pages[0, top_byte] ^= 0x40


@pytest.mark.parametrize("model", ["qwen3-next", "mamba2"])
def test_a_state_chunk_is_compared_part_by_part_each_in_its_own_dtype(model: str) -> None:
    shape = state_shape(_test_model_states()[model])
    parts = shape.parts()
    assert [d for _, _, d in parts] == list(shape.dtypes)
    assert sum(n for _, n, _ in parts) == shape.page_bytes
    compare = StateCompare(shape)
    computed = _pages(shape, 2)
    same = computed.clone()
    assert compare.errors(same, computed) == [0.0] * len(parts)
    assert compare.error([(same, computed)]) == 0.0
    for start, nbytes, dtype in parts:  # one flipped value, in each part alone
        kept = computed.clone()
        _flip_exponent(kept, start, getattr(torch, dtype), 7)
        errors = compare.errors(kept, computed)
        part = parts.index((start, nbytes, dtype))
        assert errors[part] > DEFAULT_MAX_ERROR
        assert [e for i, e in enumerate(errors) if i != part] == [0.0] * (len(parts) - 1)
        assert compare.error([(same, computed), (kept, computed)]) > DEFAULT_MAX_ERROR


def test_a_state_slightly_off_matches_and_one_with_a_part_lost_does_not() -> None:
    # qwen3-next's page mixes a bf16 conv state and an fp32 recurrent state
    shape = state_shape(_test_model_states()["qwen3-next"])
    (conv_start, conv_bytes, conv), (ssm_start, _, ssm) = shape.parts()
    assert (conv, ssm) == ("bfloat16", "float32")
    computed = _pages(shape, 1)
    kept = computed.clone()
    # a right state scaled up slightly: every value off by well under the bound, in both parts
    values = kept[0, ssm_start:].view(torch.float32)
    values.mul_(1.001)
    conv_values = kept[0, conv_start : conv_start + conv_bytes].view(torch.bfloat16)
    conv_values.mul_(1.01)
    assert max(StateCompare(shape).errors(kept, computed)) < DEFAULT_MAX_ERROR
    kept[0, conv_start : conv_start + conv_bytes] = 0  # the conv state lost
    conv_error, ssm_error = StateCompare(shape).errors(kept, computed)
    assert conv_error == pytest.approx(1.0)
    assert ssm_error < DEFAULT_MAX_ERROR


def test_a_state_that_is_not_finite_never_matches() -> None:
    shape = state_shape(_test_model_states()["mamba2"])
    computed = _pages(shape, 1)
    kept = computed.clone()
    start, _, _ = shape.parts()[1]
    kept[0, start : start + 4] = torch.tensor([float("nan")]).view(torch.uint8)
    assert StateCompare(shape).error([(kept, computed)]) == float("inf")
