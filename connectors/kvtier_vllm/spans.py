"""Which chunks of a hit each pool plan needs, and their keys: a hit's chunks are asked for
as consecutive spans, one per plan."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from kvtier.core.keys import ChunkKey, Pool, make_key
from kvtier.core.protocol import SlotRef
from kvtier_vllm.layout import PoolPlan

Items = TypeVar("Items", bytes, list[Any])


def split(items: Items, spans: list[tuple[PoolPlan, range]]) -> list[Items]:
    """``items`` of consecutive spans, span by span."""
    out = []
    offset = 0
    for _, span in spans:
        out.append(items[offset : offset + len(span)])
        offset += len(span)
    return out


def by_plan(
    spans: list[tuple[PoolPlan, range]], refs: list[SlotRef | None]
) -> dict[str, tuple[int, list[SlotRef | None]]]:
    """Per plan key, the first chunk of its span and its refs, from those of consecutive spans."""
    return {
        plan.key: (span.start, part)
        for (plan, span), part in zip(spans, split(refs, spans), strict=True)
    }


def needed(plan: PoolPlan, first: int, chunks: int, chunk_tokens: int) -> range:
    """The chunks a hit of ``chunks`` chunks needs from ``plan``, from ``first`` on."""
    return range(max(first, plan.first_needed(chunks, chunk_tokens)), chunks)


def keys_in(
    namespace: bytes, hashes: Any, chunks: Iterable[int], blocks_per_chunk: int
) -> list[ChunkKey]:
    """A chunk's key is its last block's hash."""
    return [make_key(namespace, hashes[(c + 1) * blocks_per_chunk - 1]) for c in chunks]


def targets_of(plans: Iterable[PoolPlan]) -> list[PoolPlan]:
    """The plans a hit needs every chunk of, full attention first (a shorter hit they find never
    moves their own start): the target's, and the captured hidden states' (a hit without them
    would leave its prefix's states unwritten for the request's reference)."""
    needed = (p for p in plans if p.pool in (Pool.TARGET, Pool.HIDDEN))
    return sorted(needed, key=lambda p: bool(p.window))
