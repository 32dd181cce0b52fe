"""What the scheduler side tells the workers each step, and what they report back."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.core.costs import EngineTimings
from kvtier.core.protocol import FailedChunk, SlotRef, in_lmdb
from kvtier_vllm.shared.vllm_compat import KVConnectorMetadata, KVConnectorWorkerMetadata


def lmdb_key(ref: SlotRef) -> bytes:
    """`ChunkCopy.key` for a lease: its chunk's key where it was granted in lmdb, else none."""
    return bytes(ref.key) if in_lmdb(ref) else b""


@dataclass(frozen=True, slots=True)
class ChunkCopy:
    """One chunk between an arena slot and vLLM blocks.

    ``block_ids[i]`` holds the chunk's block ``first_block + i``; blocks before ``first_block``
    are already in vLLM (a local prefix hit) and are not touched.
    """

    plan: str
    """The `PoolPlan.key` of the pool and KV-cache group the blocks belong to."""
    slot: int
    offset: int
    generation: int
    block_ids: tuple[int, ...]
    first_block: int = 0
    fill: str = ""
    """Draft loads: "previous" when the chunk is another revision's, loaded as a fill; such a
    load is never mistaken for the current revision's."""
    request: str = ""
    """Asynchronous loads: the request whose load this copy is part of."""
    key: bytes = b""
    """A chunk leased in lmdb (`kvtier.core.protocol.in_lmdb`): its key, read from lmdb's map
    (`KVTierMetadata.lmdb_path`) instead of an arena slot."""
    chunk: bytes = b""
    """The chunk's key wherever it is read from: named in the report of a load that failed."""


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    arena_path: str = ""
    arena_inode: int = 0
    """The arena file the step's slots and leases are in (`TierClient.arena_inode`; 0: any)."""
    lmdb_path: str = ""
    """Where loads leased in lmdb read from ("": none is)."""
    loads: list[ChunkCopy] = field(default_factory=list)
    stores: list[ChunkCopy] = field(default_factory=list)
    zero: dict[str, list[int]] = field(default_factory=dict)
    """Per plan key, blocks whose pages must be zeroed: a hit with no chunk of that pool."""
    receiving: list[str] = field(default_factory=list)
    """Requests whose loads are asynchronous: each worker reports them finished, or failed,
    once their copies are done."""
    idle: bool = False
    """Nothing is computed in this step: the workers may wait for the asynchronous loads in
    flight before they report (`BackgroundLoads.wait_if_idle`), which holds up no one."""
    block_errors: bool = False
    """The asynchronous loads' failed chunks are reported as load errors of their blocks, their
    requests finished (one KV-cache group: vLLM computes from the first failed block); else
    their requests fail whole."""
    draft_check: bool = False
    """Fingerprint the draft weights this step."""
    draft_fingerprints: dict[int, str] = field(default_factory=dict)
    """Per worker rank, the fingerprint of the draft weights the plan is for; none: unbound."""
    invalid_blocks: list[int] = field(default_factory=list)
    """Blocks of loads vLLM was promised and that will not come: reported as load errors."""
    failed_requests: list[str] = field(default_factory=list)
    """Asynchronous loads that will not come: reported finished and failed."""
    checks: list[ChunkCopy] = field(default_factory=list)
    """Leased chunks to compare with what vLLM computed in their place in earlier steps."""
    sending: list[str] = field(default_factory=list)
    """Finished requests whose blocks vLLM keeps until this step's stores (their hidden
    states' tail) landed: each worker reports them finished sending then."""


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    stored: list[tuple[int, int]] = field(default_factory=list)
    """(slot, generation) of store copies that completed."""
    failed: list[tuple[int, int]] = field(default_factory=list)
    draft_fingerprints: dict[int, str] = field(default_factory=dict)
    """Per worker rank, the fingerprint of the draft weights, when one was taken."""
    checked: list[tuple[int, int, float]] = field(default_factory=list)
    """(slot, generation, relative error) of each chunk compared, per rank that holds a part;
    a negative error: the slot was reused before it could be compared."""
    timings: EngineTimings = field(default_factory=EngineTimings)
    """Loads per tier, timed by each rank (each rank copies its part at once)."""
    failed_chunks: list[FailedChunk] = field(default_factory=list)
    """Chunks each rank read and found failing verification, for the tiers to drop."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        timings = EngineTimings()
        timings.merge(self.timings)
        timings.merge(other.timings)
        return KVTierWorkerMetadata(
            self.stored + other.stored,
            self.failed + other.failed,
            {**self.draft_fingerprints, **other.draft_fingerprints},
            self.checked + other.checked,
            timings,
            self.failed_chunks + other.failed_chunks,
        )
