"""Generated gRPC stubs (see scripts/gen_protos.py)."""
