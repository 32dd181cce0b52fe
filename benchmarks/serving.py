"""Whole-server throughput and TTFT: vLLM alone against kvtier and vLLM's own connectors.

Usage: ``python -m benchmarks.serving [--quick] [--json] [--profile] [--blocks-per-chunk N]``
``[--concurrency 1,2,4,8] [--servers NAME,...] [--connector-extra JSON] [--cache-dir DIR]``
``[--docs DIR] [--keep]``

Every server is a real ``python -m vllm.entrypoints.openai.api_server`` process
(tests/fixtures/servers.py) serving the locally built 12-layer model (tests/fixtures/models.py,
``build_benchmark_llama``: hidden 768, 8 heads, 4 KV heads, head_dim 64, bf16, random weights;
nothing is downloaded). Every server gets the same settings: a 48 MiB KV cache
(``--kv-cache-memory-bytes``, with ``VLLM_CPU_KVCACHE_SPACE`` unset: 4,096 tokens of the 12
layers, 127 blocks of 32 usable; 3,744 tokens when a 1-layer draft keeps its KV beside them),
``--max-model-len 3744`` (what the cache holds in both cases), block size 32, eager mode, prefix
caching on, ``--enable-prompt-tokens-details``,
and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (otherwise a server with a connector gets a second
compute thread that vLLM alone does not). Servers run one at a time, except in the no-reuse
phase; each is stopped (SIGTERM to its process group, SIGKILL after 20 s) before the next
starts. Their logs go to files under the
run's directory; a server that fails to start is reported with its log's error line and tail,
and the run goes on with the others.

Servers (``servers`` in the output):

- ``vllm``: vLLM alone.
- ``kvtier_embedded``: ``KVTierConnector`` with the tiers in the engine process (a new arena in
  /dev/shm and a new LMDB environment). ``kvtier_sidecar``: the connector in sidecar mode
  against a real kvtierd (``python -m kvtier.cli serve --config FILE``, started fresh for that
  server, its metrics scraped as ``kvtier_metrics_url``). Both store chunks of
  ``--blocks-per-chunk`` blocks (default 4: 128 tokens) in a 768 MiB arena backed by a 1 GiB
  LMDB budget, and run with ``kv_load_failure_policy: recompute`` (kvtier's advice). Each
  server's stored KV is deleted when it stops, so no run fills the disk; the run's directory
  (logs, traces) is deleted at the end unless ``--keep``.
- ``example_connector``: vLLM's ``ExampleConnector`` (safetensors files per request).
- ``offloading_connector``: vLLM's native ``OffloadingConnector`` (``CPUOffloadingSpec``,
  ``cpu_bytes_to_use`` = the arena size); where the CPU build refuses it, its entry holds the
  error line.
- ``vllm_spec``, ``kvtier_sidecar_spec``: vLLM alone and kvtier sidecar with speculative decoding
  (``draft_model``: the same build with 1 layer, 3 speculative tokens).
- ``kvtier_embedded_capture``: kvtier embedded with hidden states captured for draft training
  (``extract_hidden_states`` at EAGLE-3's layers 2, 6 and 9 of 12, stored in the captured
  bf16; ``--connector-extra '{"hidden_dtype": "fp8"}'`` stores them in fp8), with its KV memory
  grown by the hidden-state cache's share (0.375x) so that it holds as many tokens;
  ``capture_throughput_vs_kvtier_embedded`` is its multi-round throughput over
  ``kvtier_embedded``'s.
- Past the arena, sidecar servers whose tiers hold less than the working set (every user's
  history in chunks, ``settings.working_set_bytes``): ``kvtier_sidecar_lmdb``, an arena of a
  quarter of it (extents of 8 chunks, so that a quarter is whole extents) with lmdb (1 GiB)
  holding the rest; ``kvtier_sidecar_object``, an arena and an lmdb budget of a quarter each,
  and the object store holding everything: moto's S3 server, started for the run, reached
  through IRSA (a role and a web identity token in kvtierd's environment, no keys),
  ``object.admission: all``. ``lmdb_backed_vs_arena_backed`` (target >= 0.9) and
  ``object_backed_vs_arena_backed`` (>= 0.75) are their throughputs over ``kvtier_sidecar``'s;
  ``kvtier_sidecar_lmdb_fp8``, ``kvtier_sidecar_lmdb_i8`` and ``kvtier_sidecar_obj_fp8`` are
  the same servers with ``lmdb.codec`` (and ``object.codec``) fp8 or int8
  (``lmdb_fp8_backed_vs_arena_backed``, ``lmdb_int8_backed_vs_arena_backed``,
  ``object_fp8_backed_vs_arena_backed``);
  ``past_the_arena`` gives each one's TTFTs and kvtierd's hits by tier, and every sidecar
  server's ``daemon_counters`` are kvtierd's counters over its levels (promotions, holds,
  evictions, rejected stores).
- ``vllm_more_hbm``: vLLM alone with six times the KV cache (24,576 tokens): every user's
  history fits. A reference for what GPU memory buys, not a target:
  ``throughput_vs_more_hbm`` is ``kvtier_sidecar``'s throughput over it.

Workloads (kvtier/bench, token-exact prompts streamed to ``/v1/completions`` with
``ignore_eos``):

- multi-round: 8 users per level, each with a private document of 1,664 tokens and 4 rounds of
  a 32-token question and a 64-token answer (each round repeats the whole history): 32 requests
  per level and a working set of 8 x 2,048 = 16,384 tokens, 4x what the KV cache holds. A
  concurrency level keeps that many users in flight. The full run sweeps 1, 2, 4, 8; ``--quick``
  measures concurrency 4 only. Each server's first level is preceded by a warm-up session of its
  own context (4 requests).
- no-reuse: every prompt unique (1,696 tokens, 64 output tokens), at concurrency 4. This machine's
  speed drifts by several per cent within minutes, more than the 2 % the figure is judged by, so
  vLLM alone, kvtier embedded and kvtier sidecar are started together (fresh servers; an idle
  server takes about 1 % of a core) and measured in turn, in cycles. Each cycle measures every
  server once, in an order rotated from cycle to cycle; each of its units waits for the machine
  to be quiet (below 10 % busy for a second: the last unit's write-back is done), runs 4
  unmeasured requests, which leave a write-back backlog, then the measured level of 8. Each
  server first runs one unmeasured level. ``no_reuse_throughput_vs_vllm_alone`` is the mean over
  cycles of sidecar over vLLM alone in the same cycle (``..._embedded``: embedded mode), with
  its standard error (``no_reuse_se``); 3 cycles with ``--quick``, 12 in the full run
  (``--no-reuse-cycles``). ``vllm_b``, a second vLLM-alone server, is measured the same way:
  each server started runs at a speed of its own, and ``no_reuse_second_vllm_alone`` (one
  vLLM alone over the other) shows how far apart two identical servers are. A ratio that
  differs from 1 by less than that is within this machine's noise. What each server's speed
  does not move is kvtier's own time, read per measured level: ``no_reuse_hook_share``
  (``..._embedded``), the seconds vLLM's engine loop spent inside kvtier's hooks
  (``vllm:kvtier_hook_seconds_total``) over the level's wall time, and
  ``no_reuse_kvtierd_cpu_share``, kvtierd's CPU time (/proc) over it, a share of one core;
  ``no_reuse_kvtier_time`` holds every level's.

Figures per level: output tokens/s (all users; successful requests), output tokens/s per user
(mean over requests of output tokens over end-to-end latency), TTFT and ITL percentiles,
and hit ratios from each server's /metrics before and after the level
(``vllm:prompt_tokens_cached_by_source_total`` over ``vllm:prompt_tokens_total``; for kvtier
sidecar also kvtierd's ``kvtier_hit_chunks_total`` over ``kvtier_lookup_chunks_total``).

Headline ratios (at concurrency 4, multi-round, one run; kvtier means sidecar unless named):
``throughput_vs_vllm_alone`` (target >= 2.0), ``ttft_p50_vs_vllm_alone`` (<= 0.25),
``ttft_p99_vs_vllm_alone`` (<= 0.5), ``no_reuse_throughput_vs_vllm_alone`` and
``..._embedded`` (>= 0.98), ``spec_throughput_vs_vllm_alone_spec`` (>= 2.0),
``throughput_vs_example_connector`` (>= 1.5); ``targets`` says which were met. A user's first
round is a cold prefill for every server (a quarter of the requests), so the TTFT p99 of a
level is a cold prefill's; ``ttft_p50/p99_vs_vllm_alone_later_rounds`` compare the TTFT of the
other rounds only.

``--profile`` (and always with ``--json``): the kvtier sidecar server runs with vLLM's torch
profiler configured (``--profiler-config``, CPU activity, Python stacks, traces as JSON), and
after its measured levels one more multi-round level (4 users x 2 rounds, 8-token answers, new
contexts) is recorded between ``POST /start_profile`` and ``POST /stop_profile``. From the
worker's trace: the step time is the sum of vLLM's per-step annotations
(``execute_context_*_generation_*``, around ``model_runner.execute_model``); the model's time is
``gpu_model_runner: forward`` (``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1`` on that server);
kvtier's time is the union (nested ranges counted once) of the ``kvtier:`` ranges the connector
records, or, where the trace has none, of the Python-function
events in ``kvtier_vllm`` modules (``kvtier_ranges: "python_functions"``).
``kvtier_step_share`` is kvtier's time inside steps over step time. The worker is a separate
process from the scheduler (CPU builds run the multiprocess executor), so scheduler-side hooks
(``get_num_new_matched_tokens``, ``build_connector_meta``, ...) are not in that trace.
Python-stack tracing slows Python code more than kernels, so the share is an upper bound.

``--servers`` runs only the servers named (ratios need both of their servers);
``--connector-extra`` adds settings to every KVTierConnector configuration. The full run (all
servers) writes ``docs/serving.png`` (throughput against interactivity and TTFT against
concurrency, one curve per server) and ``docs/serving.md`` (the tables). ``--json`` prints one
JSON object on stdout; logs go to stderr. ``other_processes_cpu_share``: CPU time other
processes used during the run over the machine's capacity (the servers' engine processes count
as others until they are reaped): on a shared machine every figure is only as good as that is
low.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import boto3.session
import yaml

from benchmarks.harness.connector import kvtier_connector
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import GiB, KiB, MiB, extent_for
from benchmarks.harness.system import CpuShare, process_cpu_seconds, wait_until_quiet
from benchmarks.harness.targets import Target
from benchmarks.harness.targets import met as targets_met
from kvtier.bench import BenchConfig, BenchError, LevelResult, WorkloadSpec, run_level
from kvtier.bench.stats import Percentiles
from kvtier.bench.trace import load_trace, step_shares
from tests.fixtures import engines, models
from tests.fixtures.s3 import SCRUBBED_ENV, MotoServer, irsa_env, patched_env
from tests.fixtures.servers import ServerError, VllmServer, connector_arg, error_line, log_tail

log = logging.getLogger("kvtier.bench.serving")

ROOT = Path(__file__).resolve().parents[1]
KV_CACHE_BYTES = 48 * MiB
MAX_MODEL_LEN = 3744  # what 48 MiB holds with the draft's layer beside the target's 12
BLOCK_SIZE = 32
DOC_TOKENS = 1664
QUESTION_TOKENS = 32
ANSWER_TOKENS = 64
ROUNDS = 4
USERS = 8
WARMUP = ROUNDS  # one session of its own before a server's first level
ARENA_BYTES = 768 * MiB
LMDB_BUDGET = 1 * GiB
BUCKET = "kvtier-serving"
SPEC_TOKENS = 3
CAPTURE_LAYERS = [2, 6, 9]
CAPTURE = engines.capture_config(CAPTURE_LAYERS)
"""EAGLE-3's auxiliary layers of a 12-layer target: low, middle and high."""
HEADLINE_CONCURRENCY = 4
PROFILE_USERS = 4
PROFILE_ROUNDS = 2
PROFILE_ANSWER_TOKENS = 8

