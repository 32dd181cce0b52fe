"""What the KV and encoder-cache connectors share: their settings, the session with the tiers,
the guard around vLLM's hooks, the build check, the copies between vLLM's memory and the arena,
model weight identity, parallel shapes, and `vllm_compat`, the one module that imports vLLM."""
