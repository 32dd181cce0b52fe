"""Where a prompt's KV is, and what loading it would cost: per tier, how many of the prompt's
leading tokens it holds and the measured time to load them, against the time to recompute them.

A prompt is named by its block hashes as the engine computes them (the full hashes: a chunk's key
is its namespace and the hash of its last block). Each target namespace of the model counts,
every tensor-parallel rank's: a tier holds a chunk only where it holds every rank's part. A
tier that lookups leave out (unhealthy: `kvtier.tiering.health`) holds none of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.core.costs import CostSnapshot
from kvtier.core.errors import UnknownPoolError
from kvtier.core.keys import ChunkKey, Pool
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.base import Tier


@dataclass(frozen=True, slots=True)
class TierSpan:
    tier: str
    chunks: int
    tokens: int
    load_seconds: float | None
    """Expected, from the tier's measured loads; None before any was timed."""


@dataclass(frozen=True, slots=True)
class Location:
    tokens: int
    """The prompt's tokens in whole blocks: what the hashes name."""
    spans: list[TierSpan]
    recompute_seconds: float | None
    """The leading tokens the best tier holds, recomputed at the engines' measured prefill
    rate; None before any prefill was timed."""
    costs: CostSnapshot


def locate(
    registry: PoolRegistry,
    tiers: Mapping[str, Tier],
    costs: CostSnapshot,
    model: str,
    block_hashes: Sequence[bytes],
    tenant: str = "default",
    serves: Callable[[str], bool] = lambda tier: True,
) -> Location:
    specs = [
        spec
        for reg in registry.registrations()
        if (spec := registry.spec_of(reg.namespace)) is not None
        and spec.model == model
        and spec.pool is Pool.TARGET
        and spec.tenant == tenant
    ]
    if not specs:
        raise UnknownPoolError(f"no target pool of model {model!r} (tenant {tenant!r}) is known")
    layout = specs[0].layout
    bpc, per_block = layout.blocks_per_chunk, layout.tokens_per_block
    whole = len(block_hashes) // bpc
    last_blocks = [block_hashes[(i + 1) * bpc - 1] for i in range(whole)]
    spans = []
    for name, tier in tiers.items():
        held = whole if serves(name) else 0
        for spec in specs if held else ():
            namespace = spec.digest()
            present = tier.contains([ChunkKey(namespace + h) for h in last_blocks])
            held = min(held, next((i for i, p in enumerate(present) if not p), whole))
        spans.append(TierSpan(name, held, held * bpc * per_block, costs.load_seconds(name, held)))
    best = max((s.tokens for s in spans), default=0)
    return Location(len(block_hashes) * per_block, spans, costs.recompute_seconds(best), costs)
