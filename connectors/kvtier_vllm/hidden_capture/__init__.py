"""Hidden-state capture: the tail chunk a request adds, the manifests beside its states, and
reading captured states as tensors."""
