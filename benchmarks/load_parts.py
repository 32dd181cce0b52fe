"""Where an lmdb load's CPU time goes: one hit of ``--chunks`` chunks (28 by default) at the
GPU-ratio model's shape (`tests.fixtures.models.GPU_RATIO_SHAPE`: 16 KiB of KV a token, 64-token
chunks), held in lmdb only (its files in the page cache), loaded as the connector loads it.

Usage: ``python -m benchmarks.load_parts [--chunks N] [--repeats N] [--json]``

Parts, each timed over the whole hit, in ms (the median over ``--repeats`` hits new to the
reader, and the least):

- ``lookup``: the scheduler's lookup of the hit's keys.
- ``lease``: their leases in lmdb (``in_lmdb``), as a load leases them.
- ``in_place``: what the CPU worker does: in one read transaction, each chunk verified in
  lmdb's map and copied from there into vLLM's pages (`LmdbStaging.holding`, ``stage`` with
  copies done once issued): one tensor of pages, a ``copy_`` a run of blocks (the blocks here
  are every other one, so a run is one block).
- ``staging``: each chunk read from lmdb's map into a buffer of its own, verified and decoded
  (`LmdbStaging.stage` with no copies); of it, ``verification`` (the payload's checksum alone)
  and ``decode`` (the bytes' copy alone, with no checksum).
- ``copy``: each staged chunk copied into the pages as ``in_place`` copies.
- ``load``: ``lookup``, ``lease`` and ``in_place``: the whole load.

torch runs on one thread, as vLLM's CPU engines run.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from kvtier_vllm.kv.lmdb_staging import LmdbStaging
from kvtier_vllm.kv.metadata import ChunkCopy
from kvtier_vllm.shared.copies import CpuCopies

from benchmarks.harness.cli import emit
from benchmarks.harness.stats import median
from kvtier.client import InProcessClient, LmdbReader, reader_at
from kvtier.core.blockfmt import HEADER_SIZE
from kvtier.core.config import from_mapping
from kvtier.core.keys import NamespaceSpec, PageLayout, Pool
from kvtier.tiering.manager import TierManager
from tests.fixtures.keys import keys_for
from tests.fixtures.models import GPU_RATIO_SHAPE

TOKENS_PER_CHUNK = 64
BLOCK_TOKENS = 16
PARTS = ("lookup", "lease", "in_place", "staging", "verification", "decode", "copy", "load")


def spec() -> NamespaceSpec:
    """The GPU-ratio model's target pool."""
    s = GPU_RATIO_SHAPE
    layout = PageLayout(
        tokens_per_block=BLOCK_TOKENS,
        blocks_per_chunk=TOKENS_PER_CHUNK // BLOCK_TOKENS,
        num_kv_heads=s["kv_heads"],
        head_sizes=(s["head_dim"], s["head_dim"]),
        layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(s["layers"])),
    )
    return NamespaceSpec("bench-gpu-ratio", "r1", Pool.TARGET, s["dtype"], layout)


def chunk_bytes() -> int:
    """One chunk's KV at the GPU-ratio shape: K and V of every layer, fp32."""
    s = GPU_RATIO_SHAPE
    return 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * 4 * TOKENS_PER_CHUNK


