"""What routers are told: the object tier's KV events in vLLM's encoding, and their publisher."""
