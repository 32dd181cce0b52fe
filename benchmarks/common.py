"""Pieces every benchmark script uses: steady timing, buffers, keys and small namespaces."""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator

import numpy as np

from kvtier.core.keys import NamespaceSpec, PageLayout, Pool

KiB = 1 << 10
PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """No collector pause inside a timed region."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def filled(nbytes: int, seed: int = 0) -> np.ndarray:
    """A buffer of non-repeating bytes (no pattern for checksums or servers), faulted in."""
    words = np.arange(seed, seed + nbytes // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    return words.view(np.uint8)


def touched(nbytes: int) -> np.ndarray:
    """A destination buffer, already faulted in."""
    buf = np.empty(nbytes, np.uint8)
    buf.fill(1)
    return buf


def small_spec(model: str, chunk_bytes: int) -> NamespaceSpec:
    # one layer of 16 tokens x (64 + 64) x fp16 is 4 KiB per head
    layout = PageLayout(
        tokens_per_block=16,
        blocks_per_chunk=1,
        num_kv_heads=max(1, chunk_bytes // (4 * KiB)),
        head_sizes=(64, 64),
        layer_names=("model.layers.0.self_attn.attn",),
    )
    return NamespaceSpec(
        model=model, model_revision="r1", pool=Pool.TARGET, kv_dtype="float16", layout=layout
    )