class Bench:
    def __init__(self, root: Path, chunks: int) -> None:
        self.shm = Path(f"/dev/shm/kvtier-load-parts-{id(self)}")
        self.nbytes = chunk_bytes()
        config = from_mapping(
            {
                "arena": {"path": str(self.shm), "size_bytes": 256 << 20, "extent_bytes": 8 << 20},
                "lmdb": {"path": str(root / "lmdb"), "budget_bytes": 2 << 30},
            }
        )
        self.manager = TierManager(config)
        self.client = InProcessClient(self.manager, "r0")
        self.namespace = self.client.register_pool(spec(), self.nbytes)
        self.chunks = chunks
        self.staging = LmdbStaging()
        self.lmdb_path = str(self.client.lmdb_path)
        # vLLM's pages: one tensor a pool, [blocks, block bytes], a chunk's blocks scattered
        blocks_per_chunk = TOKENS_PER_CHUNK // BLOCK_TOKENS
        self.block_bytes = self.nbytes // blocks_per_chunk
        self.pages = torch.empty(
            4 * chunks * blocks_per_chunk + 1, self.block_bytes, dtype=torch.uint8
        )
        self.blocks_per_chunk = blocks_per_chunk

    def stored_hit(self, start: int) -> list[bytes]:
        """A hit new to the reader: ``chunks`` chunks written to lmdb, none in the arena."""
        keys = keys_for(self.namespace, self.chunks, start=start)
        refs = [r for r in self.client.reserve(keys) if r is not None]
        for ref in refs:
            self.manager.cpu.view(ref)[:] = (
                torch.randint(0, 255, (ref.nbytes,), dtype=torch.uint8).numpy().data
            )
        assert self.client.commit(refs) == len(keys)
        assert self.client.flush()
        self.manager.evict("cpu", namespace=self.namespace)
        return keys

    def load(self, keys: list[bytes]) -> dict[str, float]:
        ms: dict[str, float] = {}
        timed = _timer(ms)
        with timed("lookup"):
            found = self.client.lookup(keys)
        assert found.hits == len(keys)
        with timed("lease"):
            refs = self.client.lease(keys, in_lmdb=True)
        jobs = [
            ChunkCopy("target", 0, 0, 0, self._blocks(i), request="r", key=bytes(key))
            for i, key in enumerate(keys)
        ]
        copies = CpuCopies()
        with timed("in_place"), self.staging.holding(copies):
            for job in jobs:
                chunk = self.staging.stage(self.lmdb_path, job, self.nbytes, copies)
                assert chunk is not None
                self._copy(job, chunk)
        with timed("staging"):
            staged = [self.staging.stage(self.lmdb_path, job, self.nbytes) for job in jobs]
        assert all(s is not None for s in staged)
        reader = reader_at(Path(self.lmdb_path))
        values = [bytes(v) for v in _values(reader, keys)]
        with timed("verification"):
            for value in values:
                xxhash.xxh3_128_digest(memoryview(value)[HEADER_SIZE:])
        with timed("decode"):
            for value in values:
                torch.empty(self.nbytes, dtype=torch.uint8).numpy().data[:] = memoryview(value)[
                    HEADER_SIZE:
                ]
        with timed("copy"):
            for job, chunk in zip(jobs, staged, strict=True):
                assert chunk is not None
                self._copy(job, chunk)
        self.client.release([r for r in refs if r is not None])
        ms["load"] = ms["lookup"] + ms["lease"] + ms["in_place"]
        return ms

    def _copy(self, job: ChunkCopy, chunk: torch.Tensor) -> None:
        blocks = chunk.view(self.blocks_per_chunk, -1)
        for i, block in enumerate(job.block_ids):  # a copy a run: here, each block
            self.pages[block].copy_(blocks[i])

    def _blocks(self, chunk: int) -> tuple[int, ...]:
        # every other block, as a busy engine's free list hands them out
        first = 1 + 2 * chunk * self.blocks_per_chunk
        return tuple(range(first, first + 2 * self.blocks_per_chunk, 2))

    def close(self) -> None:
        self.staging.close()
        self.client.close()
        self.shm.unlink(missing_ok=True)


def _values(reader: LmdbReader, keys: list[bytes]) -> list[bytes]:
    with reader.begin() as txn:
        return [bytes(txn.get(key)) for key in keys]


def _timer(ms: dict[str, float]) -> Callable[[str], _Timed]:
    return lambda part: _Timed(ms, part)


class _Timed:
    def __init__(self, ms: dict[str, float], part: str) -> None:
        self.ms, self.part = ms, part

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.ms[self.part] = (time.perf_counter() - self.started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="kvt-load-parts-"))
    bench = Bench(root, args.chunks)
    samples: dict[str, list[float]] = {part: [] for part in PARTS}
    try:
        for repeat in range(args.repeats):
            ms = bench.load(bench.stored_hit(repeat * args.chunks))
            for part in PARTS:
                samples[part].append(ms[part])
    finally:
        bench.close()
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "chunks": args.chunks,
        "chunk_kib": chunk_bytes() >> 10,
        "ms": {part: {"median": median(v), "least": min(v)} for part, v in samples.items()},
    }

    def table() -> str:
        lines = [f"{args.chunks}-chunk lmdb load, {chunk_bytes() >> 10} KiB a chunk (ms)"]
        lines.append(f"{'part':<14}{'median':>9}{'least':>9}")
        for part, v in result["ms"].items():  # type: ignore[attr-defined]
            lines.append(f"{part:<14}{v['median']:>9.2f}{v['least']:>9.2f}")
        return "\n".join(lines)

    emit(result, args.json, table)


if __name__ == "__main__":
    main()
