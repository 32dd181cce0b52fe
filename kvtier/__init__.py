"""kvtier: tiered KV-cache offload for vLLM."""
