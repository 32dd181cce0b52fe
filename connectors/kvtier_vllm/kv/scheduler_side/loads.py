"""A planned load: the leased chunks of a request's hit, by pool plan, and how they are copied
into the request's blocks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.core.keys import Pool
from kvtier.core.protocol import SlotRef, TierCode
from kvtier_vllm.drafts.swaps import Fill
from kvtier_vllm.kv.metadata import ChunkCopy, KVTierMetadata, lmdb_key
from kvtier_vllm.kv.scheduler_side.prompt_keys import plan_span
from kvtier_vllm.layout.plans import PoolPlan

# vLLM's CacheHitSource values per tier; the object store is remote, shared storage
_HIT_SOURCES = {int(TierCode.CPU): "host", int(TierCode.LMDB): "disk"}
_REMOTE_SOURCE = "external_unspecified"


@dataclass
class LoadPlan:
    """The load of a hit of ``chunks`` chunks from ``first_chunk`` (no chunk: a miss)."""

    first_chunk: int
    chunks: int
    leases: dict[str, tuple[int, list[SlotRef]]]
    """Per plan key, the first chunk leased and the leases, chunk after chunk."""
    zero_plans: list[str]
    tiers: bytes = b""
    """Where each chunk was when first asked for (promoted ones came from lmdb)."""
    fill: Fill = Fill.NONE
    """How the draft pages of these chunks are set."""
    computed: int = 0
    """Tokens vLLM held when it was answered: it loads the ones past them."""

    @property
    def end(self) -> int:
        """The chunk after the hit's last."""
        return self.first_chunk + self.chunks

    def tokens(self, chunk_tokens: int) -> int:
        """The hit's tokens past the ``computed`` ones vLLM holds."""
        return self.end * chunk_tokens - self.computed

    def refs(self) -> list[SlotRef]:
        return [r for _, refs in self.leases.values() for r in refs]

    def sources(self, chunk_tokens: int) -> dict[str, int]:
        """The tokens it loads by the tier that held them: "host" (arena), "disk" (lmdb) or
        "external_unspecified" (the object store)."""
        sources: dict[str, int] = {}
        for i, code in enumerate(self.tiers):
            start = max((self.first_chunk + i) * chunk_tokens, self.computed)
            end = (self.first_chunk + i + 1) * chunk_tokens
            source = _HIT_SOURCES.get(code, _REMOTE_SOURCE)
            sources[source] = sources.get(source, 0) + max(0, end - start)
        return sources

    def add_copies(
        self,
        meta: KVTierMetadata,
        block_ids: list[list[int]],
        by_key: Mapping[str, PoolPlan],
        *,
        skip: int,
        request: str,
        chunk_tokens: int,
        blocks_per_chunk: int,
    ) -> None:
        """Add the copies of this load into a request's blocks (per group) to ``meta``, and the
        blocks to zero. ``skip``: blocks vLLM holds already; ``request``: named for an
        asynchronous load."""
        bpc = blocks_per_chunk
        for key, (start, refs) in self.leases.items():
            ids = block_ids[by_key[key].group]
            # another revision's draft chunk is a fill, never loaded as the current one
            draft = by_key[key].pool is Pool.DRAFT
            fill = "previous" if draft and self.fill is Fill.PREVIOUS else ""
            for chunk, ref in enumerate(refs, start):
                first = max(0, skip - chunk * bpc)
                blocks = tuple(ids[chunk * bpc + first : (chunk + 1) * bpc])
                args = (key, ref.slot, ref.offset, ref.generation, blocks, first, fill, request)
                meta.loads.append(ChunkCopy(*args, lmdb_key(ref), bytes(ref.key)))
        end = self.end * bpc
        for key in self.zero_plans:
            zeroed = plan_span(by_key[key], self.first_chunk, self.end, chunk_tokens)
            ids = block_ids[by_key[key].group]
            start = max(skip, zeroed.start * bpc)
            meta.zero.setdefault(key, []).extend(b for b in ids[start:end] if b)
