"""fp8 storage of KV below the arena (``lmdb.codec`` / ``object.codec``: fp8).

A coded payload holds every row of the raw one (a row: one token's one head of K or V,
``head_size`` elements, innermost in every page layout) as fp8 e4m3 bytes, then one float32
scale per row: the row's largest magnitude over e4m3's largest finite value (448), so each row
uses the format's whole range. Decoding multiplies back and rounds to the pool's dtype.

e4m3 keeps 3 mantissa bits: a value in the normal range is off by at most 2**-4 of itself,
and a subnormal one (under 2**-6 of the row's largest) by at most 2**-10 of the row's largest.
The norm of a row's error is thus at most about 2**-4 of the row's norm, plus the final
rounding to the pool's dtype: `ERROR_BOUND`, which verified reuse holds a coded pool to.
"""

from __future__ import annotations

from enum import StrEnum

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E4M3_MAX = 448.0
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
"""Every e4m3 byte's value: decoding by table is three times as fast as ml_dtypes' cast."""
_SCALE = np.dtype(np.float32)
_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}
ERROR_BOUND = 2.0**-4 + 2.0**-7
"""The largest relative error (norm of the difference over the norm of the original) that
coding and decoding one row can make, with the decoded dtype's own rounding (bf16's 2**-8)
and margin; per layer, the same bound holds."""


class Codec(StrEnum):
    """How a tier stores chunks: as they are, or KV rows in fp8 with a scale each."""

    NONE = "none"
    FP8 = "fp8"


def element_dtype(kv_dtype: str) -> np.dtype | None:
    """The numpy dtype of a pool's elements when fp8 can code it (bf16, fp16, fp32); None for
    anything else (a cache already in fp8, the hidden pool's own fp8, encoder outputs)."""
    return _DTYPES.get(kv_dtype.removeprefix("torch."))


def coded_length(payload_len: int, dtype: np.dtype, head_size: int) -> int | None:
    """The coded size of a ``payload_len``-byte payload, or None when it is not whole rows."""
    row = dtype.itemsize * head_size
    if head_size <= 0 or payload_len <= 0 or payload_len % row:
        return None
    rows = payload_len // row
    return rows * (head_size + _SCALE.itemsize)


def encode_into(
    payload: memoryview | bytes, dtype: np.dtype, head_size: int, out: memoryview
) -> int | None:
    """Code ``payload`` into the front of ``out``; returns the coded length, or None when a row
    holds a value fp8 cannot stand for (inf or NaN): such a chunk is stored as it is."""
    raw = np.frombuffer(payload, dtype).reshape(-1, head_size)
    rows = raw.shape[0]
    values = raw.astype(np.float32)
    amax = np.abs(values).max(axis=1)
    if not np.isfinite(amax).all():
        return None
    scales = amax / np.float32(_E4M3_MAX)
    scales[scales == 0] = 1.0  # an all-zero row codes as zeros under any scale
    values /= scales[:, None]
    coded = np.frombuffer(out, np.uint8, count=rows * head_size).reshape(rows, head_size)
    coded[...] = values.astype(E4M3).view(np.uint8)
    np.frombuffer(out, _SCALE, count=rows, offset=rows * head_size)[...] = scales
    return rows * (head_size + _SCALE.itemsize)


def decode_into(
    coded: memoryview | bytes, dtype: np.dtype, head_size: int, out: memoryview
) -> None:
    """The inverse of `encode_into`: ``out`` (exactly the raw size) receives the rows."""
    rows = len(out) // (dtype.itemsize * head_size)
    if len(coded) != rows * (head_size + _SCALE.itemsize) or len(out) % dtype.itemsize:
        raise ValueError(f"{len(coded)} coded bytes do not decode into {len(out)}")
    values = np.frombuffer(coded, np.uint8, count=rows * head_size).reshape(rows, head_size)
    scales = np.frombuffer(coded, _SCALE, count=rows, offset=rows * head_size)
    decoded = _E4M3_VALUES[values]
    decoded *= scales[:, None]
    np.frombuffer(out, dtype).reshape(rows, head_size)[...] = decoded
