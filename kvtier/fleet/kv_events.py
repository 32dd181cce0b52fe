"""vLLM's KV events, encoded as its publisher encodes them, without importing vLLM.

A batch is a msgpack array ``[ts, events]`` (the data-parallel rank, when unset, is left off);
each event a msgpack map whose ``type`` names its class, then its fields in declaration order,
fields left at their defaults omitted. Routers decode them with vLLM's own classes
(`vllm.distributed.kv_events.KVEventBatch`), which the tests do.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvtier.core.lineage import BlockLineage

Event = dict[str, Any]
_encoder = msgspec.msgpack.Encoder()
_INT_MASK = (1 << 64) - 1


def external_hash(block_hash: bytes, as_int: bool) -> bytes | int:
    """A block hash as vLLM publishes it: the low 64 bits of its big-endian value, or as is."""
    return int.from_bytes(block_hash, "big") & _INT_MASK if as_int else block_hash


def block_stored(lineage: BlockLineage, medium: str, as_int: bool) -> Event:
    parent = lineage.parent
    return {
        "type": "BlockStored",
        "block_hashes": [external_hash(h, as_int) for h in lineage.block_hashes],
        "parent_block_hash": None if parent is None else external_hash(parent, as_int),
        "token_ids": list(lineage.token_ids),
        "block_size": lineage.block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def block_removed(block_hashes: Sequence[bytes], medium: str, as_int: bool) -> Event:
    return {
        "type": "BlockRemoved",
        "block_hashes": [external_hash(h, as_int) for h in block_hashes],
        "medium": medium,
    }


def encode_batch(events: Sequence[Event], ts: float | None = None) -> bytes:
    return _encoder.encode([time.time() if ts is None else ts, list(events)])
