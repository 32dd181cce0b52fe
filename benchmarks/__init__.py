"""kvtier's benchmarks, each run from the repository's root as ``python -m benchmarks.<name>``:
its cases in one module, on the shared pieces of `benchmarks.harness` and `tests.fixtures`."""
