"""Hand-encoded protobuf for the data plane's key-carrying requests.

Python protobuf serialises a message holding a large bytes field at about 1 GB/s, which costs
more than the rest of a lookup of thousands of keys. These requests are encoded here instead, in
the standard wire format (tests check that the generated classes parse them back identically).
"""

from __future__ import annotations

from collections.abc import Sequence

_LEN = 2  # wire type of length-delimited fields
_VARINT = 0


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def length_delimited(field: int, payload: bytes) -> bytes:
    return varint(field << 3 | _LEN) + varint(len(payload)) + payload


def key_request(
    session_id: str,
    key_bytes: int,
    packed: bytes,
    refs: Sequence[bytes] = (),
    refs_field: int = 3,
    flags: Sequence[int] = (),
) -> bytes:
    """LookupRequest, ReserveRequest or PrefetchRequest: session (1), KeyBatch (2), the
    already-serialised SlotRefs of field ``refs_field`` (commit or release), and the bool fields
    numbered in ``flags`` set to true."""
    batch = b""
    if packed:
        batch = varint(1 << 3 | _VARINT) + varint(key_bytes) + length_delimited(2, packed)
    parts = [length_delimited(1, session_id.encode()) if session_id else b""]
    if batch:
        parts.append(length_delimited(2, batch))
    parts.extend(length_delimited(refs_field, ref) for ref in refs)
    parts.extend(varint(flag << 3 | _VARINT) + varint(1) for flag in flags)
    return b"".join(parts)
