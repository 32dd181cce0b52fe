"""A chunk's lineage and the companion that holds an object's: exact round trips, and anything
but a whole value of this version refused."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.keys import ChunkKey
from kvtier.core.lineage import BlockLineage, lineage_of, pack, unpack


def _hashes(n: int, width: int = 32, seed: str = "") -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"{seed}{i}".encode()).digest()[:width] for i in range(n))


@given(
    blocks=st.integers(1, 64),
    width=st.integers(1, 32),
    with_parent=st.booleans(),
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=512),
    block_size=st.integers(1, 1024),
)
def test_a_lineage_round_trips(
    blocks: int, width: int, with_parent: bool, tokens: list[int], block_size: int
) -> None:
    lineage = BlockLineage(
        _hashes(blocks, width),
        _hashes(1, width, "p")[0] if with_parent else None,
        tuple(tokens),
        block_size,
    )
    assert BlockLineage.decode(lineage.encode()) == lineage


def test_only_whole_lineages_of_this_version_decode() -> None:
    encoded = BlockLineage(_hashes(4), None, tuple(range(64)), 16).encode()
    for bad in (encoded[:-1], encoded + b"\0", b"\x02" + encoded[1:], encoded[:5]):
        with pytest.raises(ValueError, match="lineage"):
            BlockLineage.decode(bad)


def test_hashes_of_mixed_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="one length"):
        BlockLineage((b"a" * 32, b"b" * 16), None, (), 16).encode()
    with pytest.raises(ValueError, match="parent"):
        BlockLineage((b"a" * 32,), b"p" * 8, (), 16).encode()


def test_a_pack_keeps_its_model_and_each_chunks_lineage_in_order() -> None:
    entries = [
        (ChunkKey(bytes([i]) * 48), BlockLineage(_hashes(4, seed=str(i)), None, (i,), 16))
        for i in range(3)
    ]
    packed = pack("org/model-7b", [(k, lin.encode()) for k, lin in entries])
    assert unpack(packed) == ("org/model-7b", entries)
    for bad in (packed[:-1], packed + b"\0", b"XXXX" + packed[4:]):
        with pytest.raises(ValueError, match="lineage pack"):
            unpack(bad)


def test_a_chunks_lineage_is_its_blocks_and_the_block_before() -> None:
    hashes = list(_hashes(12))
    first = lineage_of(hashes, 0, 4, range(64), 16)
    third = lineage_of(hashes, 2, 4, range(128, 192), 16)
    assert first.block_hashes == tuple(hashes[:4])
    assert first.parent is None
    assert third.block_hashes == tuple(hashes[8:12])
    assert third.parent == hashes[7]
    assert third.token_ids == tuple(range(128, 192))