TARGETS: dict[str, Target] = {
    "throughput_vs_vllm_alone": (">=", 2.0),
    "ttft_p50_vs_vllm_alone": ("<=", 0.25),
    "ttft_p99_vs_vllm_alone": ("<=", 0.5),
    "no_reuse_throughput_vs_vllm_alone": (">=", 0.98),
    "no_reuse_throughput_vs_vllm_alone_embedded": (">=", 0.98),
    "spec_throughput_vs_vllm_alone_spec": (">=", 2.0),
    "throughput_vs_example_connector": (">=", 1.5),
    "lmdb_backed_vs_arena_backed": (">=", 0.9),
    "object_backed_vs_arena_backed": (">=", 0.75),
}
PAST_THE_ARENA = (
    "kvtier_sidecar",
    "kvtier_sidecar_lmdb",
    "kvtier_sidecar_lmdb_fp8",
    "kvtier_sidecar_lmdb_i8",
    "kvtier_sidecar_object",
    "kvtier_sidecar_obj_fp8",
    "vllm_more_hbm",
)


SERVERS = (
    "vllm",
    "kvtier_embedded",
    "kvtier_sidecar",
    "vllm_b",
    "example_connector",
    "offloading_connector",
    "vllm_spec",
    "kvtier_sidecar_spec",
    "kvtier_embedded_capture",
    *PAST_THE_ARENA[1:],
)


@dataclass(frozen=True)
class Mode:
    name: str
    concurrency: tuple[int, ...]
    no_reuse_cycles: int


QUICK = Mode("quick", (HEADLINE_CONCURRENCY,), 3)
FULL = Mode("full", (1, 2, 4, 8), 12)
NO_REUSE_REQUESTS = 8
NO_REUSE_BACKLOG = 4
"""Unmeasured requests right before each measured no-reuse level: its write-back backlog."""


@dataclass(frozen=True)
class Plan:
    """What one server runs, in order."""

    multi_round: bool = True
    profile: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    connector: str | None = None
    """None, "embedded", "sidecar", "example" or "offloading"."""
    spec: bool = False
    capture: bool = False
    """Capture hidden states (``extract_hidden_states``)."""
    below: str = ""
    """Past the arena (sidecar): "lmdb" (an arena of a quarter of the working set, lmdb the
    rest) or "object" (arena and lmdb a quarter each, the object store all)."""
    kv_cache_scale: int = 1
    """The KV cache over every other server's (``vllm_more_hbm``)."""
    codec: str = "none"
    """``lmdb.codec`` and ``object.codec`` below the arena."""


