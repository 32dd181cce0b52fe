"""The KV connector's worker side: copies between vLLM's KV pages and the arena, lmdb and the stores
in flight."""
