from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core import blockfmt
from kvtier.core.blockfmt import HEADER_SIZE, ChunkDescriptor
from kvtier.core.errors import (
    ChunkFormatError,
    CorruptChunkError,
    TruncatedChunkError,
    UnknownVersionError,
    WrongKeyError,
)
from kvtier.core.keys import ChunkKey, Pool, make_key

descriptors = st.builds(
    ChunkDescriptor,
    pool=st.sampled_from(list(Pool)),
    kv_dtype=st.sampled_from(["float16", "bfloat16", "fp8_e4m3", "uint8"]),
    tokens_per_block=st.integers(1, 1024),
    blocks_per_chunk=st.integers(1, 64),
    num_layers=st.integers(1, 128),
    num_kv_heads=st.integers(1, 64),
    head_size=st.integers(1, 512),
)
keys = st.builds(make_key, st.binary(min_size=16, max_size=16), st.binary(min_size=1, max_size=32))
payloads = st.binary(min_size=0, max_size=4096)


def _roundtrip(key: ChunkKey, desc: ChunkDescriptor, payload: bytes) -> bytes:
    value = blockfmt.encode(key, desc, payload)
    assert bytes(blockfmt.decode(value, key)) == payload
    return value


@given(keys, descriptors, payloads)
def test_roundtrip(key: ChunkKey, desc: ChunkDescriptor, payload: bytes) -> None:
    value = _roundtrip(key, desc, payload)
    header = blockfmt.decode_header(value, key)
    assert header.descriptor == desc
    assert header.payload_len == len(payload)
    dst = bytearray(len(payload))
    blockfmt.decode_into(value, key, memoryview(dst))
    assert bytes(dst) == payload
    in_place = blockfmt.verified_in_place(value, key, len(payload))
    assert in_place is not None
    assert bytes(in_place) == payload
    assert in_place.obj is value  # a view of the stored value, not a copy
    reused = bytearray(b"\xee" * (len(value) + 7))  # a scratch buffer larger than needed
    assert blockfmt.encode_into(reused, key, desc, payload) == len(value)
    assert bytes(reused[: len(value)]) == value


@given(keys, descriptors, payloads, st.data())
def test_no_truncation_decodes(
    key: ChunkKey, desc: ChunkDescriptor, payload: bytes, data: st.DataObject
) -> None:
    value = _roundtrip(key, desc, payload)
    cut = data.draw(st.integers(0, len(value) - 1))
    with pytest.raises(ChunkFormatError):
        blockfmt.decode(value[:cut], key)


@settings(max_examples=300)
@given(keys, descriptors, payloads, st.data())
def test_no_bit_flip_decodes(
    key: ChunkKey, desc: ChunkDescriptor, payload: bytes, data: st.DataObject
) -> None:
    value = bytearray(_roundtrip(key, desc, payload))
    bit = data.draw(st.integers(0, len(value) * 8 - 1))
    value[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(ChunkFormatError):
        blockfmt.decode(value, key)
    with pytest.raises(ChunkFormatError):
        blockfmt.decode_into(value, key, memoryview(bytearray(len(payload))))
    with pytest.raises(ChunkFormatError):
        blockfmt.verified_in_place(value, key, len(payload))


@given(keys, keys, descriptors, payloads)
def test_another_key_or_namespace_never_decodes(
    key: ChunkKey, other: ChunkKey, desc: ChunkDescriptor, payload: bytes
) -> None:
    value = _roundtrip(key, desc, payload)
    if other != key:
        with pytest.raises(WrongKeyError):
            blockfmt.decode(value, other)
    swapped_ns = ChunkKey(other[:16] + key[16:])
    if swapped_ns != key:
        with pytest.raises(WrongKeyError):
            blockfmt.decode(value, swapped_ns)


@given(keys, descriptors, payloads, payloads)
def test_payload_swapped_under_a_valid_header_never_decodes(
    key: ChunkKey, desc: ChunkDescriptor, payload: bytes, other: bytes
) -> None:
    value = _roundtrip(key, desc, payload)
    if other != payload:
        with pytest.raises(ChunkFormatError):
            blockfmt.decode(value[:HEADER_SIZE] + other, key)


def test_specific_errors() -> None:
    key = make_key(b"n" * 16, b"h" * 32)
    desc = ChunkDescriptor(Pool.TARGET, "float16", 16, 4, 2, 2, 32)
    value = bytearray(blockfmt.encode(key, desc, b"x" * 100))
    with pytest.raises(TruncatedChunkError):
        blockfmt.decode(value[:-1], key)
    with pytest.raises(TruncatedChunkError):
        blockfmt.decode(value[:10], key)
    with pytest.raises(CorruptChunkError, match="header says"):
        blockfmt.decode(value + b"!", key)
    with pytest.raises(CorruptChunkError, match="magic"):
        blockfmt.decode(b"JUNK" + value[4:], key)
    future = bytearray(value)
    struct.pack_into("<H", future, 4, blockfmt.CODED_VERSION + 1)
    with pytest.raises(UnknownVersionError):
        blockfmt.decode(future, key)
    with pytest.raises(WrongKeyError):
        blockfmt.decode(value, make_key(b"n" * 16, b"g" * 32))
    with pytest.raises(CorruptChunkError, match="does not fit"):
        blockfmt.decode_into(value, key, memoryview(bytearray(99)))
    with pytest.raises(ValueError, match="too long"):
        blockfmt.encode(key, ChunkDescriptor(Pool.TARGET, "x" * 17, 16, 4, 2, 2, 32), b"")


@given(keys, descriptors, payloads.filter(len), st.data())
def test_encode_into_refuses_a_payload_that_changed_since_its_checksum(
    key: ChunkKey, desc: ChunkDescriptor, payload: bytes, data: st.DataObject
) -> None:
    taken = blockfmt.payload_checksum(payload)
    out = bytearray(blockfmt.encoded_size(len(payload)))
    assert blockfmt.encode_into(out, key, desc, payload, expect_checksum=taken) == len(out)
    assert bytes(out) == blockfmt.encode(key, desc, payload)
    at = data.draw(st.integers(0, len(payload) - 1))
    changed = bytearray(payload)
    changed[at] ^= 1
    fresh = bytearray(len(out))
    with pytest.raises(CorruptChunkError, match="differs"):
        blockfmt.encode_into(fresh, key, desc, changed, expect_checksum=taken)
    assert not any(fresh[:HEADER_SIZE])  # no header vouches for the changed bytes
