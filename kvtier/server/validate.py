"""Checks of what a call asks before it changes anything: batch sizes, key and namespace lengths,
a pool's chunk size against its layout.

Each raises `InvalidRequestError`, which the caller sees as INVALID_ARGUMENT naming the field.
The conversions themselves are `kvtier.core.codec`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np

from kvtier.api.v1 import tier_pb2
from kvtier.core.chunk_size import chunk_payload_bytes
from kvtier.core.errors import InvalidRequestError
from kvtier.core.keys import (
    MAX_CHUNK_HASH_BYTES,
    NAMESPACE_BYTES,
    ChunkKey,
    NamespaceSpec,
    packed_namespaces,
)

_MIN_KEY, _MAX_KEY = NAMESPACE_BYTES + 1, NAMESPACE_BYTES + MAX_CHUNK_HASH_BYTES


def check_batch(items: Sequence[object], limit: int, what: str = "keys") -> None:
    if len(items) > limit:
        raise InvalidRequestError(f"{len(items)} {what} in one call; the limit is {limit}")


def keys_from(raw: Iterable[bytes]) -> list[ChunkKey]:
    keys = list(raw)
    lengths = set(map(len, keys))  # one C-level pass, not a call per key: batches run to 10^4
    if lengths and (min(lengths) < _MIN_KEY or max(lengths) > _MAX_KEY):
        raise InvalidRequestError(f"a chunk key is {_MIN_KEY}..{_MAX_KEY} bytes")
    return cast(list[ChunkKey], keys)


def unpack_keys(batch: tier_pb2.KeyBatch, limit: int) -> list[ChunkKey]:
    if not batch.packed:
        return []
    size = batch.key_bytes
    if not _MIN_KEY <= size <= _MAX_KEY:
        raise InvalidRequestError(f"a chunk key is {_MIN_KEY}..{_MAX_KEY} bytes, not {size}")
    count, rest = divmod(len(batch.packed), size)
    if rest:
        raise InvalidRequestError(f"packed keys are not a multiple of {size} bytes")
    if count > limit:
        raise InvalidRequestError(f"{count} keys in one call; the limit is {limit}")
    # numpy splits the buffer into bytes objects without a Python call per key
    return cast(list[ChunkKey], np.frombuffer(batch.packed, dtype=f"V{size}").tolist())


def batch_namespaces(batch: tier_pb2.KeyBatch) -> set[bytes]:
    """The namespaces of a batch `unpack_keys` accepted."""
    return packed_namespaces(batch.packed, batch.key_bytes)


def namespace_from(raw: bytes) -> bytes | None:
    if not raw:
        return None
    if len(raw) != NAMESPACE_BYTES:
        raise InvalidRequestError(f"a namespace is {NAMESPACE_BYTES} bytes, got {len(raw)}")
    return raw


def check_chunk_bytes(spec: NamespaceSpec, chunk_bytes: int) -> None:
    """``chunk_bytes`` is what ``spec``'s layout makes a chunk: a registration of another size
    would claim the namespace for a size its engines never store."""
    try:
        expected = chunk_payload_bytes(spec)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    if chunk_bytes != expected:
        layout = spec.layout
        raise InvalidRequestError(
            f"chunk_bytes is {chunk_bytes}, but the layout makes a chunk {expected} bytes "
            f"({layout.tokens_per_block} tokens x {layout.blocks_per_chunk} blocks x "
            f"{layout.num_kv_heads} heads x {len(layout.layer_names)} layers of head sizes "
            f"{list(layout.head_sizes)} in {spec.kv_dtype})"
        )
