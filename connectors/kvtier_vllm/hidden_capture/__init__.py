"""Hidden-state capture: the tail chunk a request adds, fp8 storage, and reading captured states
as tensors."""
