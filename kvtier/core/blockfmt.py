"""The chunk format used for LMDB values and objects: a fixed header, then the payload.

Header (little-endian, ``HEADER_SIZE`` bytes)::

    magic "KVTC" | version u16 | header_len u16 | namespace 16s | hash_len u8 | pool u8 | pad 2
    chunk_hash 32s | kv_dtype 16s | tokens_per_block u32 | blocks u32 | layers u32
    kv_heads u32 | head_size u32 | payload_len u64 | payload xxh3-128 16s | header xxh3-64 u64

The payload is the pool's pages, layer after layer. Decoding verifies the header checksum, the key,
the length and the payload checksum, and raises a specific `ChunkFormatError` on any mismatch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier.core.errors import (
    CorruptChunkError,
    TruncatedChunkError,
    UnknownVersionError,
    WrongKeyError,
)
from kvtier.core.keys import (
    MAX_CHUNK_HASH_BYTES,
    MAX_KV_DTYPE_BYTES,
    NAMESPACE_BYTES,
    ChunkKey,
    NamespaceSpec,
    Pool,
    chunk_hash_of,
    namespace_of,
)

MAGIC = b"KVTC"
VERSION = 1
_BODY = struct.Struct(f"<4sHH{NAMESPACE_BYTES}sBB2x{MAX_CHUNK_HASH_BYTES}s16sIIIIIQ16s")
_TAIL = struct.Struct("<Q")
HEADER_SIZE = _BODY.size + _TAIL.size
_PIECE = 256 << 10  # copy-and-hash granule of decode_into; fits L2
_POOL_CODES = {Pool.TARGET: 0, Pool.DRAFT: 1, Pool.HIDDEN: 2, Pool.ENCODER: 3}
_POOLS_BY_CODE = {code: pool for pool, code in _POOL_CODES.items()}


@dataclass(frozen=True, slots=True)
class ChunkDescriptor:
    """What a header says about the payload besides its key; the same for a whole namespace."""

    pool: Pool
    kv_dtype: str
    tokens_per_block: int
    blocks_per_chunk: int
    num_layers: int
    num_kv_heads: int
    head_size: int

    @classmethod
    def from_spec(cls, spec: NamespaceSpec) -> ChunkDescriptor:
        layout = spec.layout
        return cls(
            pool=spec.pool,
            kv_dtype=spec.kv_dtype,
            tokens_per_block=layout.tokens_per_block,
            blocks_per_chunk=layout.blocks_per_chunk,
            num_layers=len(layout.layer_names),
            num_kv_heads=layout.num_kv_heads,
            head_size=layout.head_sizes[0],
        )


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    key: ChunkKey
    descriptor: ChunkDescriptor
    payload_len: int
    payload_checksum: bytes


def payload_checksum(payload: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def encoded_size(payload_len: int) -> int:
    return HEADER_SIZE + payload_len


def _pack_header(
    key: ChunkKey, descriptor: ChunkDescriptor, payload_len: int, checksum: bytes
) -> bytes:
    chunk_hash = chunk_hash_of(key)
    dtype = descriptor.kv_dtype.encode()
    if len(dtype) > MAX_KV_DTYPE_BYTES:  # NamespaceSpec refuses these at registration
        raise ValueError(f"kv_dtype name too long for the chunk header: {descriptor.kv_dtype!r}")
    body = _BODY.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        namespace_of(key),
        len(chunk_hash),
        _POOL_CODES[descriptor.pool],
        chunk_hash,
        dtype,
        descriptor.tokens_per_block,
        descriptor.blocks_per_chunk,
        descriptor.num_layers,
        descriptor.num_kv_heads,
        descriptor.head_size,
        payload_len,
        checksum,
    )
    return body + _TAIL.pack(xxhash.xxh3_64_intdigest(body))


def encode_header(
    key: ChunkKey, descriptor: ChunkDescriptor, payload: bytes | bytearray | memoryview
) -> bytes:
    """The header for ``payload``; callers write it and the payload back to back."""
    return _pack_header(key, descriptor, len(payload), payload_checksum(payload))


def encode(key: ChunkKey, descriptor: ChunkDescriptor, payload: bytes | memoryview) -> bytes:
    """Header and payload as one bytes object (tests and small values; hot paths use parts)."""
    return encode_header(key, descriptor, payload) + bytes(payload)


def encode_into(
    out: bytearray | memoryview,
    key: ChunkKey,
    descriptor: ChunkDescriptor,
    payload: bytes | bytearray | memoryview,
    *,
    expect_checksum: bytes | None = None,
) -> int:
    """Write the encoded chunk into ``out`` (a reusable buffer); returns the encoded length.

    The payload is copied in pieces and each copy hashed while it is in cache, so the payload is
    read from memory once. With ``expect_checksum`` (the payload's checksum taken earlier), bytes
    that changed since raise `CorruptChunkError` and no header is written: the checksum is of
    the copy, so what would be stored is exactly what was checked.
    """
    view = memoryview(out)
    src = memoryview(payload)
    total = HEADER_SIZE + len(src)
    digest = xxhash.xxh3_128()
    for start in range(0, len(src), _PIECE):
        piece = view[HEADER_SIZE + start : HEADER_SIZE + min(start + _PIECE, len(src))]
        piece[:] = src[start : start + _PIECE]
        digest.update(piece)
    checksum = digest.digest()
    if expect_checksum is not None and checksum != expect_checksum:
        raise CorruptChunkError("payload checksum differs from the one expected")
    view[:HEADER_SIZE] = _pack_header(key, descriptor, len(src), checksum)
    return total


def _header_fields(value: bytes | bytearray | memoryview) -> tuple[Any, ...]:
    """The header's fields, after checking magic, version, length and the header checksum."""
    if len(value) < len(MAGIC) + 2:
        raise TruncatedChunkError(f"value of {len(value)} bytes has no header")
    if bytes(value[: len(MAGIC)]) != MAGIC:
        raise CorruptChunkError("bad magic")
    (version,) = struct.unpack_from("<H", value, len(MAGIC))
    if version != VERSION:
        raise UnknownVersionError(f"chunk format version {version}, this build reads {VERSION}")
    if len(value) < HEADER_SIZE:
        raise TruncatedChunkError(f"value of {len(value)} bytes, header needs {HEADER_SIZE}")
    fields = _BODY.unpack_from(value, 0)
    (stored_header_sum,) = _TAIL.unpack_from(value, _BODY.size)
    if xxhash.xxh3_64_intdigest(value[: _BODY.size]) != stored_header_sum:
        raise CorruptChunkError("header checksum mismatch")
    header_len, hash_len, pool_code = fields[2], fields[4], fields[5]
    if header_len != HEADER_SIZE or pool_code not in _POOLS_BY_CODE:
        raise CorruptChunkError("header fields out of range")
    if not 0 < hash_len <= MAX_CHUNK_HASH_BYTES:
        raise CorruptChunkError("chunk hash length out of range")
    return fields


def decode_header(value: bytes | bytearray | memoryview, expect_key: ChunkKey) -> ChunkHeader:
    """Verify everything but the payload checksum; returns the parsed header."""
    (
        _magic,
        _version,
        _header_len,
        namespace,
        hash_len,
        pool_code,
        chunk_hash,
        dtype,
        tokens_per_block,
        blocks,
        layers,
        kv_heads,
        head_size,
        payload_len,
        checksum,
    ) = _header_fields(value)
    stored_key = ChunkKey(namespace + chunk_hash[:hash_len])
    if stored_key != expect_key:
        raise WrongKeyError("value belongs to another namespace or chunk hash")
    total = HEADER_SIZE + payload_len
    if len(value) < total:
        raise TruncatedChunkError(f"value of {len(value)} bytes, header says {total}")
    if len(value) > total:
        raise CorruptChunkError(f"value of {len(value)} bytes, header says {total}")
    descriptor = ChunkDescriptor(
        pool=_POOLS_BY_CODE[pool_code],
        kv_dtype=dtype.rstrip(b"\0").decode("ascii", errors="replace"),
        tokens_per_block=tokens_per_block,
        blocks_per_chunk=blocks,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_size=head_size,
    )
    return ChunkHeader(stored_key, descriptor, payload_len, checksum)


@dataclass(frozen=True, slots=True)
class PeekedHeader:
    key: ChunkKey
    encoded_len: int
    """Header and payload: where the next chunk of a pack starts."""
    pool: Pool


def peek_header(value: bytes | bytearray | memoryview) -> PeekedHeader:
    """Key, encoded length and pool of the chunk that starts ``value`` (which may run on into
    more chunks, or be only the header), after checking the header's own checksum; the payload
    is not verified."""
    fields = _header_fields(value)
    namespace, hash_len, pool_code = fields[3], fields[4], fields[5]
    chunk_hash, payload_len = fields[6], fields[13]
    return PeekedHeader(
        ChunkKey(namespace + chunk_hash[:hash_len]),
        HEADER_SIZE + payload_len,
        _POOLS_BY_CODE[pool_code],
    )


def copy_verified(value: bytes | bytearray | memoryview, key: ChunkKey, dst: memoryview) -> None:
    """Copy a whole encoded chunk (header and payload) into ``dst``, verifying it on the way;
    ``dst`` must be exactly its size. On a mismatch ``dst`` holds garbage."""
    if len(dst) != len(value):
        raise CorruptChunkError(f"value of {len(value)} bytes, destination of {len(dst)}")
    decode_into(value, key, dst[HEADER_SIZE:])
    dst[:HEADER_SIZE] = value[:HEADER_SIZE]


def split(value: bytes | bytearray | memoryview) -> list[tuple[ChunkKey, memoryview]]:
    """Verify a run of encoded chunks written back to back (an object pack) and return each
    key with a view of its payload. Any flaw anywhere raises `ChunkFormatError`."""
    view = memoryview(value)
    out: list[tuple[ChunkKey, memoryview]] = []
    offset = 0
    while offset < len(view):
        head = peek_header(view[offset:])
        out.append((head.key, decode(view[offset : offset + head.encoded_len], head.key)))
        offset += head.encoded_len
    return out


def decode(value: bytes | bytearray | memoryview, expect_key: ChunkKey) -> memoryview:
    """Verify ``value`` fully and return a view of its payload."""
    header = decode_header(value, expect_key)
    payload = memoryview(value)[HEADER_SIZE:]
    if payload_checksum(payload) != header.payload_checksum:
        raise CorruptChunkError("payload checksum mismatch")
    return payload


def decode_into(
    value: bytes | bytearray | memoryview, expect_key: ChunkKey, dst: memoryview
) -> ChunkHeader:
    """Verify ``value`` and copy its payload into ``dst``, which must be exactly its size.

    The payload is copied in pieces and each piece hashed right after, while it is in cache; on
    a mismatch ``dst`` holds garbage and the caller must not publish it.
    """
    header = decode_header(value, expect_key)
    if len(dst) != header.payload_len:
        raise CorruptChunkError(
            f"payload of {header.payload_len} bytes does not fit a {len(dst)}-byte slot"
        )
    src = memoryview(value)[HEADER_SIZE:]
    digest = xxhash.xxh3_128()
    for start in range(0, header.payload_len, _PIECE):
        piece = dst[start : start + _PIECE]
        piece[:] = src[start : start + _PIECE]
        digest.update(piece)  # while the piece is still in L2
    if digest.digest() != header.payload_checksum:
        raise CorruptChunkError("payload checksum mismatch")
    return header