VLLM = Case("vllm", "vLLM alone")
EMBEDDED = Case("kvtier_embedded", "kvtier embedded", "embedded")
SIDECAR = Case("kvtier_sidecar", "kvtier sidecar", "sidecar")
VLLM_B = Case("vllm_b", "vLLM alone (a second server)")
"""No-reuse only: one vLLM-alone server over another is the floor of what the figure resolves,
since each server started runs at a speed of its own (several per cent apart here)."""
NO_REUSE_CASES = {case.name: case for case in (VLLM, VLLM_B, EMBEDDED, SIDECAR)}
LMDB_BACKED = Case(
    "kvtier_sidecar_lmdb", "kvtier sidecar, arena 1/4, lmdb", "sidecar", below="lmdb"
)
LMDB_FP8_BACKED = Case(
    "kvtier_sidecar_lmdb_fp8",
    "kvtier sidecar, arena 1/4, lmdb in fp8",
    "sidecar",
    below="lmdb",
    codec="fp8",
)
LMDB_INT8_BACKED = Case(
    "kvtier_sidecar_lmdb_i8",
    "kvtier sidecar, arena 1/4, lmdb in int8",
    "sidecar",
    below="lmdb",
    codec="int8",
)
OBJECT_BACKED = Case(
    "kvtier_sidecar_object",
    "kvtier sidecar, arena 1/4, lmdb 1/4, S3",
    "sidecar",
    below="object",
)
OBJECT_FP8_BACKED = Case(
    "kvtier_sidecar_obj_fp8",
    "kvtier sidecar, arena 1/4, lmdb 1/4, S3, both in fp8",
    "sidecar",
    below="object",
    codec="fp8",
)
MORE_HBM = Case("vllm_more_hbm", "vLLM alone, 6x the KV cache", kv_cache_scale=6)
"""6 x 4,096 tokens: every user's history (16,384 tokens) with room for the batch."""


@dataclass
class Outcome:
    case: Case
    start_s: float = math.nan
    wall_s: float = math.nan
    multi_round: list[LevelResult] = field(default_factory=list)
    no_reuse: list[LevelResult] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    log_tail: str = ""
    log_path: str = ""
    daemon_counters: dict[str, int] = field(default_factory=dict)
    """kvtierd's counters over the multi-round levels (moves, promotions, evictions)."""

    def at(self, concurrency: int) -> LevelResult | None:
        return next((lv for lv in self.multi_round if lv.concurrency == concurrency), None)


def by_round(level: LevelResult) -> list[float | None]:
    """Per round: cached tokens the server reported over prompt tokens sent."""
    out: list[float | None] = []
    for r in range(max((rec.round for rec in level.records), default=-1) + 1):
        recs = [rec for rec in level.records if rec.round == r and rec.ok]
        sent = sum(rec.prompt_len for rec in recs)
        cached = [rec.cached_tokens for rec in recs if rec.cached_tokens is not None]
        out.append(sum(cached) / sent if sent and cached else None)
    return out


def later_rounds_ttft(level: LevelResult) -> dict[str, float]:
    """TTFT over the rounds after each user's first: those a cache can serve (a first round
    is a cold prefill for every server, a quarter of multi-round requests)."""
    later = Percentiles.of([r.ttft_s for r in level.records if r.ok and r.round > 0])
    return {"ttft_p50_s_later_rounds": later.p50, "ttft_p99_s_later_rounds": later.p99}


def summary(level: LevelResult) -> dict[str, Any]:
    server = level.server
    return {
        "concurrency": level.concurrency,
        "requests": level.requests,
        "ok": level.ok,
        "errors": level.errors,
        "error_messages": level.error_messages[:3],
        "duration_s": level.duration_s,
        "output_tps": level.output_tps,
        "output_tps_per_user": level.output_tps_per_user,
        "ttft_p50_s": level.ttft_s.p50,
        "ttft_p90_s": level.ttft_s.p90,
        "ttft_p99_s": level.ttft_s.p99,
        "itl_p50_s": level.itl_s.p50,
        "itl_p99_s": level.itl_s.p99,
        "latency_p50_s": level.latency_s.p50,
        "prompt_tokens": level.prompt_tokens,
        "cached_tokens_reported": level.cached_tokens,
        "cached_share_by_round": by_round(level),
        **later_rounds_ttft(level),
        "hit_ratio": server.hit_ratio,
        "hit_ratio_by_source": server.hit_ratio_by_source,
        "prompt_tokens_cached_by_source": server.cached_tokens_by_source,
        "prompt_tokens_by_source": server.prompt_tokens_by_source,
        "connector_chunks": server.connector_chunks,
        "verify_draws": server.verify_draws,
        "realized_sample_rate": server.realized_sample_rate,
        "daemon_hit_ratio": server.daemon_hit_ratio,
        "daemon_lookup_chunks": server.daemon_lookup_chunks,
        "daemon_hit_chunks_by_tier": server.daemon_hit_chunks_by_tier,
    }


# -- the profiler trace -----------------------------------------------------------------------


@dataclass(frozen=True)
class Ratios:
    """A server's no-reuse throughput over vLLM alone's in the same cycle, one per cycle."""

    values: list[float]

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def se(self) -> float | None:
        """The mean's standard error."""
        n = len(self.values)
        return statistics.stdev(self.values) / math.sqrt(n) if n > 1 else None


def no_reuse_ratios(cycles: list[dict[str, float]], name: str) -> Ratios:
    """Cycles where both levels ran whole count; a cycle missing either is left out."""
    values = [
        row[name] / row["vllm"]
        for row in cycles
        if row.get("vllm") and name in row and not math.isnan(row[name] + row["vllm"])
    ]
    return Ratios(values)


def daemon_cpu_seconds(daemon: Kvtierd | None) -> float:
    """kvtierd's CPU time so far; NaN without one."""
    if daemon is None or daemon.proc is None:
        return math.nan
    return process_cpu_seconds(daemon.proc.pid)


def kvtier_time(level: LevelResult, daemon_cpu_s: float) -> dict[str, float]:
    """What kvtier itself took during a level, as shares of its wall time: vLLM's engine loop
    inside kvtier's hooks (``hooks``; 0 for a server without kvtier; also in milliseconds per
    request, which a faster or slower model does not change) and kvtierd's CPU, a share of one
    core (``kvtierd_cpu``; NaN without kvtierd)."""
    wall = level.duration_s or math.nan
    hooks = sum(level.server.connector_hook_seconds.values())
    return {
        "hooks": hooks / wall,
        "hooks_ms_per_request": 1000 * hooks / level.ok if level.ok else math.nan,
        "kvtierd_cpu": daemon_cpu_s / wall,
    }


def mean_cost(costs: list[dict[str, float]], what: str) -> float | None:
    values = [c[what] for c in costs if c.get(what) is not None and not math.isnan(c[what])]
    return statistics.fmean(values) if values else None


