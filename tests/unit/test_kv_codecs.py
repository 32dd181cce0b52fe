"""The lower tiers' codecs (int8, fp8): every row within the stated bound of what was coded, a
chunk that cannot be coded refused rather than stored wrong, coded chunks verified like any
other, and the pools the codecs do not apply to stored exactly."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core import blockfmt, kvcodec
from kvtier.core.blockfmt import HEADER_SIZE, ChunkDescriptor
from kvtier.core.errors import CorruptChunkError
from kvtier.core.keys import Pool, make_key
from kvtier.core.kvcodec import Codec, error_bound

KEY = make_key(b"n" * 16, b"chunk")
HEAD = 16
CODECS = [Codec.FP8, Codec.INT8]


def _descriptor(dtype: str = "bfloat16", pool: Pool = Pool.TARGET) -> ChunkDescriptor:
    return ChunkDescriptor(pool, dtype, 16, 2, 2, 2, HEAD)


def _rows(dtype: str, rows: int, seed: int, spread: float, spikes: bool = False) -> bytes:
    """``rows`` rows whose magnitudes span ``spread`` orders, a row of zeros among them; with
    ``spikes``, each row one element far above the rest (an outlier channel: int8's worst)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, HEAD)) * 10.0 ** rng.uniform(-spread, spread, (rows, 1))
    if spikes:
        values[:, 3] *= 30.0
    values[rows // 2] = 0.0
    values = np.clip(values, -60000.0, 60000.0)  # within fp16's range
    out = values.astype(np.float32).astype(kvcodec.element_dtype(dtype))
    return out.tobytes()


def _errors(dtype: str, raw: bytes, decoded: bytes) -> np.ndarray:
    np_dtype = kvcodec.element_dtype(dtype)
    a = np.frombuffer(raw, np_dtype).astype(np.float64).reshape(-1, HEAD)
    b = np.frombuffer(decoded, np_dtype).astype(np.float64).reshape(-1, HEAD)
    norms = np.linalg.norm(a, axis=1)
    diffs = np.linalg.norm(a - b, axis=1)
    return np.where(norms > 0, diffs / np.where(norms > 0, norms, 1), diffs)


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(CODECS),
    st.sampled_from(["bfloat16", "float16", "float32", "torch.bfloat16"]),
    st.integers(1, 64),
    st.integers(0, 2**31),
    st.floats(0, 3),
    st.booleans(),
)
def test_every_row_decodes_within_the_bound(
    codec: Codec, dtype: str, rows: int, seed: int, spread: float, spikes: bool
) -> None:
    raw = _rows(dtype, rows, seed, spread, spikes)
    coded = bytearray(rows * (HEAD + 4))
    np_dtype = kvcodec.element_dtype(dtype)
    assert np_dtype is not None
    assert kvcodec.coded_length(len(raw), np_dtype, HEAD) == len(coded)
    assert kvcodec.encode_into(codec, raw, np_dtype, HEAD, memoryview(coded)) == len(coded)
    decoded = bytearray(len(raw))
    kvcodec.decode_into(codec, coded, np_dtype, HEAD, memoryview(decoded))
    errors = _errors(dtype, raw, bytes(decoded))
    assert errors.max() <= error_bound(codec, HEAD)
    assert errors[rows // 2] == 0.0  # zeros stay zeros


@pytest.mark.parametrize(
    ("codec", "low", "high"),
    [
        # 3 mantissa bits: about 2**-4 / sqrt(3) of a row at the bottom of a binade, less above
        (Codec.FP8, 0.01, 0.04),
        # half a step of 1/127 of the row's largest: for gaussian rows about 2.3 sigma / 440
        (Codec.INT8, 0.002, 0.01),
    ],
)
def test_the_typical_error_is_what_the_rounding_makes(
    codec: Codec, low: float, high: float
) -> None:
    raw = _rows("bfloat16", 4096, 7, 1.0)
    value = bytearray(_descriptor().stored_size(len(raw), codec))
    blockfmt.encode_into(value, KEY, _descriptor(), raw, codec=codec)
    errors = _errors("bfloat16", raw, bytes(blockfmt.decode(value, KEY)))
    typical = float(np.median(errors[errors > 0]))
    assert low < typical < high, typical
    assert len(value) - HEADER_SIZE == 4096 * (HEAD + 4)  # bf16 rows of 2 * HEAD bytes


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_value_no_code_stands_for_is_refused_not_stored_wrong(codec: Codec, bad: float) -> None:
    values = np.ones((4, HEAD), np.float32)
    values[2, 3] = bad
    out = bytearray(4 * (HEAD + 4) + HEADER_SIZE)
    raw = values.tobytes()
    desc = _descriptor("float32")
    assert kvcodec.encode_into(codec, raw, np.dtype(np.float32), HEAD, memoryview(out)) is None
    assert blockfmt.encode_into(out, KEY, desc, raw, codec=codec) is None


def _coded_value() -> tuple[bytes, bytes]:
    raw = _rows("bfloat16", 64, 1, 1.0)
    desc = _descriptor()
    value = bytearray(desc.stored_size(len(raw), Codec.FP8))
    assert blockfmt.encode_into(value, KEY, desc, raw, codec=Codec.FP8) == len(value)
    return raw, bytes(value)


def test_a_coded_chunk_is_version_2_and_decodes_into_a_slot_of_the_raw_size() -> None:
    raw, value = _coded_value()
    header = blockfmt.decode_header(value, KEY)
    assert struct.unpack_from("<H", value, 4)[0] == blockfmt.CODED_VERSION
    assert header.codec is Codec.FP8
    assert header.raw_len == len(raw)
    assert blockfmt.peek_header(value).codec is Codec.FP8
    assert blockfmt.verified_in_place(value, KEY, len(raw)) is None  # decoded into a buffer
    slot = bytearray(len(raw))
    blockfmt.decode_into(value, KEY, memoryview(slot))
    assert _errors("bfloat16", raw, bytes(slot)).max() <= error_bound(Codec.FP8, HEAD)
    with pytest.raises(CorruptChunkError, match="does not fit"):
        blockfmt.decode_into(value, KEY, memoryview(bytearray(len(value) - HEADER_SIZE)))


def test_a_flipped_byte_of_a_coded_payload_is_caught_before_decoding() -> None:
    raw, value = _coded_value()
    for where in (HEADER_SIZE + 5, len(value) - 2):  # an fp8 value, a scale
        bad = bytearray(value)
        bad[where] ^= 0x10
        with pytest.raises(CorruptChunkError, match="payload checksum"):
            blockfmt.decode_into(bad, KEY, memoryview(bytearray(len(raw))))
        with pytest.raises(CorruptChunkError):
            blockfmt.copy_verified(bad, KEY, memoryview(bytearray(len(bad))))


def test_a_codec_on_a_version_1_header_is_refused() -> None:
    value = bytearray(blockfmt.encode(KEY, _descriptor(), b"\0" * 64))
    value[HEADER_SIZE - 8 - 16 - 8 - 20 - 16 - 32 - 2] = 1  # the codec byte, header resealed
    body = blockfmt._BODY.size
    struct.pack_into("<Q", value, body, xxhash.xxh3_64_intdigest(bytes(value[:body])))
    with pytest.raises(CorruptChunkError, match="codec"):
        blockfmt.decode(value, KEY)


def test_copy_verified_keeps_a_coded_chunk_as_it_is() -> None:
    _, value = _coded_value()
    out = bytearray(len(value))
    blockfmt.copy_verified(value, KEY, memoryview(out))
    assert bytes(out) == value


def test_recode_stores_a_chunk_again_in_either_direction() -> None:
    raw, coded = _coded_value()
    plain = blockfmt.recode(coded, KEY, Codec.NONE)
    assert plain is not None
    assert blockfmt.peek_header(plain).codec is Codec.NONE
    decoded = bytes(blockfmt.decode(plain, KEY))
    assert len(decoded) == len(raw)
    assert blockfmt.recode(coded, KEY, Codec.FP8) == coded  # already so: as it is
    again = blockfmt.recode(plain, KEY, Codec.FP8)
    assert again is not None
    assert blockfmt.peek_header(again).codec is Codec.FP8
    again_errors = _errors("bfloat16", decoded, bytes(blockfmt.decode(again, KEY)))
    assert again_errors.max() <= error_bound(Codec.FP8, HEAD)
    as_int8 = blockfmt.recode(coded, KEY, Codec.INT8)  # fp8 to int8, through the raw rows
    assert as_int8 is not None
    assert blockfmt.peek_header(as_int8).codec is Codec.INT8


@pytest.mark.parametrize(
    ("dtype", "pool"),
    [
        ("fp8_e4m3", Pool.TARGET),  # the cache is fp8 already
        ("e4m3:bfloat16", Pool.HIDDEN),  # the hidden pool's own fp8
        ("bfloat16", Pool.ENCODER),  # encoder outputs: not KV
        ("bfloat16", Pool.HIDDEN),
    ],
)
@pytest.mark.parametrize("codec", CODECS)
def test_pools_the_codecs_do_not_apply_to_are_stored_exactly(
    dtype: str, pool: Pool, codec: Codec
) -> None:
    desc = _descriptor(dtype, pool)
    payload = bytes(range(256)) * 4
    assert desc.codec_for(len(payload), codec) is Codec.NONE
    out = bytearray(desc.stored_size(len(payload), codec))
    assert blockfmt.encode_into(out, KEY, desc, payload, codec=codec) == len(out)
    assert bytes(blockfmt.decode(out, KEY)) == payload
    assert struct.unpack_from("<H", out, 4)[0] == blockfmt.VERSION


def test_a_payload_of_partial_rows_is_stored_exactly() -> None:
    desc = _descriptor()
    assert desc.codec_for(HEAD * 2 * 3 + 2, Codec.FP8) is Codec.NONE


def test_an_expected_checksum_is_checked_before_coding() -> None:
    raw = _rows("bfloat16", 8, 3, 0.5)
    out = bytearray(HEADER_SIZE + len(raw))
    with pytest.raises(CorruptChunkError):
        blockfmt.encode_into(
            out, KEY, _descriptor(), raw, codec=Codec.FP8, expect_checksum=b"\0" * 16
        )
    checksum = blockfmt.payload_checksum(raw)
    assert blockfmt.encode_into(
        out, KEY, _descriptor(), raw, codec=Codec.FP8, expect_checksum=checksum
    )
