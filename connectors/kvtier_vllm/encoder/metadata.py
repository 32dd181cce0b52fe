"""What the encoder-cache connector's scheduler side tells its workers each step, and what
they report back."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.core.encoder import PartLayout
from kvtier.core.protocol import FailedChunk, SlotRef


@dataclass(frozen=True, slots=True)
class ItemSlots:
    """One encoder output and the arena slots of its parts, in order (or leases in lmdb:
    `kvtier.core.protocol.in_lmdb`, read from lmdb's map)."""

    identifier: str
    rows: int
    layout: PartLayout
    refs: tuple[SlotRef, ...]

    @property
    def nbytes(self) -> int:
        return self.rows * self.layout.row_bytes


@dataclass
class ECStepPlan:
    """One step's work: outputs to read into vLLM's encoder cache, outputs to write once the
    encoder computed them, and outputs to compare with what the encoder computes (sampled
    hits, served as misses)."""

    arena_path: str = ""
    lmdb_path: str = ""
    """Where parts leased in lmdb are read ("": none is)."""
    step: int = -1
    loads: list[ItemSlots] = field(default_factory=list)
    stores: list[ItemSlots] = field(default_factory=list)
    checks: list[ItemSlots] = field(default_factory=list)


@dataclass
class ECReport:
    """A worker's account of one step's plan: every item of it, in one of these."""

    step: int = -1
    loaded: set[str] = field(default_factory=set)
    load_failed: set[str] = field(default_factory=set)
    stored: set[str] = field(default_factory=set)
    store_failed: set[str] = field(default_factory=set)
    errors: dict[str, float] = field(default_factory=dict)
    """Sampled hits: the relative error of the stored output against the one computed."""
    load_seconds: float = 0.0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    failed_chunks: list[FailedChunk] = field(default_factory=list)
    """Parts read from lmdb that failed verification, to report to the tiers."""

    def merge(self, other: ECReport) -> ECReport:
        """Two workers' reports as one: an item failed if it failed on any worker."""
        return ECReport(
            step=max(self.step, other.step),
            loaded=(self.loaded | other.loaded) - self.load_failed - other.load_failed,
            load_failed=self.load_failed | other.load_failed,
            stored=(self.stored | other.stored) - self.store_failed - other.store_failed,
            store_failed=self.store_failed | other.store_failed,
            errors={
                k: max(self.errors.get(k, 0.0), other.errors.get(k, 0.0))
                for k in self.errors.keys() | other.errors.keys()
            },
            load_seconds=max(self.load_seconds, other.load_seconds),
            loaded_bytes=max(self.loaded_bytes, other.loaded_bytes),
            stored_bytes=self.stored_bytes + other.stored_bytes,
            failed_chunks=[*self.failed_chunks, *other.failed_chunks],
        )
