"""The encoder cache's load path at a realistic output size: one LLaVA-1.5 image's output, 576
rows of 4096 bf16 (4.5 MiB), read into vLLM's encoder cache, with no engine.

Usage: ``python -m benchmarks.encoder_loads [--quick] [--json]``

- ``kvtier_arena``: kvtier embedded, the output in the arena: leased, and read by the worker
  (`EncoderCacheWorker.load`, as for a hit).
- ``kvtier_lmdb``: a fresh arena on the lmdb the first tiers wrote it to: the scheduler side
  finds it there and reads its parts to verify them (`ItemLocator.where`), leases them in lmdb,
  and the worker reads them from lmdb's map, verified (the files in the page cache).
- ``example``: vLLM's ``ECExampleConnector``'s load of its file for the output
  (``safetensors.torch.load_file``, as its ``start_load_caches`` does; in the page cache).
- ``kvtier_lmdb_cold`` and ``example_cold``: the same with their files dropped from the page
  cache first.

Each sample is one output new to its reader, timed until every byte of it was read once (the
model reads it next; safetensors maps its file on the CPU, so its load alone reads nothing); a
case's figures are the median and the least over outputs, in ms, on this machine's CPU device
(the engines here run on it), torch on one thread as vLLM's CPU engines run.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from kvtier_vllm.encoder.item_search import LMDB, Item, ItemLocator
from kvtier_vllm.encoder.metadata import ECStepPlan, ItemSlots
from kvtier_vllm.encoder.settings import EncoderCacheConfig
from kvtier_vllm.encoder.worker import EncoderCacheWorker

from benchmarks.harness.cli import emit
from benchmarks.harness.stats import median
from benchmarks.harness.system import drop_page_cache
from kvtier.client import InProcessClient
from kvtier.core.config import load_config
from kvtier.core.encoder import PartLayout, encoder_spec, item_keys, rows_per_part
from kvtier.tiering.manager import TierManager

ROWS, WIDTH, DTYPE = 576, 4096, "bfloat16"
"""LLaVA-1.5's output for one image (a 336-pixel CLIP tower, 24 x 24 patches)."""
PART_BYTES = 256 * 1024
CASES = ("kvtier_arena", "kvtier_lmdb", "example", "kvtier_lmdb_cold", "example_cold")
TARGET = ("kvtier_lmdb", "example", 1.0)
"""kvtier's load from lmdb at most the example's load of its file."""


