"""kvtier: tiered KV-cache offload for vLLM."""

from kvtier._version import __version__

__all__ = ["__version__"]
