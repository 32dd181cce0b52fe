"""Buffers for timed copies (filled with bytes of no pattern, or only faulted in) and timing
without a collector pause."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

import numpy as np


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """No collector pause inside a timed region."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


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


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` took, without a collector pause."""
    with no_gc():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
