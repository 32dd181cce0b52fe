"""Time to first token of image requests with kvtier's encoder cache (``KVTierECConnector``),
against running the encoder, vLLM's in-engine encoder cache and vLLM's ``ECExampleConnector``.

Usage: ``python -m benchmarks.encoder [--quick] [--json] [--cache-dir DIR]``

The model is a random-weight Idefics3 built locally into ``--cache-dir``
(tests/fixtures/vision_models.py, ``BENCHMARK_VISION``: a 448-pixel, 6-layer vision tower of hidden
384 whose 256 output rows feed a 2-layer text model of hidden 128, fp32); nothing is downloaded.
Engines are in-process, eager, prefix caching on, one at a time (vLLM's worker-side encoder
connector is global). A TTFT is the wall time of one ``llm.generate()`` with ``max_tokens=1``.
Each request puts one image after a question no other request asked, so vLLM's prefix cache
never covers the image; before each, vLLM's multimodal processor cache is emptied, so that every
case, in fresh engines as in warm ones, pays the same preprocessing. Each engine's first two
images are an untimed warm-up down the path of its timed ones.

- ``encoder_run``: no connector, an image new to the engine: the encoder runs.
- ``in_engine_hit``: right after, the same image again in that engine: vLLM's own encoder cache
  (the floor). ``encoder_share``: the median over images of (encoder_run - in_engine_hit) /
  encoder_run, two requests alike but for the encoder: its part of a cold TTFT, which must be at
  least 0.5 for the other figures to mean anything.
- ``kvtier_miss``: kvtier embedded (arena and lmdb in the engine process), an image it never
  saw: the encoder runs and its output is stored. Against ``encoder_run``.
- ``kvtier_arena_hit``: right after each miss, in that engine, vLLM's encoder cache emptied
  (``reset_encoder_cache``), the same image again: served from kvtier's arena (in one engine: a
  fresh one would need kvtierd in sidecar mode, for the same read of arena slots).
- ``kvtier_lmdb_cold_hit``: a fresh embedded engine with a new arena on the lmdb the last
  kvtier engine wrote its arena to as it shut down; before each request the page cache is
  dropped for the lmdb files (``posix_fadvise(DONTNEED)``: dropping every cache would fault the
  engine's own code and weights back in too): kvtier loads the image's output straight from
  lmdb's map (``lmdb_loads``), its parts verified as the scheduler side finds them and as the
  worker reads them.
- ``example_connector_hit``: ``ECExampleConnector``; one engine stores the images first, then
  fresh ones load them from its files (in the page cache), vLLM's encoder cache emptied first;
  ``example_connector_cold_hit``: the same with its files dropped from the page cache, the
  match of ``kvtier_lmdb_cold_hit``.

The four timed engines run in passes, every other one in reverse order (ABBA: the machine is
noisy), each on new images. Each sample's path is checked: no prefix-cache tokens; a new entry
in vLLM's encoder cache for a run, none for an in-engine hit; kvtier's scheduler counters (a
hit; a load from lmdb's map for lmdb); ``has_cache_item`` for ECExampleConnector. The targets
are ratios of medians; missing one is printed, never an error.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness.buffers import no_gc
from benchmarks.harness.cli import MODEL_CACHE, emit
from benchmarks.harness.sizes import KiB
from benchmarks.harness.stats import median
from benchmarks.harness.system import PAGE, CpuShare, drop_page_cache, resident
from benchmarks.harness.targets import met, ok_or_missed
from tests.fixtures import engines, models
from tests.fixtures import vision_models as vision

log = logging.getLogger("kvtier.bench")

VISION = vision.BENCHMARK_VISION
SIDE = VISION.image_size  # the processor keeps it as it is
MAX_MODEL_LEN = 4096
WARMUP = 2
"""Untimed requests that start each engine."""
QUESTION_WORDS = 8
MIN_ENCODER_SHARE = 0.5
ARENA = {"size_bytes": "256MiB", "extent_bytes": "2MiB", "min_slot_bytes": "4KiB"}
EXAMPLE = "example_connector_hit"
EXAMPLE_COLD = "example_connector_cold_hit"
CASES = ("encoder_run", "in_engine_hit", "kvtier_miss", "kvtier_arena_hit", "kvtier_lmdb_cold_hit")
TARGETS: dict[str, tuple[str, str, float]] = {
    "ec_arena_hit_vs_in_engine_hit": ("kvtier_arena_hit", "in_engine_hit", 1.2),
    "ec_arena_hit_vs_example_connector": ("kvtier_arena_hit", EXAMPLE, 0.8),
    # both read from disk: the page cache dropped for their files
    "ec_lmdb_cold_hit_vs_example_connector": ("kvtier_lmdb_cold_hit", EXAMPLE_COLD, 1.0),
    "ec_miss_overhead": ("kvtier_miss", "encoder_run", 1.02),
}


@dataclass(frozen=True)
class Mode:
    name: str
    images: int
    """Timed images of each engine."""
    passes: int


QUICK = Mode("quick", 5, 2)
FULL = Mode("full", 8, 4)


def p90(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


@dataclass
class Case:
    name: str
    ms: list[float] = field(default_factory=list)
    wrong: int = 0
    """Samples that did not take the path the case names."""

    def add(self, ms: float, ok: bool) -> None:
        self.ms.append(ms)
        if not ok:
            self.wrong += 1
            log.warning("%s: sample %d did not take its path", self.name, len(self.ms))

    def summary(self) -> dict[str, Any]:
        return {
            "median_ms": median(self.ms),
            "p90_ms": p90(self.ms),
            "n": len(self.ms),
            "ms_each": [round(v, 2) for v in self.ms],
            "path_ok": self.wrong == 0,
        }


# -- what an engine did, read from its scheduler (single-process mode) --------------------------


def scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def encoder_entries(llm: Any) -> set[str]:
    return set(scheduler(llm).encoder_cache_manager.cached)


def kvtier_counters(llm: Any) -> tuple[int, int, int]:
    """(hits, loads from lmdb's map, stores) of kvtier's scheduler side."""
    counters = scheduler(llm).ec_connector._scheduler.counters
    return counters.hits, counters.lmdb_loads, counters.stores


def count_found(llm: Any) -> list[int]:
    """A one-item list counting the connector's ``has_cache_item`` answers of True."""
    connector = scheduler(llm).ec_connector
    asked = connector.has_cache_item
    found = [0]

    def has_cache_item(identifier: str) -> bool:
        hit = bool(asked(identifier))
        found[0] += hit
        return hit

    connector.has_cache_item = has_cache_item
    return found


def drop_files(files: list[Path]) -> str:
    """Drop ``files`` (only them: dropping every cache would fault the engine's own code and
    weights back in during the request) from the page cache; how it was done."""
    drop_page_cache(files)
    return "fadvise"


# -- the bench --------------------------------------------------------------------------------


class Bench:
    def __init__(self, mode: Mode, cache_dir: Path) -> None:
        self.mode = mode
        cache_dir.mkdir(parents=True, exist_ok=True)
        self.model = vision.build_idefics3(cache_dir, vision=VISION)
        self.root = Path(tempfile.mkdtemp(prefix="encoder-", dir=cache_dir))
        self.lmdb = self.root / "lmdb"
        self.storage = self.root / "example-connector"
        self.storage.mkdir()
        self.shm_prefix = f"/dev/shm/kvtier-encoder-{os.getpid()}"
        self.shm_paths: list[Path] = []
        self.seed = 0
        self.in_lmdb: list[int] = []
        self.in_files: list[int] = []
        self.sentences = models.english_like_text(2000, seed=23)
        self.asked = 0
        self.cases = {name: Case(name) for name in (*CASES, EXAMPLE, EXAMPLE_COLD)}
        self.shares: list[float] = []
        self.engine_starts: list[float] = []
        self.drop_method = ""
        self.read_in: list[int] = []
        self.resident_before: list[float] = []

    def new_images(self) -> list[int]:
        """Seeds of images no engine saw yet, enough for one engine."""
        self.seed += WARMUP + self.mode.images
        return list(range(self.seed - WARMUP - self.mode.images, self.seed))

    def question(self) -> str:
        """A question no earlier request asked: its first tokens already differ."""
        self.asked += 1
        words = self.sentences[self.asked % len(self.sentences)].split()[:QUESTION_WORDS]
        return f"{self.asked} {' '.join(words)}"

    def kvtier(self, name: str) -> dict[str, Any]:
        """KVTierECConnector embedded, with an arena of its own and the run's one lmdb."""
        shm = Path(f"{self.shm_prefix}-{name}")
        self.shm_paths.append(shm)
        config = self.root / f"kvtier-{name}.yaml"
        arena = {"path": str(shm), **ARENA}
        lmdb = {"path": str(self.lmdb), "budget_bytes": "512MiB"}
        config.write_text(yaml.safe_dump({"arena": arena, "lmdb": lmdb}))
        return {
            "ec_connector": "KVTierECConnector",
            "ec_connector_module_path": "kvtier_vllm.ec_connector",
            "ec_role": "ec_both",
            # every hit served as one: a sampled hit would run the encoder
            "ec_connector_extra_config": {"kvtier_config": str(config), "verify_sample_rate": 0},
        }

    def example(self) -> dict[str, Any]:
        return {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_both",
            "ec_connector_extra_config": {"shared_storage_path": str(self.storage)},
        }

    @contextlib.contextmanager
    def engine(self, ec: dict[str, Any] | None = None) -> Iterator[Any]:
        started = time.perf_counter()
        llm = engines.make_llm(
            self.model,
            max_model_len=MAX_MODEL_LEN,
            limit_mm_per_prompt={"image": 1},
            ec_transfer_config=ec,
        )
        self.engine_starts.append(time.perf_counter() - started)
        try:
            yield llm
        finally:
            engines.shutdown_llm(llm)
            del llm
            gc.collect()

    def ask(self, llm: Any, seed: int, *, forget: bool = False) -> tuple[float, int]:
        """TTFT in ms of one image request, and its prefix-cache tokens. ``forget``: empty
        vLLM's encoder cache first."""
        llm.reset_mm_cache()
        if forget:
            llm.llm_engine.reset_encoder_cache()
        request = {
            "prompt": vision.image_prompt(self.question()),
            "multi_modal_data": {"image": vision.colour_blocks(seed, SIDE)},
        }
        params = engines.greedy(1)
        with no_gc():
            start = time.perf_counter()
            out = llm.generate([request], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
        return elapsed * 1e3, out[0].num_cached_tokens or 0

    # -- cases ------------------------------------------------------------------------------

    def vllm_alone(self) -> None:
        run, hit = self.cases["encoder_run"], self.cases["in_engine_hit"]
        with self.engine() as llm:
            for k, seed in enumerate(self.new_images()):
                before = encoder_entries(llm)
                cold_ms, cached = self.ask(llm, seed)
                ran = encoder_entries(llm) - before
                hit_ms, hit_cached = self.ask(llm, seed)
                if k >= WARMUP:
                    run.add(cold_ms, cached == 0 and len(ran) == 1)
                    hit.add(hit_ms, hit_cached == 0 and not encoder_entries(llm) - before - ran)
                    self.shares.append((cold_ms - hit_ms) / cold_ms)

    def kvtier_store(self) -> None:
        miss, arena = self.cases["kvtier_miss"], self.cases["kvtier_arena_hit"]
        self.in_lmdb = self.new_images()
        with self.engine(self.kvtier(f"store{self.seed}")) as llm:
            for k, seed in enumerate(self.in_lmdb):
                hits, _, stores = kvtier_counters(llm)
                miss_ms, cached = self.ask(llm, seed)
                after = kvtier_counters(llm)
                hit_ms, hit_cached = self.ask(llm, seed, forget=True)
                again = kvtier_counters(llm)
                if k >= WARMUP:
                    miss.add(miss_ms, cached == 0 and after[0] == hits and after[2] > stores)
                    ok = hit_cached == 0 and again[0] > after[0] and again[1] == after[1]
                    arena.add(hit_ms, ok)
        # the arena went to lmdb as the engine shut down

    def lmdb_load(self) -> None:
        case = self.cases["kvtier_lmdb_cold_hit"]
        files = sorted(p for p in self.lmdb.rglob("*") if p.is_file())
        with self.engine(self.kvtier(f"load{self.seed}-{len(case.ms)}")) as llm:
            for k, seed in enumerate(self.in_lmdb):
                self.drop_method = drop_files(files)
                in_cache, pages = resident(files)
                hits, from_lmdb, _ = kvtier_counters(llm)
                ms, cached = self.ask(llm, seed, forget=True)
                now = kvtier_counters(llm)
                if k >= WARMUP:
                    case.add(ms, cached == 0 and now[0] > hits and now[1] > from_lmdb)
                    self.resident_before.append(in_cache / pages if pages else 0.0)
                    self.read_in.append(max(0, resident(files)[0] - in_cache) * PAGE)

    def example_store(self) -> None:
        self.in_files = self.new_images()
        with self.engine(self.example()) as llm:
            for seed in self.in_files:
                self.ask(llm, seed)

    def example_load(self) -> None:
        warm, cold = self.cases[EXAMPLE], self.cases[EXAMPLE_COLD]
        with self.engine(self.example()) as llm:
            found = count_found(llm)
            for k, seed in enumerate(self.in_files):
                before = found[0]
                ms, cached = self.ask(llm, seed, forget=True)
                if k >= WARMUP:
                    warm.add(ms, cached == 0 and found[0] > before)
                drop_files(sorted(p for p in self.storage.rglob("*") if p.is_file()))
                before = found[0]
                ms, cached = self.ask(llm, seed, forget=True)
                if k >= WARMUP:
                    cold.add(ms, cached == 0 and found[0] > before)

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        others = CpuShare()
        self.example_store()
        order = [self.vllm_alone, self.kvtier_store, self.lmdb_load, self.example_load]
        for n in range(self.mode.passes):
            for case in order if n % 2 == 0 else order[::-1]:
                case()
        cases = {name: case.summary() for name, case in self.cases.items()}
        result: dict[str, Any] = {
            "mode": self.mode.name,
            "model": self.model.name,
            "encoder_rows": VISION.embeds,
            "images_per_engine": self.mode.images,
            "passes": self.mode.passes,
            "cases": cases,
            "encoder_share": median(self.shares),
            "encoder_share_each": [round(s, 3) for s in self.shares],
            "encoder_share_ok": median(self.shares) >= MIN_ENCODER_SHARE,
            "lmdb_page_cache_drop": self.drop_method,
            "lmdb_read_in_kib": [n // KiB for n in self.read_in],
            "lmdb_resident_before_load": [round(r, 4) for r in self.resident_before],
            "engine_start_s": [round(s, 2) for s in self.engine_starts],
            "elapsed_s": round(time.perf_counter() - started, 1),
            "other_processes_cpu_share": round(others.others(), 3),
        }
        for key, (num, den, _) in TARGETS.items():
            result[key] = cases[num]["median_ms"] / cases[den]["median_ms"]
        result["targets_met"] = {
            k: met(result[k], "<=", bound) for k, (_, _, bound) in TARGETS.items()
        }
        return result

    def close(self) -> None:
        for path in self.shm_paths:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


# -- output -----------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> str:
    lines = [
        f"kvtier encoder cache TTFT, {result['mode']} mode: {result['model']} "
        f"({result['encoder_rows']} encoder rows an image), {result['passes']} passes of "
        f"{result['images_per_engine']} images an engine, ms",
        f"{'case':26}{'median':>9}{'p90':>9}{'n':>4}  path",
        "-" * 56,
    ]
    for name, case in result["cases"].items():
        verdict = "ok" if case["path_ok"] else "WRONG"
        lines.append(
            f"{name:26}{case['median_ms']:9.1f}{case['p90_ms']:9.1f}{case['n']:4}  {verdict}"
        )
    lines.append("")
    share = result["encoder_share"]
    lines.append(
        f"{'encoder_share':40}{share:8.3f}  >= {MIN_ENCODER_SHARE:g}  "
        f"{'ok' if result['encoder_share_ok'] else 'TOO LOW'}"
    )
    for key, (_, _, bound) in TARGETS.items():
        verdict = ok_or_missed(result["targets_met"][key])
        lines.append(f"{key:40}{result[key]:8.3f}  <= {bound:g}  {verdict}")
    lines.append("")
    read_in = result["lmdb_read_in_kib"]
    lines.append(
        f"lmdb cold loads: page cache dropped by {result['lmdb_page_cache_drop']}; read in "
        f"{median(read_in):.0f} KiB a load (median); lmdb resident before a load "
        f"{median(result['lmdb_resident_before_load']):.1%} (median)"
    )
    starts = result["engine_start_s"]
    other = result["other_processes_cpu_share"]
    lines.append(
        f"engines: {len(starts)}, start {median(starts):.1f} s median; other processes used "
        f"{other:.0%} of the CPUs{' (figures disturbed)' if other > 0.1 else ''}; "
        f"elapsed: {result['elapsed_s']:.1f} s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer images and passes")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=MODEL_CACHE,
        help="where the model is built and the run's files go (a disk-backed file system)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    logging.getLogger("kvtier").setLevel(logging.WARNING)
    logging.getLogger("kvtier_vllm").setLevel(logging.WARNING)
    log.setLevel(logging.INFO)
    # vLLM reads these when first imported; on CPU it warns on every request at WARNING
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    bench = Bench(QUICK if args.quick else FULL, args.cache_dir)
    try:
        engines.apply_engine_env(engines.engine_env(bench.root / "engine"))
        result = bench.run()
    finally:
        bench.close()
    if not result["encoder_share_ok"]:
        print(
            f"warning: the encoder is only {result['encoder_share']:.0%} of a cold TTFT "
            f"(want >= {MIN_ENCODER_SHARE:.0%}): the hit figures say little",
            file=sys.stderr,
        )
    emit(result, args.json, lambda: table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
