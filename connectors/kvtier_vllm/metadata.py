"""What the scheduler side tells the workers each step, and what they report back."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier_vllm.adapter import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True, slots=True)
class ChunkCopy:
    """One chunk between an arena slot and vLLM blocks.

    ``block_ids[i]`` holds the chunk's block ``first_block + i``; blocks before ``first_block``
    are already in vLLM (a local prefix hit) and are not touched.
    """

    pool: str
    slot: int
    offset: int
    generation: int
    block_ids: tuple[int, ...]
    first_block: int = 0


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    arena_path: str = ""
    loads: list[ChunkCopy] = field(default_factory=list)
    stores: list[ChunkCopy] = field(default_factory=list)
    zero: dict[str, list[int]] = field(default_factory=dict)
    """Blocks whose pages of a pool must be zeroed: a hit with no chunk of that pool."""


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    stored: list[tuple[int, int]] = field(default_factory=list)
    """(slot, generation) of store copies that completed."""
    failed: list[tuple[int, int]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        return KVTierWorkerMetadata(self.stored + other.stored, self.failed + other.failed)
