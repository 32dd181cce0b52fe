"""kvtier as a hidden-states backend for Speculators (``hs-connectors``): importing it registers
`KVTierHiddenStates` under the name ``kvtier``. It uses kvtier's public surface (the clients and
`kvtier.hidden`), torch and ``hs_connectors``; never vLLM."""

from kvtier_speculators.backend import NAME, KVTierBackend
from kvtier_speculators.transfer import KVTierHiddenStates

__all__ = ["NAME", "KVTierBackend", "KVTierHiddenStates"]
