"""What the KV and encoder-cache connectors share: their settings, the session with the tiers,
the guard around vLLM's hooks, the build check, the copies between vLLM's memory and the arena,
model weight identity, parallel shapes, the tiers' calls as the parts beside a connector reach
them (`tier_access`), and `vllm_compat`, the one module that imports vLLM."""