def profiler_args(trace_dir: Path) -> list[str]:
    config = {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir),
        "torch_profiler_activities": ["CPU"],
        "torch_profiler_with_stack": True,
        "torch_profiler_use_gzip": False,
        "ignore_frontend": True,
    }
    return ["--profiler-config", json.dumps(config)]


# -- the bench --------------------------------------------------------------------------------


class Bench:
    def __init__(
        self,
        mode: Mode,
        cache_dir: Path,
        *,
        blocks_per_chunk: int,
        concurrency: tuple[int, ...],
        profile: bool,
        connector_extra: dict[str, Any] | None = None,
        only: set[str] | None = None,
        no_reuse_only: bool = False,
    ) -> None:
        self.mode = mode
        self.no_reuse_only = no_reuse_only
        self.connector_extra = dict(connector_extra or {})
        self.only = only
        self.bpc = blocks_per_chunk
        self.concurrency = concurrency
        self.profile = profile
        cache_dir.mkdir(parents=True, exist_ok=True)
        tokenizer = models.build_tokenizer(cache_dir)
        shape = {
            "hidden": 768,
            "heads": 8,
            "kv_heads": 4,
            "head_dim": 64,
            "intermediate": 2048,
            "dtype": "bfloat16",
        }
        self.model = models.build_benchmark_llama(cache_dir, tokenizer_dir=tokenizer)
        self.draft = models.build_draft(cache_dir, tokenizer_dir=tokenizer, **shape)
        self.vocab = models.vocab_size_of(self.model)
        self.root = Path(tempfile.mkdtemp(prefix="serving-", dir=cache_dir))
        self.shm_paths: list[Path] = []
        self.nr_index = 100  # no-reuse levels use indices of their own, never repeated
        self.daemons: dict[str, Kvtierd] = {}  # by run name, while their servers run
        self.nr_costs: dict[str, list[dict[str, float]]] = {}
        self.moto: MotoServer | None = None
        self.no_reuse_error = ""
        config = json.loads((self.model / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        # K and V, bf16
        per_token = config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * 2
        self.chunk_bytes = per_token * BLOCK_SIZE * blocks_per_chunk
        self.kv_per_token = per_token
        self.hidden_per_token = len(CAPTURE_LAYERS) * config["hidden_size"] * 2  # bf16

    def hidden_bytes(self, kv_bytes: int) -> int:
        """The captured hidden states' cache for the tokens ``kv_bytes`` of KV hold."""
        return kv_bytes * self.hidden_per_token // self.kv_per_token

    def workload(self, kind: str = "multi-round", **overrides: Any) -> WorkloadSpec:
        settings: dict[str, Any] = {
            "kind": kind,
            "doc_tokens": DOC_TOKENS,
            "question_tokens": QUESTION_TOKENS,
            "answer_tokens": ANSWER_TOKENS,
            "rounds": ROUNDS,
            "vocab_size": self.vocab,
            "min_token_id": len(models.SPECIAL_TOKENS),
            "seed": 1,
        }
        settings.update(overrides)
        return WorkloadSpec(**settings)

    # -- servers ----------------------------------------------------------------------------

    def shm(self, name: str) -> Path:
        path = Path(f"/dev/shm/kvtier-serving-{os.getpid()}-{name}")
        self.shm_paths.append(path)
        return path

    def kvtier(self, extra: dict[str, Any]) -> dict[str, Any]:
        return kvtier_connector({**extra, "blocks_per_chunk": self.bpc, **self.connector_extra})

    def embedded_config(self, name: str) -> dict[str, Any]:
        path = self.root / name / "kvtier.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        tree = {
            "arena": {
                "path": str(self.shm(name)),
                "size_bytes": ARENA_BYTES,
                "extent_bytes": extent_for(self.chunk_bytes),
                "min_slot_bytes": 64 * KiB,
            },
            "lmdb": {"path": str(self.root / name / "lmdb"), "budget_bytes": LMDB_BUDGET},
        }
        path.write_text(yaml.safe_dump(tree))
        return self.kvtier({"kvtier_config": str(path)})

    @property
    def working_set_bytes(self) -> int:
        """Every user's whole history, in the chunks it is stored as."""
        chunk_tokens = BLOCK_SIZE * self.bpc
        return USERS * (self.workload().longest_request() // chunk_tokens) * self.chunk_bytes

    def past_the_arena(self, tree: dict[str, Any], below: str, daemon: Kvtierd) -> None:
        """Tiers that hold less than the working set: an arena of a quarter of it (extents of
        8 chunks, so that a quarter is whole extents), then lmdb the rest, or lmdb a quarter
        and the object store (moto, reached through IRSA) everything."""
        extent = 8 * self.chunk_bytes
        quarter = max(extent, round(self.working_set_bytes / 4 / extent) * extent)
        tree["arena"].update(size_bytes=quarter, extent_bytes=extent)
        if below == "object":
            moto = self.s3()
            tree["lmdb"]["budget_bytes"] = quarter
            tree["object"] = {
                "url": f"s3://{BUCKET}/{daemon.root.parent.name}",
                "index_path": str(daemon.root / "objindex"),
            }
            daemon.env = irsa_env(self.root, moto.url)
            daemon.env_drop = SCRUBBED_ENV

    def s3(self) -> MotoServer:
        """moto's S3, started at first use, with the run's bucket."""
        if self.moto is None:
            self.moto = MotoServer(self.root / "moto.log").start()
            with patched_env(irsa_env(self.root, self.moto.url), drop=SCRUBBED_ENV):
                client = boto3.session.Session().client("s3")
                client.create_bucket(Bucket=BUCKET)
                client.close()
        return self.moto

    @contextmanager
    def server(
        self, case: Case, plan: Plan, run_name: str = ""
    ) -> Iterator[tuple[VllmServer, str | None]]:
        """``case``'s server, its files under ``run_name`` (the case's name by default)."""
        run_name = run_name or case.name
        tmp = self.root / run_name
        tmp.mkdir(parents=True, exist_ok=True)
        args: list[str] = []
        daemon: Kvtierd | None = None
        metrics_url = None
        if case.connector == "embedded":
            args += connector_arg(self.embedded_config(run_name))
        elif case.connector == "sidecar":
            (tmp / "kvtierd").mkdir(exist_ok=True)
            daemon = Kvtierd(
                tmp / "kvtierd", self.shm(run_name), ARENA_BYTES, extent_for(self.chunk_bytes)
            )
            tree = yaml.safe_load(daemon.config_path.read_text())
            tree["lmdb"]["budget_bytes"] = LMDB_BUDGET
            if case.below:
                self.past_the_arena(tree, case.below, daemon)
                tree["lmdb"]["codec"] = case.codec
                if "object" in tree:
                    tree["object"]["codec"] = case.codec
            daemon.config_path.write_text(yaml.safe_dump(tree))
            try:
                daemon.start()
            except BaseException:
                daemon.stop()
                raise
            metrics_url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
            self.daemons[run_name] = daemon
            extra = {"mode": "sidecar", "socket_path": str(daemon.socket_path)}
            args += connector_arg(self.kvtier(extra))
        elif case.connector == "example":
            storage = tmp / "example-storage"
            storage.mkdir(exist_ok=True)
            args += connector_arg(
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                }
            )
        elif case.connector == "offloading":
            args += connector_arg(
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": ARENA_BYTES},
                }
            )
        if case.spec:
            spec = {
                "method": "draft_model",
                "model": str(self.draft),
                "num_speculative_tokens": SPEC_TOKENS,
            }
            args += ["--speculative-config", json.dumps(spec)]
        if case.capture:
            args += ["--speculative-config", json.dumps(CAPTURE)]
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if plan.profile:
            args += profiler_args(tmp / "traces")
            env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # vLLM's own ranges, forward included
        # the hidden-state cache shares the KV memory: as much again for it, the same tokens held
        kv_bytes = KV_CACHE_BYTES * case.kv_cache_scale
        kv_bytes += self.hidden_bytes(KV_CACHE_BYTES) if case.capture else 0
        server = VllmServer(
            self.model,
            tmp,
            args=args,
            kv_cache_bytes=kv_bytes,
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            dtype="bfloat16",
            env=env,
        )
        try:
            server.start()
            yield server, metrics_url
        finally:
            server.stop()
            if daemon is not None:
                daemon.stop()
                self.daemons.pop(run_name, None)
            # its own arena only: other servers may still be running
            self.shm(run_name).unlink(missing_ok=True)
            # the stored KV (a preallocated LMDB file is its whole budget): keep the logs only
            for heavy in (tmp / "lmdb", tmp / "kvtierd" / "lmdb", tmp / "example-storage"):
                shutil.rmtree(heavy, ignore_errors=True)

    # -- levels -----------------------------------------------------------------------------

    def level(
        self,
        server: VllmServer,
        metrics_url: str | None,
        spec: WorkloadSpec,
        concurrency: int,
        requests: int,
        index: int,
        warmup: int,
    ) -> LevelResult:
        config = BenchConfig(
            url=server.url,
            workload=spec,
            concurrency=(concurrency,),
            requests=requests,
            warmup=warmup,
            timeout_s=600.0,
            kvtier_metrics_url=metrics_url,
        )
        started = time.perf_counter()
        result = run_level(config, concurrency, index=index)
        log.info(
            "  %s c=%d: %d/%d ok in %.1f s, %.1f out tok/s, TTFT p50 %.0f ms p99 %.0f ms, hits %s",
            spec.kind,
            concurrency,
            result.ok,
            result.requests,
            time.perf_counter() - started,
            result.output_tps,
            result.ttft_s.p50 * 1000,
            result.ttft_s.p99 * 1000,
            "-" if result.server.hit_ratio is None else f"{result.server.hit_ratio:.1%}",
        )
        return result

    def run_case(self, case: Case, plan: Plan) -> Outcome:
        out = Outcome(case)
        started = time.perf_counter()
        log.info("%s: starting", case.name)
        try:
            with self.server(case, plan) as (server, metrics_url):
                out.start_s = server.start_s
                out.log_path = str(server.log)
                log.info("%s: healthy in %.1f s", case.name, server.start_s)
                warmup = WARMUP
                daemon = self.daemons.get(case.name)
                before = daemon.counters() if daemon is not None else {}
                if plan.multi_round:
                    for i, c in enumerate(self.concurrency):
                        out.multi_round.append(
                            self.level(
                                server,
                                metrics_url,
                                self.workload(),
                                c,
                                USERS * ROUNDS,
                                i,
                                warmup,
                            )
                        )
                        warmup = 0
                if daemon is not None:
                    after = daemon.counters()
                    out.daemon_counters = {
                        k: v - before.get(k, 0)
                        for k, v in sorted(after.items())
                        if v != before.get(k, 0)
                    }
                if plan.profile:
                    out.profile = self.profile_level(server, metrics_url)
        except (ServerError, BenchError, RuntimeError, OSError) as exc:
            self.failed(out, exc, case.name)
        out.wall_s = time.perf_counter() - started
        log.info("%s: done in %.0f s", case.name, out.wall_s)
        return out

    def failed(self, out: Outcome, exc: BaseException, run_name: str) -> None:
        out.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log_file = self.root / run_name / "server.log"
        if log_file.exists():
            out.error = f"{out.error} | {error_line(log_file)}"
            out.log_tail = log_tail(log_file, 25)
        log.error("%s failed: %s", run_name, out.error)

    def no_reuse_level(self, server: VllmServer, metrics_url: str | None, n: int) -> LevelResult:
        self.nr_index += 1  # a level of prompts of its own
        spec = self.workload("no-reuse")
        return self.level(server, metrics_url, spec, HEADLINE_CONCURRENCY, n, self.nr_index, 0)

    def no_reuse_phase(self, outcomes: dict[str, Outcome]) -> list[dict[str, float]]:
        """The no-reuse servers up at once and measured in turn, cycle after cycle (see the
        module's docstring); each cycle's output tokens/s by server. A server that fails to
        start fails the phase, whose levels then go unmeasured."""
        names = [n for n in NO_REUSE_CASES if self.only is None or n in self.only]
        if "vllm" not in names or len(names) < 2 or not self.mode.no_reuse_cycles:
            return []
        cases = {n: outcomes.setdefault(n, Outcome(NO_REUSE_CASES[n])) for n in names}
        cycles: list[dict[str, float]] = []
        current = names[0]

        def run_name(name: str) -> str:
            return f"{name}_nr"  # short: vLLM puts sockets under it (sun_path holds 107)

        try:
            with ExitStack() as stack:
                up: dict[str, tuple[VllmServer, str | None]] = {}
                for current in names:
                    log.info("%s: starting", run_name(current))
                    up[current] = stack.enter_context(
                        self.server(cases[current].case, Plan(), run_name(current))
                    )
                for server, url in up.values():  # the first requests of a server, unmeasured
                    self.no_reuse_level(server, url, NO_REUSE_REQUESTS)
                for cycle in range(self.mode.no_reuse_cycles):
                    turn = cycle % len(names)
                    row: dict[str, float] = {}
                    for current in names[turn:] + names[:turn]:
                        server, url = up[current]
                        if wait_until_quiet() is None:
                            log.warning("the machine stayed busy: the level runs anyway")
                        self.no_reuse_level(server, url, NO_REUSE_BACKLOG)
                        daemon = self.daemons.get(run_name(current))
                        daemon_cpu = daemon_cpu_seconds(daemon)
                        level = self.no_reuse_level(server, url, NO_REUSE_REQUESTS)
                        cases[current].no_reuse.append(level)
                        cost = kvtier_time(level, daemon_cpu_seconds(daemon) - daemon_cpu)
                        self.nr_costs.setdefault(current, []).append(cost)
                        log.info(
                            "  kvtier's own time: hooks %.2f%% of the level (%.1f ms per "
                            "request), kvtierd %.2f%% of a core",
                            100 * cost["hooks"],
                            cost["hooks_ms_per_request"],
                            100 * cost["kvtierd_cpu"],
                        )
                        whole = level.ok == level.requests
                        row[current] = level.output_tps if whole else math.nan
                    cycles.append(row)
                    log.info(
                        "no-reuse cycle %d: %s", cycle, {k: round(v, 1) for k, v in row.items()}
                    )
        except (ServerError, BenchError, RuntimeError, OSError) as exc:
            failure = Outcome(cases[current].case)
            self.failed(failure, exc, run_name(current))
            self.no_reuse_error = f"{run_name(current)}: {failure.error}"
        return cycles

    def profile_level(self, server: VllmServer, metrics_url: str | None) -> dict[str, Any]:
        trace_dir = self.root / server.tmp.name / "traces"
        spec = self.workload(rounds=PROFILE_ROUNDS, answer_tokens=PROFILE_ANSWER_TOKENS)
        server.post("/start_profile")
        try:
            level = self.level(
                server,
                metrics_url,
                spec,
                HEADLINE_CONCURRENCY,
                PROFILE_USERS * PROFILE_ROUNDS,
                900,
                0,
            )
        finally:
            server.post("/stop_profile", timeout=600)
        deadline = time.monotonic() + 120
        traces: list[Path] = []
        while time.monotonic() < deadline:
            traces = sorted(p for p in trace_dir.rglob("*.json*") if p.is_file())
            if traces and all(_settled(p) for p in traces):
                break
            time.sleep(1)
        if not traces:
            return {"error": f"no trace written under {trace_dir}"}
        best: dict[str, Any] = {}
        for path in traces:
            try:
                shares = step_shares(load_trace(path))
            except (OSError, ValueError) as exc:
                log.warning("cannot read trace %s: %s", path, exc)
                continue
            if shares["steps"] and (not best or shares["steps"] > best["steps"]):
                best = {**shares, "trace": str(path), "trace_bytes": path.stat().st_size}
        if not best:
            return {"error": f"no step annotations in {[str(p) for p in traces]}"}
        best["level"] = summary(level)
        log.info(
            "profile: kvtier %.1f%% of step time (%s), model forward %.1f%%, %d steps",
            100 * best["kvtier_step_share"],
            best["kvtier_ranges"],
            100 * best["model_step_share"],
            best["steps"],
        )
        return best

    # -- all --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        share = CpuShare()
        cases = [
            (VLLM, Plan()),
            (EMBEDDED, Plan()),
            (SIDECAR, Plan(profile=self.profile)),
            (Case("example_connector", "ExampleConnector", "example"), Plan()),
            (Case("offloading_connector", "OffloadingConnector", "offloading"), Plan()),
            (Case("vllm_spec", "vLLM alone + spec", spec=True), Plan()),
            (Case("kvtier_sidecar_spec", "kvtier sidecar + spec", "sidecar", spec=True), Plan()),
            (
                Case(
                    "kvtier_embedded_capture",
                    "kvtier embedded + hidden-state capture",
                    "embedded",
                    capture=True,
                ),
                Plan(),
            ),
            (LMDB_BACKED, Plan()),
            (LMDB_FP8_BACKED, Plan()),
            (LMDB_INT8_BACKED, Plan()),
            (OBJECT_BACKED, Plan()),
            (OBJECT_FP8_BACKED, Plan()),
            (MORE_HBM, Plan()),
        ]
        outcomes = {
            case.name: self.run_case(case, plan)
            for case, plan in cases
            if (self.only is None or case.name in self.only) and not self.no_reuse_only
        }
        cycles = self.no_reuse_phase(outcomes)
        result = self.result(outcomes, cycles)
        result["wall_s"] = time.perf_counter() - started
        result["other_processes_cpu_share"] = share.others()
        return result

    def result(
        self, outcomes: dict[str, Outcome], cycles: list[dict[str, float]]
    ) -> dict[str, Any]:
        c = HEADLINE_CONCURRENCY

        def mr(name: str) -> LevelResult | None:
            outcome = outcomes.get(name)
            return outcome.at(c) if outcome else None

        def ratio(a: float | None, b: float | None) -> float | None:
            if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
                return None
            return a / b

        def tps(name: str) -> float | None:
            level = mr(name)
            return level.output_tps if level and level.ok else None

        def ttft(name: str, p: str) -> float | None:
            level = mr(name)
            return getattr(level.ttft_s, p) if level and level.ok else None

        def later(name: str, p: str) -> float | None:
            level = mr(name)
            return later_rounds_ttft(level)[f"ttft_{p}_s_later_rounds"] if level else None

        nr_side = no_reuse_ratios(cycles, "kvtier_sidecar")
        nr_emb = no_reuse_ratios(cycles, "kvtier_embedded")
        profile = outcomes["kvtier_sidecar"].profile if "kvtier_sidecar" in outcomes else {}
        headline: dict[str, Any] = {
            "throughput_vs_vllm_alone": ratio(tps("kvtier_sidecar"), tps("vllm")),
            "ttft_p50_vs_vllm_alone": ratio(ttft("kvtier_sidecar", "p50"), ttft("vllm", "p50")),
            "ttft_p99_vs_vllm_alone": ratio(ttft("kvtier_sidecar", "p99"), ttft("vllm", "p99")),
            "no_reuse_throughput_vs_vllm_alone": nr_side.mean,
            "no_reuse_throughput_vs_vllm_alone_embedded": nr_emb.mean,
            "spec_throughput_vs_vllm_alone_spec": ratio(
                tps("kvtier_sidecar_spec"), tps("vllm_spec")
            ),
            "throughput_vs_example_connector": ratio(
                tps("kvtier_sidecar"), tps("example_connector")
            ),
            "capture_throughput_vs_kvtier_embedded": ratio(
                tps("kvtier_embedded_capture"), tps("kvtier_embedded")
            ),
            "kvtier_step_share": profile.get("kvtier_step_share"),
            "throughput_vs_vllm_alone_embedded": ratio(tps("kvtier_embedded"), tps("vllm")),
            "ttft_p50_vs_vllm_alone_embedded": ratio(
                ttft("kvtier_embedded", "p50"), ttft("vllm", "p50")
            ),
            "ttft_p99_vs_vllm_alone_embedded": ratio(
                ttft("kvtier_embedded", "p99"), ttft("vllm", "p99")
            ),
            "ttft_p50_vs_vllm_alone_later_rounds": ratio(
                later("kvtier_sidecar", "p50"), later("vllm", "p50")
            ),
            "ttft_p99_vs_vllm_alone_later_rounds": ratio(
                later("kvtier_sidecar", "p99"), later("vllm", "p99")
            ),
            "throughput_vs_offloading_connector": ratio(
                tps("kvtier_sidecar"), tps("offloading_connector")
            ),
            "lmdb_backed_vs_arena_backed": ratio(tps(LMDB_BACKED.name), tps("kvtier_sidecar")),
            "object_backed_vs_arena_backed": ratio(tps(OBJECT_BACKED.name), tps("kvtier_sidecar")),
            "lmdb_fp8_backed_vs_arena_backed": ratio(
                tps(LMDB_FP8_BACKED.name), tps("kvtier_sidecar")
            ),
            "lmdb_int8_backed_vs_arena_backed": ratio(
                tps(LMDB_INT8_BACKED.name), tps("kvtier_sidecar")
            ),
            "object_fp8_backed_vs_arena_backed": ratio(
                tps(OBJECT_FP8_BACKED.name), tps("kvtier_sidecar")
            ),
            "throughput_vs_more_hbm": ratio(tps("kvtier_sidecar"), tps(MORE_HBM.name)),
            "past_the_arena": {
                name: {
                    "output_tps": tps(name),
                    "ttft_p50_s": ttft(name, "p50"),
                    "ttft_p99_s": ttft(name, "p99"),
                    "ttft_p50_s_later_rounds": later(name, "p50"),
                    "hit_chunks_by_tier": (level := mr(name))
                    and level.server.daemon_hit_chunks_by_tier,
                }
                for name in PAST_THE_ARENA
                if mr(name) is not None
            },
            "no_reuse_se": {"sidecar": nr_side.se, "embedded": nr_emb.se},
            "no_reuse_second_vllm_alone": no_reuse_ratios(cycles, "vllm_b").mean,
            "no_reuse_cycles": cycles,
            "no_reuse_error": self.no_reuse_error or None,
            "no_reuse_hook_share": mean_cost(self.nr_costs.get("kvtier_sidecar", []), "hooks"),
            "no_reuse_hook_share_embedded": mean_cost(
                self.nr_costs.get("kvtier_embedded", []), "hooks"
            ),
            "no_reuse_kvtierd_cpu_share": mean_cost(
                self.nr_costs.get("kvtier_sidecar", []), "kvtierd_cpu"
            ),
            "no_reuse_kvtier_time": self.nr_costs,
        }
        targets = {}
        for key, (op, bound) in TARGETS.items():
            value = headline[key]
            met = None if value is None else targets_met(value, op, bound)
            targets[key] = {"value": value, "target": f"{op} {bound:g}", "met": met}
        servers = {}
        for name, o in outcomes.items():
            servers[name] = {
                "label": o.case.label,
                "start_s": o.start_s,
                "wall_s": o.wall_s,
                "error": o.error or None,
                "log": o.log_path or str(self.root / name / "server.log"),
                "multi_round": [summary(lv) for lv in o.multi_round],
                "daemon_counters": o.daemon_counters,
                "no_reuse": [summary(lv) for lv in o.no_reuse],
            }
            if o.error:
                servers[name]["log_tail"] = o.log_tail
        return {
            "mode": self.mode.name,
            "headline_concurrency": c,
            **headline,
            "targets": targets,
            "profile": profile,
            "servers": servers,
            "settings": {
                "model": self.model.name,
                "draft": self.draft.name,
                "kv_cache_bytes": KV_CACHE_BYTES,
                "max_model_len": MAX_MODEL_LEN,
                "block_size": BLOCK_SIZE,
                "blocks_per_chunk": self.bpc,
                "arena_bytes": ARENA_BYTES,
                "working_set_bytes": self.working_set_bytes,
                "multi_round": {
                    "users": USERS,
                    "doc_tokens": DOC_TOKENS,
                    "question_tokens": QUESTION_TOKENS,
                    "answer_tokens": ANSWER_TOKENS,
                    "rounds": ROUNDS,
                    "working_set_tokens": USERS * self.workload().longest_request(),
                    "concurrency": list(self.concurrency),
                },
                "no_reuse": {
                    "cycles": self.mode.no_reuse_cycles,
                    "requests": NO_REUSE_REQUESTS,
                    "backlog_requests": NO_REUSE_BACKLOG,
                },
                "connector_extra": self.connector_extra,
                "speculative_tokens": SPEC_TOKENS,
                "run_dir": str(self.root),
            },
            "_outcomes": outcomes,
        }

    def close(self) -> None:
        if self.moto is not None:
            self.moto.stop()
        for path in self.shm_paths:
            path.unlink(missing_ok=True)


