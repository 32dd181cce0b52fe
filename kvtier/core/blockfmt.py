"""The chunk format used for LMDB values and objects: a fixed header, then the payload.

Header (little-endian, ``HEADER_SIZE`` bytes)::

    magic "KVTC" | version u16 | header_len u16 | namespace 16s | hash_len u8 | pool u8
    codec u8 | pad 1 | chunk_hash 32s | kv_dtype 16s | tokens_per_block u32 | blocks u32
    layers u32 | kv_heads u32 | head_size u32 | payload_len u64 | payload xxh3-128 16s
    header xxh3-64 u64

The payload is the pool's pages, layer after layer, or with ``codec`` 1 (fp8) or 2 (int8)
those pages coded (`kvtier.core.kvcodec`); the lengths and the checksum are the stored
payload's. A coded chunk is version 2, so that a build which reads only version 1 leaves it
alone instead of misreading it.
Decoding verifies the header checksum, the key, the length and the payload checksum, and raises
a specific `ChunkFormatError` on any mismatch; a coded payload is decoded after its checksum.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier.core import kvcodec
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
from kvtier.core.kvcodec import Codec

MAGIC = b"KVTC"
VERSION = 1
CODED_VERSION = 2
_VERSIONS = (VERSION, CODED_VERSION)
_BODY = struct.Struct(f"<4sHH{NAMESPACE_BYTES}sBBBx{MAX_CHUNK_HASH_BYTES}s16sIIIIIQ16s")
_TAIL = struct.Struct("<Q")
HEADER_SIZE = _BODY.size + _TAIL.size
_PIECE = 256 << 10  # copy-and-hash granule of decode_into; fits L2
_POOL_CODES = {Pool.TARGET: 0, Pool.DRAFT: 1, Pool.HIDDEN: 2, Pool.ENCODER: 3, Pool.STATE: 4}
_POOLS_BY_CODE = {code: pool for pool, code in _POOL_CODES.items()}
_CODEC_CODES = {Codec.NONE: 0, Codec.FP8: 1, Codec.INT8: 2}
_CODECS_BY_CODE = {code: codec for codec, code in _CODEC_CODES.items()}
_CODED_POOLS = (Pool.TARGET, Pool.DRAFT)


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

    def codec_for(self, payload_len: int, codec: Codec) -> Codec:
        """The codec a ``payload_len``-byte payload of this namespace is stored with, where a
        tier asks for ``codec``: codecs code the target's and the draft's KV in bf16, fp16 or
        fp32 only; anything else is stored as it is."""
        if codec is Codec.NONE or self.pool not in _CODED_POOLS:
            return Codec.NONE
        dtype = kvcodec.element_dtype(self.kv_dtype)
        if dtype is None or kvcodec.coded_length(payload_len, dtype, self.head_size) is None:
            return Codec.NONE
        return codec

    def stored_size(self, payload_len: int, codec: Codec) -> int:
        """Header and stored payload of a ``payload_len``-byte chunk in a ``codec`` tier."""
        if self.codec_for(payload_len, codec) is Codec.NONE:
            return HEADER_SIZE + payload_len
        dtype = kvcodec.element_dtype(self.kv_dtype)
        assert dtype is not None
        coded = kvcodec.coded_length(payload_len, dtype, self.head_size)
        assert coded is not None
        return HEADER_SIZE + coded

    def raw_length(self, stored_len: int, codec: Codec) -> int:
        """The payload's own length, from its stored length."""
        if codec is Codec.NONE:
            return stored_len
        dtype = kvcodec.element_dtype(self.kv_dtype)
        if dtype is None:
            raise CorruptChunkError(f"a {codec}-coded chunk of {self.kv_dtype!r}")
        rows, rest = divmod(stored_len, self.head_size + 4)
        if rest:
            raise CorruptChunkError(f"{stored_len} coded bytes are not whole rows")
        return rows * self.head_size * dtype.itemsize


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    key: ChunkKey
    descriptor: ChunkDescriptor
    payload_len: int
    """The stored payload's length (coded, where ``codec`` codes it)."""
    payload_checksum: bytes
    codec: Codec = Codec.NONE

    @property
    def raw_len(self) -> int:
        return self.descriptor.raw_length(self.payload_len, self.codec)


