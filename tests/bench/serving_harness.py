"""The serving benchmark's servers (benchmarks/serving_servers.py) on the GPU-ratio model, sized
small, for tests of the harness itself: nothing is started until a test asks."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.sizes import KiB, MiB
from benchmarks.models import GPU_RATIO
from benchmarks.serving_servers import Servers


def small_servers(root: Path) -> Servers:
    return Servers(
        root,
        root / "model",
        root / "draft",
        sizes=GPU_RATIO,
        blocks_per_chunk=4,
        chunk_bytes=64 * 16 * KiB,
        working_set_bytes=16 * MiB,
        kv_per_token=16 * KiB,
        hidden_per_token=0,
        connector_extra={},
    )
