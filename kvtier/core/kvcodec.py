"""Narrower storage of KV below the arena (``lmdb.codec`` / ``object.codec``).

A coded payload holds every row of the raw one (a row: one token's one head of K or V,
``head_size`` elements, innermost in every page layout) as one byte per element, then one
float32 scale per row. Decoding multiplies back and rounds to the pool's dtype.

- ``fp8``: e4m3, the scale the row's largest magnitude over e4m3's largest finite value (448).
  3 mantissa bits: each element is off by at most 2**-4 of itself (a subnormal one by at most
  2**-10 of the row's largest), so a row's error is at most about 2**-4 of its norm.
- ``int8``: integers in [-127, 127], the scale the row's largest magnitude over 127. Each
  element is off by at most half a step, 1/254 of the row's largest, so a row's error is at most
  sqrt(head_size) / 254 of its norm (0.031 for heads of 64) and, for rows whose magnitudes are
  spread as KV's are, several times less than fp8's.

`error_bound` adds the final rounding to the pool's dtype (at most 2**-8 for bf16) with margin:
what verified reuse holds a coded pool to.
"""

from __future__ import annotations

import math
from enum import StrEnum

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E4M3_MAX = 448.0
_INT8_MAX = 127.0
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
"""Every e4m3 byte's value: decoding by table is three times as fast as ml_dtypes' cast."""
_SCALE = np.dtype(np.float32)
_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}
_ROUNDING = 2.0**-7
"""The decoded dtype's own rounding (2**-8 for bf16), with as much again as margin."""


class Codec(StrEnum):
    """How a tier stores chunks: as they are, or KV rows one byte an element, a scale a row."""

    NONE = "none"
    FP8 = "fp8"
    INT8 = "int8"


def error_bound(codec: Codec, head_size: int) -> float:
    """The largest relative error (norm of the difference over the norm of the original) that
    coding and decoding one row of ``head_size`` elements can make; per layer, the same."""
    if codec is Codec.FP8:
        return 2.0**-4 + _ROUNDING
    if codec is Codec.INT8:
        return math.sqrt(head_size) / (2 * _INT8_MAX) + _ROUNDING
    return 0.0


def element_dtype(kv_dtype: str) -> np.dtype | None:
    """The numpy dtype of a pool's elements when a codec can code it (bf16, fp16, fp32); None
    for anything else (a cache already in fp8, the hidden pool's own fp8, encoder outputs)."""
    return _DTYPES.get(kv_dtype.removeprefix("torch."))


def coded_length(payload_len: int, dtype: np.dtype, head_size: int) -> int | None:
    """The coded size of a ``payload_len``-byte payload, or None when it is not whole rows."""
    row = dtype.itemsize * head_size
    if head_size <= 0 or payload_len <= 0 or payload_len % row:
        return None
    return payload_len // row * (head_size + _SCALE.itemsize)


def encode_into(
    codec: Codec, payload: memoryview | bytes, dtype: np.dtype, head_size: int, out: memoryview
) -> int | None:
    """Code ``payload`` into the front of ``out``; returns the coded length, or None when a row
    holds a value no code stands for (inf or NaN): such a chunk is not stored coded."""
    raw = np.frombuffer(payload, dtype).reshape(-1, head_size)
    rows = raw.shape[0]
    values = raw.astype(np.float32)
    amax = np.abs(values).max(axis=1)
    if not np.isfinite(amax).all():
        return None
    scales = amax / np.float32(_E4M3_MAX if codec is Codec.FP8 else _INT8_MAX)
    scales[scales == 0] = 1.0  # an all-zero row codes as zeros under any scale
    values /= scales[:, None]
    coded = np.frombuffer(out, np.uint8, count=rows * head_size).reshape(rows, head_size)
    if codec is Codec.FP8:
        coded[...] = values.astype(E4M3).view(np.uint8)
    else:
        np.rint(values, out=values)
        coded[...] = values.astype(np.int8).view(np.uint8)
    np.frombuffer(out, _SCALE, count=rows, offset=rows * head_size)[...] = scales
    return rows * (head_size + _SCALE.itemsize)


def decode_into(
    codec: Codec, coded: memoryview | bytes, dtype: np.dtype, head_size: int, out: memoryview
) -> None:
    """The inverse of `encode_into`: ``out`` (exactly the raw size) receives the rows."""
    rows = len(out) // (dtype.itemsize * head_size)
    if len(coded) != rows * (head_size + _SCALE.itemsize) or len(out) % dtype.itemsize:
        raise ValueError(f"{len(coded)} coded bytes do not decode into {len(out)}")
    scales = np.frombuffer(coded, _SCALE, count=rows, offset=rows * head_size)
    if codec is Codec.FP8:
        values = np.frombuffer(coded, np.uint8, count=rows * head_size)
        decoded = _E4M3_VALUES[values].reshape(rows, head_size)
    else:
        values = np.frombuffer(coded, np.int8, count=rows * head_size)
        decoded = values.astype(np.float32).reshape(rows, head_size)
    decoded *= scales[:, None]
    np.frombuffer(out, dtype).reshape(rows, head_size)[...] = decoded