def _settled(path: Path) -> bool:
    """A trace file the profiler has finished writing (its size holds still for a second)."""
    size = path.stat().st_size
    time.sleep(1.0)
    return size > 0 and path.stat().st_size == size


# -- output -----------------------------------------------------------------------------------


def _f(value: Any, fmt: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def _ms(seconds: float | None, fmt: str = ".0f") -> str:
    return _f(None if seconds is None else seconds * 1e3, fmt)


def _pct3(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0%}"


def tables(result: dict[str, Any]) -> str:
    lines = [
        f"## Multi-round ({result['settings']['multi_round']['users']} users x "
        f"{ROUNDS} rounds, working set {result['settings']['multi_round']['working_set_tokens']}"
        f" tokens, KV cache 4,096 tokens)",
        "",
        "| server | conc | out tok/s | tok/s/user | TTFT p50 ms | TTFT p99 ms | TTFT p50/p99 ms, "
        "rounds 2-4 | ITL p50 ms | hit ratio | kvtierd hit ratio | ok/sent |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result["servers"].values():
        if s["error"]:
            lines.append(f"| {s['label']} | - | failed: {s['error'][:160]} | | | | | | | | |")
            continue
        for lv in s["multi_round"]:
            lines.append(
                f"| {s['label']} | {lv['concurrency']} | {_f(lv['output_tps'], '.1f')} | "
                f"{_f(lv['output_tps_per_user'], '.2f')} | {_ms(lv['ttft_p50_s'], '.0f')} | "
                f"{_ms(lv['ttft_p99_s'], '.0f')} | "
                f"{_ms(lv['ttft_p50_s_later_rounds'], '.0f')}/"
                f"{_ms(lv['ttft_p99_s_later_rounds'], '.0f')} | "
                f"{_ms(lv['itl_p50_s'], '.1f')} | "
                f"{_pct(lv['hit_ratio'])} | {_pct(lv['daemon_hit_ratio'])} | "
                f"{lv['ok']}/{lv['requests']} |"
            )
    lines += past_the_arena_table(result)
    lines += ["", *no_reuse_table(result)]
    lines += ["", "## Ratios", "", "| ratio | value | target | met |", "|---|---:|---:|---|"]
    for key, t in result["targets"].items():
        met = "-" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {key} | {_f(t['value'], '.3f')} | {t['target']} | {met} |")
    for key in (
        "throughput_vs_vllm_alone_embedded",
        "ttft_p50_vs_vllm_alone_embedded",
        "ttft_p99_vs_vllm_alone_embedded",
        "ttft_p50_vs_vllm_alone_later_rounds",
        "ttft_p99_vs_vllm_alone_later_rounds",
        "throughput_vs_offloading_connector",
        "throughput_vs_more_hbm",
        "kvtier_step_share",
    ):
        lines.append(f"| {key} | {_f(result.get(key), '.3f')} | | |")
    profile = result.get("profile") or {}
    if profile.get("steps"):
        lines += [
            "",
            f"Profile ({profile['kvtier_ranges']}): {profile['steps']} steps, "
            f"{profile['step_time_s']:.2f} s of step time, model forward "
            f"{profile['model_step_share']:.1%}, kvtier {profile['kvtier_step_share']:.1%} "
            f"({profile['kvtier_outside_steps_s']:.3f} s of kvtier outside steps).",
        ]
    return "\n".join(lines)


def past_the_arena_table(result: dict[str, Any]) -> list[str]:
    """The servers whose tiers hold less than the working set, beside the one whose arena holds
    it all and vLLM alone with the KV cache that holds it."""
    past = result.get("past_the_arena") or {}
    if not past:
        return []
    base = (past.get("kvtier_sidecar") or {}).get("output_tps")
    working_set = result["settings"]["working_set_bytes"]
    lines = [
        "",
        f"## Past the arena (concurrency {HEADLINE_CONCURRENCY}; working set "
        f"{working_set / MiB:.0f} MiB of chunks)",
        "",
        "| server | out tok/s | vs arena-backed | TTFT p50 ms | TTFT p99 ms | "
        "TTFT p50 ms, rounds 2-4 | kvtierd hits by tier (chunks) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in past.items():
        tiers = row.get("hit_chunks_by_tier") or {}
        lines.append(
            f"| {result['servers'][name]['label']} | {_f(row['output_tps'], '.1f')} | "
            f"{_f(row['output_tps'] / base if base and row['output_tps'] else None, '.3f')} | "
            f"{_ms(row['ttft_p50_s'])} | {_ms(row['ttft_p99_s'])} | "
            f"{_ms(row['ttft_p50_s_later_rounds'])} | "
            + (", ".join(f"{t} {int(n)}" for t, n in sorted(tiers.items())) or "-")
            + " |"
        )
    return lines


def no_reuse_table(result: dict[str, Any]) -> list[str]:
    """Each cycle's output tokens/s by server, then each kvtier mode's ratios."""
    settings = result["settings"]["no_reuse"]
    lines = [
        f"## No reuse (every prompt unique, concurrency {HEADLINE_CONCURRENCY}, all servers up "
        f"at once, {settings['requests']} measured requests per level)",
        "",
    ]
    if result["no_reuse_error"]:
        lines += [f"Not measured: {result['no_reuse_error']}", ""]
    cycles = result["no_reuse_cycles"]
    names = [n for n in NO_REUSE_CASES if any(n in row for row in cycles)]
    if not cycles:
        return lines
    labels = [NO_REUSE_CASES[n].label for n in names]
    lines += [
        "| cycle | " + " | ".join(f"{label} tok/s" for label in labels) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for i, row in enumerate(cycles):
        lines.append(f"| {i} | " + " | ".join(_f(row.get(n), ".1f") for n in names) + " |")
    lines += [
        "",
        "| over vLLM alone | cycles | mean | se | min | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names[1:]:
        ratios = no_reuse_ratios(cycles, name)
        values = ratios.values or [math.nan]
        lines.append(
            f"| {NO_REUSE_CASES[name].label} | {len(ratios.values)} | {_f(ratios.mean, '.3f')} | "
            f"{_f(ratios.se, '.3f')} | {_f(min(values), '.3f')} | {_f(max(values), '.3f')} |"
        )
    costs = result["no_reuse_kvtier_time"]
    if any(costs.get(name) for name in ("kvtier_embedded", "kvtier_sidecar")):
        lines += [
            "",
            "| kvtier's own time, mean over levels | levels | vLLM inside kvtier's hooks, "
            "share of wall time | the same, ms per request | kvtierd CPU, share of a core |",
            "|---|---:|---:|---:|---:|",
        ]
        for name in ("kvtier_embedded", "kvtier_sidecar"):
            if costs.get(name):
                lines.append(
                    f"| {NO_REUSE_CASES[name].label} | {len(costs[name])} | "
                    f"{_pct3(mean_cost(costs[name], 'hooks'))} | "
                    f"{_f(mean_cost(costs[name], 'hooks_ms_per_request'), '.1f')} | "
                    f"{_pct3(mean_cost(costs[name], 'kvtierd_cpu'))} |"
                )
    return lines


def clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def write_docs(result: dict[str, Any], docs: Path) -> None:
    from kvtier.bench.plot import Curve, save_plot

    docs.mkdir(parents=True, exist_ok=True)
    curves = []
    for o in result["_outcomes"].values():
        levels = o.multi_round
        if not levels:
            continue
        curves.append(
            Curve(
                o.case.label,
                [lv.concurrency for lv in levels],
                [lv.output_tps for lv in levels],
                [lv.output_tps_per_user for lv in levels],
                [lv.ttft_s.p50 for lv in levels],
                [lv.ttft_s.p99 for lv in levels],
            )
        )
    if curves:
        save_plot(curves, docs / "serving.png")
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = [
        "# Whole-server benchmark: vLLM alone, kvtier, vLLM's connectors",
        "",
        f"`python -m benchmarks.serving` ({result['mode']} run, {stamp}, "
        f"{result['wall_s'] / 60:.0f} min; other processes used "
        f"{result['other_processes_cpu_share']:.0%} of the CPUs). What is measured and how: the "
        "docstring of benchmarks/serving.py.",
        "",
        "![throughput vs interactivity, TTFT vs concurrency](serving.png)",
        "",
        tables(result),
        "",
    ]
    (docs / "serving.md").write_text("\n".join(text))


def parse_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="concurrency 4 only, fewer requests")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--profile", action="store_true", help="record a torch profiler trace of one level"
    )
    parser.add_argument("--blocks-per-chunk", type=int, default=4)
    parser.add_argument(
        "--no-reuse-cycles", type=int, help="no-reuse cycles (3 quick, 12 full; 0: none)"
    )
    parser.add_argument(
        "--no-reuse-only", action="store_true", help="the no-reuse phase alone: no multi-round"
    )
    parser.add_argument("--concurrency", type=parse_list, help="multi-round levels")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "kvtier-bench",
        help="where the models are built and the run's files go",
    )
    parser.add_argument(
        "--docs", type=Path, default=ROOT / "docs", help="where the full run writes its plot"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run's directory")
    parser.add_argument(
        "--connector-extra",
        type=json.loads,
        default={},
        help="JSON merged into every KVTierConnector kv_connector_extra_config, e.g. "
        "'{\"lookup_deadline_ms\": 500}'",
    )
    parser.add_argument(
        "--servers", help=f"comma-separated: only these servers (of {', '.join(SERVERS)})"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    logging.getLogger("kvtier").setLevel(logging.WARNING)
    log.setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    unknown = set(args.servers.split(",")) - set(SERVERS) if args.servers else set()
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)} (choose from {', '.join(SERVERS)})")
    mode = QUICK if args.quick else FULL
    if args.no_reuse_cycles is not None:
        mode = replace(mode, no_reuse_cycles=args.no_reuse_cycles)
    concurrency = args.concurrency or mode.concurrency
    if HEADLINE_CONCURRENCY not in concurrency:
        concurrency = tuple(sorted({*concurrency, HEADLINE_CONCURRENCY}))
    bench = Bench(
        mode,
        args.cache_dir,
        blocks_per_chunk=args.blocks_per_chunk,
        concurrency=concurrency,
        profile=args.profile or args.json,
        connector_extra=args.connector_extra,
        only=set(args.servers.split(",")) if args.servers else None,
        no_reuse_only=args.no_reuse_only,
    )
    try:
        result = bench.run()
        if mode is FULL and bench.only is None:
            write_docs(result, args.docs)
    finally:
        bench.close()
        if not args.keep:
            shutil.rmtree(bench.root, ignore_errors=True)
    if args.json:
        json.dump(clean(result), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(tables(clean(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
