"""Verification of a state-pool chunk: its page compared with the state vLLM computed in its
place, tensor by tensor (`states.StateShape.parts`: a conv state, a recurrent state, each in
its own dtype).

A page mixes dtypes (a bf16 conv state beside an fp32 recurrent one), so no single view of its
bytes compares it: each part is read in its own dtype, and its error is the norm of the
difference over the norm of the recomputed part, as for attention KV. Part by part, so that a
small conv state is not hidden under a large recurrent state's norm. The chunk's error is its
worst part's, held to ``verify_max_error`` like any chunk's.

Why no tighter bound for an fp32 part: recomputed on the CPU, the test models' states (a gated
delta net's bf16 conv and fp32 recurrent state, a Mamba-2's fp32 ones) are bit-equal to the
stored ones, but on a device a recomputation in another batch rounds the state's inputs at the
model's dtype (bf16) in another order, and a recurrent state sums them along the whole
sequence: its error grows with the prefix, so its fp32 storage says nothing about how close a
right state is. A wrong one (another prefix's, other weights') is off by about its whole norm
(measured: 1.3 to 1.6), a flipped exponent bit by far more; a value that is not finite by
infinity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtier_vllm.layout.states import StateShape


@dataclass(frozen=True, slots=True)
class StatePart:
    start: int
    """The part's first byte in a page."""
    nbytes: int
    dtype: torch.dtype


class StateCompare:
    """Compares a state pool's pages with the state vLLM computed, part by part."""

    def __init__(self, shape: StateShape) -> None:
        self.parts = tuple(
            StatePart(start, nbytes, getattr(torch, dtype))
            for start, nbytes, dtype in shape.parts()
        )

    def errors(self, kept: torch.Tensor, computed: torch.Tensor) -> list[float]:
        """Each part's relative error over the pages of ``kept`` and ``computed`` (bytes whose
        last axis is a page, as many pages each)."""
        kept = kept.reshape(-1, kept.shape[-1])
        computed = computed.reshape(-1, computed.shape[-1])
        out = []
        for part in self.parts:
            at = slice(part.start, part.start + part.nbytes)
            ours = kept[:, at].contiguous().view(part.dtype).double()
            theirs = computed[:, at].contiguous().view(part.dtype).double()
            diff = float(torch.sum((ours - theirs) ** 2))
            norm = float(torch.sum(theirs**2))
            error = (diff / norm) ** 0.5 if norm else (0.0 if diff == 0 else math.inf)
            out.append(error if math.isfinite(error) else math.inf)  # NaN too: never a match
        return out

    def error(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The chunk's error from its (arena, pages) pairs, one per layer: the worst part's."""
        return max(
            (max(self.errors(arena.to(pages.device), pages)) for arena, pages in pairs),
            default=0.0,
        )
