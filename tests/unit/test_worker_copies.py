"""The worker's copy plan: one stacked view per pool and one copy per run of blocks must move the
same bytes as page-by-page copies, for any block ids (CPU tensors, no engine)."""

from __future__ import annotations

import random

import torch
from kvtier_vllm.worker import _pages, _runs, _stacked

LAYERS, BLOCKS, PAGE = 3, 40, 64


def cache() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Layers as vLLM hands them out: views of one buffer at one stride."""
    buffer = torch.randint(0, 255, (LAYERS, BLOCKS, 2, PAGE // 4), dtype=torch.int16)
    return buffer, [_pages(buffer[i]) for i in range(LAYERS)]


def test_runs_cover_every_block_once_in_order() -> None:
    assert _runs((4, 5, 6, 9, 10, 2)) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert _runs((7,)) == [(0, 7, 1)]


def test_runs_leave_out_the_null_block() -> None:
    # a sliding-window group's positions before the window are vLLM's null block, id 0
    assert _runs((0, 0, 0, 5, 6)) == [(3, 5, 2)]
    assert _runs((0, 1, 2, 0)) == [(1, 1, 2)]
    assert _runs((0,)) == []


def test_the_stacked_view_is_the_layers_pages() -> None:
    _buffer, pages = cache()
    stack = _stacked(pages)
    assert stack is not None
    for i, page in enumerate(pages):
        assert torch.equal(stack[i], page)
    assert _stacked([pages[0], pages[2]]) is not None  # any fixed stride
    assert _stacked([pages[1], pages[0]]) is None  # not increasing: no single view


def test_run_copies_equal_page_by_page_copies() -> None:
    rng = random.Random(7)
    _buffer, pages = cache()
    stack = _stacked(pages)
    assert stack is not None
    for _ in range(50):
        blocks = tuple(rng.sample(range(1, BLOCKS), rng.randint(1, 8)))
        if rng.random() < 0.5:
            start = rng.randrange(1, BLOCKS - len(blocks))
            blocks = tuple(range(start, start + len(blocks)))
        slot = torch.empty((LAYERS, len(blocks), pages[0].shape[1]), dtype=torch.uint8)
        for index, block, n in _runs(blocks):
            slot[:, index : index + n].copy_(stack[:, block : block + n])
        expected = torch.stack([p[list(blocks)] for p in pages])
        assert torch.equal(slot, expected)


def test_a_layer_reading_another_layers_cache_is_not_stored_twice() -> None:
    from kvtier_vllm.layout import KVGroup
    from kvtier_vllm.worker import own_caches

    buffer, _ = cache()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    # layer 3 shares layer 1's cache (cross-layer KV sharing); vLLM appends it to that group
    caches = {names[0]: buffer[0], names[1]: buffer[1], names[2]: buffer[2], names[3]: buffer[1]}
    groups = [KVGroup(0, (names[0], names[1], names[2], names[3]))]
    assert own_caches(groups, caches) == [KVGroup(0, tuple(names[:3]))]
    # the hybrid allocator's groups share buffers across groups, never within one: kept
    hybrid = [KVGroup(0, (names[0],), window=199), KVGroup(1, (names[3],))]
    caches[names[3]] = buffer[0]
    assert own_caches(hybrid, caches) == hybrid
