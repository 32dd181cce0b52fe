"""A prompt's chunk keys, made once per request (`PromptKeys`), and which chunks of a hit each
pool plan needs: a hit's chunks are asked for as consecutive spans, one per plan (`Needed`)."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.keys import ChunkKey, Pool, make_key
from kvtier_vllm.layout.plans import PoolPlan
from kvtier_vllm.shared.settings import ConnectorConfig

log = logging.getLogger(__name__)


def stable_tenant(cfg: ConnectorConfig, vllm_config: Any) -> ConnectorConfig:
    """``cfg``, with a tenant of this process's own where vLLM seeds its block hashes per
    process: keys made from them would name other prompts in another engine."""
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo.startswith("xxhash") and not os.environ.get("PYTHONHASHSEED"):
        log.warning(
            "prefix_caching_hash_algo=%s seeds block hashes per process: kvtier keeps this "
            "engine's chunks to itself. Set PYTHONHASHSEED or use sha256 to share them.",
            algo,
        )
        return cfg.model_copy(
            update={"tenant": f"{cfg.tenant[:39]}-process-{uuid.uuid4().hex[:16]}"}
        )
    return cfg


@dataclass(frozen=True)
class Needed:
    """What a hit from chunk ``first`` up to ``end`` needs of each plan: its span, and the keys
    of every span, one span after the other (a lookup asks for them in one call)."""

    first: int
    end: int
    spans: list[tuple[PoolPlan, range]]
    keys: list[ChunkKey]


def plan_span(plan: PoolPlan, first: int, chunks: int, chunk_tokens: int) -> range:
    """The chunks a hit of ``chunks`` chunks needs from ``plan``, from ``first`` on."""
    return range(max(first, plan.first_needed(chunks, chunk_tokens)), chunks)


def keys_in(
    namespace: bytes, hashes: Any, chunks: Iterable[int], blocks_per_chunk: int
) -> list[ChunkKey]:
    return [make_key(namespace, chunk_hash(hashes, c, blocks_per_chunk)) for c in chunks]


def chunk_hash(hashes: Any, chunk: int, blocks_per_chunk: int) -> bytes:
    """What names a chunk in its key: its last block's hash."""
    last: bytes = hashes[(chunk + 1) * blocks_per_chunk - 1]
    return last


@dataclass
class PromptKeys:
    """A prompt's chunk keys, each made once per namespace and kept for the request's life (at
    most its chunks per namespace it was asked in). ``hashes`` is read as it grows: vLLM
    appends the hashes of the blocks it computes."""

    hashes: Any
    blocks_per_chunk: int
    _made: dict[bytes, dict[int, ChunkKey]] = field(default_factory=dict)

    def hash_of(self, chunk: int) -> bytes:
        return chunk_hash(self.hashes, chunk, self.blocks_per_chunk)

    def hashes_of(self, chunks: Iterable[int]) -> list[bytes]:
        return [self.hash_of(c) for c in chunks]

    def needed(
        self,
        plans: Sequence[PoolPlan],
        namespaces: Mapping[str, bytes],
        first: int,
        end: int,
        chunk_tokens: int,
    ) -> Needed:
        """What a hit from chunk ``first`` up to ``end`` needs of ``plans``."""
        spans = [(plan, plan_span(plan, first, end, chunk_tokens)) for plan in plans]
        keys = [k for plan, span in spans for k in self.of(namespaces[plan.key], span)]
        return Needed(first, end, spans, keys)

    def of(self, namespace: bytes, chunks: Iterable[int]) -> list[ChunkKey]:
        made = self._made.setdefault(namespace, {})
        out = []
        for chunk in chunks:
            key = made.get(chunk)
            if key is None:
                key = made[chunk] = make_key(namespace, self.hash_of(chunk))
            out.append(key)
        return out


def targets_of(plans: Iterable[PoolPlan]) -> list[PoolPlan]:
    """The plans a hit needs (every chunk, or a window's), full attention first (a shorter hit
    they find never moves their own start): the target's, the captured hidden states' (a hit
    without them would leave its prefix's states unwritten for the request's reference), and the
    state layers' (their state at the hit's end)."""
    needed = (p for p in plans if p.pool in (Pool.TARGET, Pool.HIDDEN, Pool.STATE))
    return sorted(needed, key=lambda p: bool(p.window))