class Bench:
    def __init__(self, root: Path, items: int) -> None:
        self.root = root
        self.shm = Path(f"/dev/shm/kvtier-encoder-loads-{id(self)}")
        self.config = root / "kvtier.yaml"
        self.config.write_text(
            f"arena: {{path: {self.shm}, size_bytes: 512MiB, extent_bytes: 8MiB, "
            f"min_slot_bytes: 64KiB}}\nlmdb: {{path: {root / 'lmdb'}, budget_bytes: 1GiB}}\n"
        )
        width_rows = rows_per_part(WIDTH, DTYPE, PART_BYTES)
        self.spec = encoder_spec(
            model="llava-bench",
            encoder_revision="r1",
            dtype=DTYPE,
            width=WIDTH,
            rows_per_part=width_rows,
            processor="p",
        )
        self.layout = PartLayout.of(self.spec)
        self.names = [f"image-{i}" for i in range(items)]
        self.outputs = {name: torch.randn(ROWS, WIDTH, dtype=torch.bfloat16) for name in self.names}
        self.ms: dict[str, list[float]] = {case: [] for case in CASES}
        self.worker = EncoderCacheWorker(torch.device("cpu"), writes=True)

    def tiers(self) -> tuple[TierManager, InProcessClient, bytes]:
        manager = TierManager(load_config(self.config))
        client = InProcessClient(manager)
        return manager, client, client.register_pool(self.spec, self.layout.part_bytes)

    def item(self, namespace: bytes, name: str) -> Item:
        keys = item_keys(namespace, name, ROWS, self.layout)
        return Item(name, ROWS, keys, self.layout)

    def plan(self, client: InProcessClient, **lists: list[ItemSlots]) -> ECStepPlan:
        lmdb = str(client.lmdb_path or "")
        return ECStepPlan(arena_path=str(client.arena_path), lmdb_path=lmdb, **lists)

    def load(self, case: str, client: InProcessClient, slots: ItemSlots) -> None:
        """The worker's read of one hit, timed."""
        self.worker.bind(self.plan(client, loads=[slots]))
        cache: dict[str, torch.Tensor] = {}
        started = time.perf_counter()
        self.worker.load(cache)
        read(cache[slots.identifier])
        self.ms[case].append((time.perf_counter() - started) * 1000)
        report = self.worker.report()
        assert report.loaded == {slots.identifier}, "the output was not read"
        assert torch.equal(cache[slots.identifier], self.outputs[slots.identifier])
        client.release(slots.refs)

    def store_and_arena_loads(self) -> None:
        manager, client, namespace = self.tiers()
        try:
            for name in self.names:
                item = self.item(namespace, name)
                refs = client.reserve(item.keys)
                slots = ItemSlots(name, ROWS, self.layout, tuple(r for r in refs if r))
                assert len(slots.refs) == len(item.keys), "no room in the arena"
                self.worker.bind(self.plan(client, stores=[slots]))
                self.worker.save(self.outputs, name)
                self.worker.report()
                client.commit(slots.refs)
            for name in self.names:
                leased = client.lease(self.item(namespace, name).keys)
                slots = ItemSlots(name, ROWS, self.layout, tuple(r for r in leased if r))
                self.load("kvtier_arena", client, slots)
            assert manager.flush(), "the arena was not written to lmdb"
        finally:
            self.worker.close()
            manager.close()

    def lmdb_loads(self, cold: bool) -> None:
        """A fresh arena: every output is in lmdb only."""
        shutil.rmtree(self.shm, ignore_errors=True)
        self.shm.unlink(missing_ok=True)
        manager, client, namespace = self.tiers()
        locator = ItemLocator(EncoderCacheConfig(), lambda item: False, lambda: None)
        locator.connected(client)
        assert locator.lmdb_path, "lmdb cannot be read here"
        files = sorted(p for p in (self.root / "lmdb").rglob("*") if p.is_file())
        try:
            for name in self.names:
                if cold:
                    drop_page_cache(files)
                item = self.item(namespace, name)
                started = time.perf_counter()
                assert locator.where(client, item) == LMDB
                leased = client.lease(item.keys, in_lmdb=True)
                spent = time.perf_counter() - started
                slots = ItemSlots(name, ROWS, self.layout, tuple(r for r in leased if r))
                case = "kvtier_lmdb_cold" if cold else "kvtier_lmdb"
                self.load(case, client, slots)
                self.ms[case][-1] += spent * 1000  # the scheduler side's part too
        finally:
            locator.close()
            self.worker.close()
            manager.close()

    def example_loads(self) -> None:
        files = {name: self.root / "example" / f"{name}.safetensors" for name in self.names}
        files[self.names[0]].parent.mkdir()
        for name, path in files.items():
            safetensors.torch.save_file({"ec_cache": self.outputs[name]}, str(path))
        for cold in (False, True):
            for name, path in files.items():
                if cold:
                    drop_page_cache([path])
                started = time.perf_counter()
                tensor = safetensors.torch.load_file(str(path), device="cpu")["ec_cache"]
                read(tensor)
                self.ms["example_cold" if cold else "example"].append(
                    (time.perf_counter() - started) * 1000
                )
                assert torch.equal(tensor, self.outputs[name])

    def run(self) -> dict[str, Any]:
        self.store_and_arena_loads()
        self.lmdb_loads(cold=False)
        self.lmdb_loads(cold=True)
        self.example_loads()
        result: dict[str, Any] = {
            "output": f"{ROWS} x {WIDTH} {DTYPE}",
            "output_MiB": ROWS * WIDTH * 2 / 2**20,
            "items": len(self.names),
            "median_ms": {case: round(median(ms), 3) for case, ms in self.ms.items()},
            "min_ms": {case: round(min(ms), 3) for case, ms in self.ms.items()},
        }
        num, den, bound = TARGET
        ratio = result["median_ms"][num] / result["median_ms"][den]
        result["lmdb_vs_example"] = round(ratio, 3)
        result["target_met"] = ratio <= bound
        return result

    def close(self) -> None:
        self.shm.unlink(missing_ok=True)


def read(tensor: torch.Tensor) -> None:
    """Every byte of a loaded output read once, as the model reads it next: a load that maps
    its file (safetensors on the CPU) pays its reads here rather than in the load. A maximum
    reads at memory speed (0.2 ms for 4.5 MiB here), where torch's sum of bytes took 15 to 19
    ms, most of every case's figure."""
    tensor.view(torch.uint8).max()


def table(result: dict[str, Any]) -> str:
    lines = [
        f"encoder output {result['output']} ({result['output_MiB']:.1f} MiB), "
        f"{result['items']} outputs, ms per load",
        f"{'case':<20}{'median':>10}{'min':>10}",
    ]
    lines += [
        f"{case:<20}{ms:>10.3f}{result['min_ms'][case]:>10.3f}"
        for case, ms in result["median_ms"].items()
    ]
    verdict = "met" if result["target_met"] else "MISSED"
    lines.append(f"kvtier_lmdb / example = {result['lmdb_vs_example']} (<= 1.0: {verdict})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as vLLM's CPU engines run (its threads bound to their cores)
    with tempfile.TemporaryDirectory(prefix="kvtier-encoder-loads-") as tmp:
        bench = Bench(Path(tmp), 8 if args.quick else 16)
        try:
            result = bench.run()
        finally:
            bench.close()
    emit(result, args.json, lambda: table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
