"""Verified reads of the lmdb tier's stored chunks, each inside one short read transaction."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections.abc import Sequence

import lmdb
import numpy as np

from kvtier.core import blockfmt
from kvtier.core.errors import ChunkFormatError
from kvtier.core.keys import ChunkKey


def copy_payload(
    env: lmdb.Environment, chunks: lmdb._Database, key: ChunkKey, dst: memoryview
) -> tuple[bool, ChunkFormatError | None]:
    """Copy a chunk's payload out, verified: whether it is stored, and how it failed if it
    did (then ``dst`` holds garbage). LMDB's buffer is invalid once the transaction ends."""
    with env.begin(db=chunks, buffers=True) as txn:
        value = txn.get(key)
        if value is None:
            return False, None
        try:
            blockfmt.decode_into(value, key, dst)
        except ChunkFormatError as exc:
            return True, exc
    return True, None


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
            return exc
    return True


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_MADV_WILLNEED = 3


def will_need(env: lmdb.Environment, chunks: lmdb._Database, keys: Sequence[ChunkKey]) -> int:
    """Ask the kernel to read the stored chunks of ``keys`` ahead (madvise WILLNEED on their
    pages of the map), so that reads of several cold chunks overlap on the disk instead of
    faulting in one after another; returns how many were found. Nothing is read here."""
    found = 0
    page = mmap.PAGESIZE
    with env.begin(db=chunks, buffers=True) as txn:
        for key in keys:
            value = txn.get(key)
            if value is None:
                continue
            found += 1
            start = int(np.frombuffer(value, np.uint8).ctypes.data)
            first = start - start % page
            _libc.madvise(
                ctypes.c_void_p(first), ctypes.c_size_t(start + len(value) - first), _MADV_WILLNEED
            )
    return found
