"""Verified reads of the lmdb tier's stored chunks, each inside one short read transaction."""

from __future__ import annotations

import lmdb

from kvtier.core import blockfmt
from kvtier.core.errors import ChunkFormatError
from kvtier.core.keys import ChunkKey
from kvtier.tiers.lmdb_reader import copy_payload, will_need, without_frames

__all__ = ["copy_encoded", "copy_payload", "verify", "will_need"]


def copy_encoded(
    env: lmdb.Environment, chunks: lmdb._Database, key: ChunkKey, dst: memoryview
) -> bool:
    """Copy a whole stored chunk, header included, verified (raising `ChunkFormatError`);
    False when absent."""
    with env.begin(db=chunks, buffers=True) as txn:
        value = txn.get(key)
        if value is None:
            return False
        blockfmt.copy_verified(value, key, dst)
    return True


def verify(
    env: lmdb.Environment, chunks: lmdb._Database, key: ChunkKey
) -> ChunkFormatError | bool | None:
    """Verify a stored chunk in place: True if sound, how it failed, or None if absent."""
    with env.begin(db=chunks, buffers=True) as txn:
        value = txn.get(key)
        if value is None:
            return None
        try:
            blockfmt.decode(value, key)
        except ChunkFormatError as exc:
            return without_frames(exc)
    return True