def payload_checksum(payload: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def encoded_size(payload_len: int) -> int:
    """The encoded size of a chunk stored as it is."""
    return HEADER_SIZE + payload_len


def _pack_header(
    key: ChunkKey,
    descriptor: ChunkDescriptor,
    payload_len: int,
    checksum: bytes,
    codec: Codec = Codec.NONE,
) -> bytes:
    chunk_hash = chunk_hash_of(key)
    dtype = descriptor.kv_dtype.encode()
    if len(dtype) > MAX_KV_DTYPE_BYTES:  # NamespaceSpec refuses these at registration
        raise ValueError(f"kv_dtype name too long for the chunk header: {descriptor.kv_dtype!r}")
    body = _BODY.pack(
        MAGIC,
        VERSION if codec is Codec.NONE else CODED_VERSION,
        HEADER_SIZE,
        namespace_of(key),
        len(chunk_hash),
        _POOL_CODES[descriptor.pool],
        _CODEC_CODES[codec],
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


def _copy_hashed(src: memoryview, dst: memoryview) -> bytes:
    """Copy ``src`` into ``dst`` (the same length) in pieces, each hashed while it is in cache,
    so the bytes are read from memory once; returns the checksum of the copy."""
    digest = xxhash.xxh3_128()
    for start in range(0, len(src), _PIECE):
        piece = dst[start : start + _PIECE]
        piece[:] = src[start : start + _PIECE]
        digest.update(piece)
    return digest.digest()


def encode_into(
    out: bytearray | memoryview,
    key: ChunkKey,
    descriptor: ChunkDescriptor,
    payload: bytes | bytearray | memoryview,
    *,
    expect_checksum: bytes | None = None,
    codec: Codec = Codec.NONE,
) -> int | None:
    """Write the encoded chunk into ``out`` (a reusable buffer); returns the encoded length.

    With ``expect_checksum`` (the payload's checksum taken earlier), bytes that changed since
    raise `CorruptChunkError` and no header is written: the checksum is of the copy, so what
    would be stored is exactly what was checked. With a ``codec`` where the namespace can be coded
    (`ChunkDescriptor.codec_for`), the payload is stored coded; None when a value in it cannot
    be coded (inf, NaN): such a chunk is not stored in that tier.
    """
    view = memoryview(out)
    src = memoryview(payload)
    codec = descriptor.codec_for(len(src), codec)
    if codec is Codec.NONE:
        checksum = _copy_hashed(src, view[HEADER_SIZE : HEADER_SIZE + len(src)])
        stored = len(src)
    else:
        if expect_checksum is not None and payload_checksum(src) != expect_checksum:
            raise CorruptChunkError("payload checksum differs from the one expected")
        expect_checksum = None
        dtype = kvcodec.element_dtype(descriptor.kv_dtype)
        assert dtype is not None
        coded = kvcodec.encode_into(codec, src, dtype, descriptor.head_size, view[HEADER_SIZE:])
        if coded is None:
            return None
        stored = coded
        checksum = payload_checksum(view[HEADER_SIZE : HEADER_SIZE + stored])
    if expect_checksum is not None and checksum != expect_checksum:
        raise CorruptChunkError("payload checksum differs from the one expected")
    view[:HEADER_SIZE] = _pack_header(key, descriptor, stored, checksum, codec)
    return HEADER_SIZE + stored


def _header_fields(value: bytes | bytearray | memoryview) -> tuple[Any, ...]:
    """The header's fields, after checking magic, version, length and the header checksum."""
    if len(value) < len(MAGIC) + 2:
        raise TruncatedChunkError(f"value of {len(value)} bytes has no header")
    if bytes(value[: len(MAGIC)]) != MAGIC:
        raise CorruptChunkError("bad magic")
    (version,) = struct.unpack_from("<H", value, len(MAGIC))
    if version not in _VERSIONS:
        raise UnknownVersionError(
            f"chunk format version {version}, this build reads {VERSION} and {CODED_VERSION}"
        )
    if len(value) < HEADER_SIZE:
        raise TruncatedChunkError(f"value of {len(value)} bytes, header needs {HEADER_SIZE}")
    fields = _BODY.unpack_from(value, 0)
    (stored_header_sum,) = _TAIL.unpack_from(value, _BODY.size)
    if xxhash.xxh3_64_intdigest(value[: _BODY.size]) != stored_header_sum:
        raise CorruptChunkError("header checksum mismatch")
    header_len, hash_len, pool_code, codec_code = fields[2], fields[4], fields[5], fields[6]
    if header_len != HEADER_SIZE or pool_code not in _POOLS_BY_CODE:
        raise CorruptChunkError("header fields out of range")
    if codec_code not in _CODECS_BY_CODE or (codec_code != 0) != (version == CODED_VERSION):
        raise CorruptChunkError("codec out of range for the format version")
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
        codec_code,
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
    return ChunkHeader(stored_key, descriptor, payload_len, checksum, _CODECS_BY_CODE[codec_code])


@dataclass(frozen=True, slots=True)
class PeekedHeader:
    key: ChunkKey
    encoded_len: int
    """Header and payload: where the next chunk of a pack starts."""
    pool: Pool
    codec: Codec = Codec.NONE


def peek_header(value: bytes | bytearray | memoryview) -> PeekedHeader:
    """Key, encoded length, pool and codec of the chunk that starts ``value`` (which may run on
    into more chunks, or be only the header), after checking the header's own checksum; the
    payload is not verified."""
    fields = _header_fields(value)
    namespace, hash_len, pool_code, codec_code = fields[3], fields[4], fields[5], fields[6]
    chunk_hash, payload_len = fields[7], fields[14]
    return PeekedHeader(
        ChunkKey(namespace + chunk_hash[:hash_len]),
        HEADER_SIZE + payload_len,
        _POOLS_BY_CODE[pool_code],
        _CODECS_BY_CODE[codec_code],
    )


def copy_verified(value: bytes | bytearray | memoryview, key: ChunkKey, dst: memoryview) -> None:
    """Copy a whole encoded chunk (header and payload, coded or not, as it is) into ``dst``,
    verifying it on the way; ``dst`` must be exactly its size. On a mismatch ``dst`` holds
    garbage."""
    if len(dst) != len(value):
        raise CorruptChunkError(f"value of {len(value)} bytes, destination of {len(dst)}")
    header = decode_header(value, key)
    if _copy_hashed(memoryview(value)[HEADER_SIZE:], dst[HEADER_SIZE:]) != header.payload_checksum:
        raise CorruptChunkError("payload checksum mismatch")
    dst[:HEADER_SIZE] = value[:HEADER_SIZE]


def recode(value: bytes | bytearray | memoryview, key: ChunkKey, codec: Codec) -> bytes | None:
    """A verified chunk stored again for a ``codec`` tier: as it is where its codec is already
    the one the namespace takes there; None where the payload cannot be coded."""
    header = decode_header(value, key)
    if header.descriptor.codec_for(header.raw_len, codec) is header.codec:
        if payload_checksum(memoryview(value)[HEADER_SIZE:]) != header.payload_checksum:
            raise CorruptChunkError("payload checksum mismatch")
        return bytes(value)
    payload = decode(value, key)
    out = bytearray(header.descriptor.stored_size(len(payload), codec))
    if encode_into(out, key, header.descriptor, payload, codec=codec) is None:
        return None
    return bytes(out)


def split(value: bytes | bytearray | memoryview) -> list[tuple[ChunkKey, memoryview, int]]:
    """Verify a run of encoded chunks written back to back (an object pack) and return each
    key with its (decoded) payload and its encoded length. Any flaw anywhere raises
    `ChunkFormatError`."""
    view = memoryview(value)
    out: list[tuple[ChunkKey, memoryview, int]] = []
    offset = 0
    while offset < len(view):
        head = peek_header(view[offset:])
        stored = view[offset : offset + head.encoded_len]
        out.append((head.key, decode(stored, head.key), head.encoded_len))
        offset += head.encoded_len
    return out


def decode(value: bytes | bytearray | memoryview, expect_key: ChunkKey) -> memoryview:
    """Verify ``value`` fully and return its payload: a view of it, or, coded, a decoded copy."""
    header = decode_header(value, expect_key)
    payload = memoryview(value)[HEADER_SIZE:]
    if payload_checksum(payload) != header.payload_checksum:
        raise CorruptChunkError("payload checksum mismatch")
    if header.codec is Codec.NONE:
        return payload
    out = memoryview(bytearray(header.raw_len))
    _decode_payload(header, payload, out)
    return out


def decode_into(
    value: bytes | bytearray | memoryview, expect_key: ChunkKey, dst: memoryview
) -> ChunkHeader:
    """Verify ``value`` and copy its payload (decoded, where coded) into ``dst``, which must be
    exactly the payload's own size.

    A payload stored as it is is copied in pieces and each piece hashed right after, while it
    is in cache; on a mismatch ``dst`` holds garbage and the caller must not publish it.
    """
    header = decode_header(value, expect_key)
    _check_fits(header, len(dst))
    src = memoryview(value)[HEADER_SIZE:]
    checksum = _copy_hashed(src, dst) if header.codec is Codec.NONE else payload_checksum(src)
    if checksum != header.payload_checksum:
        raise CorruptChunkError("payload checksum mismatch")
    if header.codec is not Codec.NONE:
        _decode_payload(header, src, dst)
    return header


def verified_in_place(
    value: bytes | bytearray | memoryview, expect_key: ChunkKey, nbytes: int
) -> memoryview | None:
    """Verify ``value`` where it lies and return its payload, a view of ``value`` (``nbytes``
    long), where it is stored as it is; None where it is coded (`decode_into` decodes it)."""
    header = decode_header(value, expect_key)
    if header.codec is not Codec.NONE:
        return None
    _check_fits(header, nbytes)
    payload = memoryview(value)[HEADER_SIZE:]
    if payload_checksum(payload) != header.payload_checksum:
        raise CorruptChunkError("payload checksum mismatch")
    return payload


def _check_fits(header: ChunkHeader, nbytes: int) -> None:
    if nbytes != header.raw_len:
        raise CorruptChunkError(
            f"payload of {header.raw_len} bytes does not fit a {nbytes}-byte slot"
        )


def _decode_payload(header: ChunkHeader, coded: memoryview, dst: memoryview) -> None:
    dtype = kvcodec.element_dtype(header.descriptor.kv_dtype)
    assert dtype is not None  # raw_len checked it
    kvcodec.decode_into(header.codec, coded, dtype, header.descriptor.head_size, dst)
