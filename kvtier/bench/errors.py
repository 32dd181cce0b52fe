"""The error `kvtier bench` raises for bad input: the CLI prints its message on one line."""

from __future__ import annotations

from kvtier.core.errors import KVTierError


class BenchError(KVTierError):
    """The server cannot be benchmarked as asked (unreachable, too small, wrong answers)."""
