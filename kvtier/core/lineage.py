"""A chunk's lineage: the engine's own hashes of the blocks it holds, the hash of the block before
it, and its token ids. A chunk key names only the last block; a router indexes every block, under
the hashes its engines publish, so an event about a chunk needs all of them.

The connector sends a target chunk's lineage with its commit; kvtierd keeps it while the chunk may
still be uploaded, and beside each object it uploads (`pack`), so that whoever deletes the object
can announce what left.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.core.keys import MAX_CHUNK_HASH_BYTES, ChunkKey

_VERSION = 1
_HEAD = struct.Struct("<BHBBII")  # version, blocks, hash length, has parent, block size, tokens
_PACK_MAGIC = b"KVTL"
_PACK_HEAD = struct.Struct("<4sBHI")  # magic, version, model length, entries
_ENTRY = struct.Struct("<BI")  # key length, lineage length
_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True, slots=True)
class BlockLineage:
    block_hashes: tuple[bytes, ...]
    parent: bytes | None
    """The hash of the block before the chunk's first; None for a prompt's first chunk."""
    token_ids: tuple[int, ...]
    block_size: int

    def encode(self) -> bytes:
        hashes = self.block_hashes
        width = len(hashes[0]) if hashes else 0
        if not 0 < width <= MAX_CHUNK_HASH_BYTES or any(len(h) != width for h in hashes):
            raise ValueError("a lineage needs block hashes of one length, 1..32 bytes")
        if self.parent is not None and len(self.parent) != width:
            raise ValueError("the parent hash must be as long as the block hashes")
        tokens = array("i", self.token_ids)
        if not _LITTLE:
            tokens.byteswap()
        head = _HEAD.pack(
            _VERSION, len(hashes), width, self.parent is not None, self.block_size, len(tokens)
        )
        return b"".join((head, *hashes, self.parent or b"", tokens.tobytes()))

    @classmethod
    def decode(cls, data: bytes | memoryview) -> BlockLineage:
        """Raises ValueError for anything but a whole lineage of this version."""
        if len(data) < _HEAD.size:
            raise ValueError("lineage truncated")
        version, blocks, width, has_parent, block_size, ntokens = _HEAD.unpack_from(data)
        if version != _VERSION:
            raise ValueError(f"lineage version {version} is unknown")
        hashes_end = _HEAD.size + blocks * width
        parent_end = hashes_end + (width if has_parent else 0)
        if len(data) != parent_end + 4 * ntokens:
            raise ValueError("lineage length does not match its header")
        view = bytes(data)
        hashes = tuple(view[i : i + width] for i in range(_HEAD.size, hashes_end, width))
        tokens = array("i", view[parent_end:])
        if not _LITTLE:
            tokens.byteswap()
        parent = view[hashes_end:parent_end] if has_parent else None
        return cls(hashes, parent, tuple(tokens), block_size)


def pack(model: str, entries: Iterable[tuple[ChunkKey, bytes]]) -> bytes:
    """Encoded lineages by chunk key, with the model they are of, as one value (the object
    beside an uploaded pack)."""
    items = list(entries)
    name = model.encode()
    parts = [_PACK_HEAD.pack(_PACK_MAGIC, _VERSION, len(name), len(items)), name]
    for key, lineage in items:
        parts += [_ENTRY.pack(len(key), len(lineage)), key, lineage]
    return b"".join(parts)


def unpack(data: bytes | memoryview) -> tuple[str, list[tuple[ChunkKey, BlockLineage]]]:
    """The model and the lineages of a `pack`; raises ValueError where ``data`` is not a whole
    pack of this version."""
    view = memoryview(data)
    if len(view) < _PACK_HEAD.size:
        raise ValueError("lineage pack truncated")
    magic, version, model_len, count = _PACK_HEAD.unpack_from(view)
    if magic != _PACK_MAGIC or version != _VERSION:
        raise ValueError("not a lineage pack of a known version")
    at = _PACK_HEAD.size + model_len
    try:
        model = bytes(view[_PACK_HEAD.size : at]).decode()
    except UnicodeDecodeError as exc:
        raise ValueError("lineage pack's model is not UTF-8") from exc
    out: list[tuple[ChunkKey, BlockLineage]] = []
    for _ in range(count):
        if at + _ENTRY.size > len(view):
            raise ValueError("lineage pack truncated")
        key_len, lineage_len = _ENTRY.unpack_from(view, at)
        at += _ENTRY.size
        end = at + key_len + lineage_len
        if end > len(view):
            raise ValueError("lineage pack truncated")
        key = ChunkKey(bytes(view[at : at + key_len]))
        out.append((key, BlockLineage.decode(view[at + key_len : end])))
        at = end
    if at != len(view):
        raise ValueError("lineage pack has trailing bytes")
    return model, out


def lineage_of(
    block_hashes: Sequence[bytes],
    chunk: int,
    blocks_per_chunk: int,
    tokens: Sequence[int],
    block_size: int,
) -> BlockLineage:
    """Chunk ``chunk``'s lineage, from a request's block hashes and the chunk's token ids."""
    first = chunk * blocks_per_chunk
    return BlockLineage(
        tuple(block_hashes[first : first + blocks_per_chunk]),
        block_hashes[first - 1] if chunk else None,
        tuple(tokens),
        block_size,
    )
