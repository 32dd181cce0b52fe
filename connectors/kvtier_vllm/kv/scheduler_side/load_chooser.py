"""How much of a hit to load: the seam a policy plugs into (`LoadChooser`), the hit's chunks as
runs of one tier (`tier_runs`), and the default, which loads the whole hit (`WholeHit`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvtier.core.load_choice import LoadChoice, whole_hit
from kvtier.core.protocol import TierCode


class LoadChooser(Protocol):
    """Chooses how many tokens of a hit's prefix to load; vLLM computes the rest. A shorter
    prefix may be chosen over a longer one that is slower to load than to compute."""

    def choose(self, runs: Sequence[tuple[str, int]], chunk_tokens: int) -> LoadChoice:
        """Of the hit ``runs`` (in prefix order, consecutive chunks of one tier: its name as
        `TierCode.tier` says it, and how many), the tokens to load from its first chunk on
        (rounded down to whole chunks of ``chunk_tokens``) and each run's choice."""
        ...

    def count(self, choice: LoadChoice) -> None:
        """Counts a request's choice, once: when its plan is final (a request waiting for its
        promotions is asked again, and may be chosen for again, before that)."""
        ...


class WholeHit:
    """Loads every chunk of the hit; counts nothing."""

    def choose(self, runs: Sequence[tuple[str, int]], chunk_tokens: int) -> LoadChoice:
        return whole_hit(runs, chunk_tokens)

    def count(self, choice: LoadChoice) -> None:
        pass


def tier_runs(tier_codes: bytes) -> list[tuple[str, int]]:
    """``tier_codes`` (one `TierCode` a chunk) as runs of consecutive chunks of one tier."""
    runs: list[tuple[str, int]] = []
    for code in tier_codes:
        tier = TierCode(code).tier
        if runs and runs[-1][0] == tier:
            runs[-1] = (tier, runs[-1][1] + 1)
        else:
            runs.append((tier, 1))
    return runs


def chosen_chunks(choice: LoadChoice, tier_codes: bytes, chunk_tokens: int) -> int:
    """The chunks of a hit (``tier_codes``: one a chunk) ``choice`` loads, from its first."""
    return max(0, min(len(tier_codes), choice.tokens // chunk_tokens))
