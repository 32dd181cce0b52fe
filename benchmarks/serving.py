"""Whole-server throughput and TTFT: vLLM alone against kvtier and vLLM's own connectors.

Usage: ``python -m benchmarks.serving [--quick] [--json] [--profile] [--blocks-per-chunk N]``
``[--concurrency 1,2,4,8] [--servers NAME,...] [--connector-extra JSON] [--cache-dir DIR]``
``[--docs DIR] [--keep] [--model present|gpu-ratio] [--doc-tokens N] [--lmcache-python PATH]``
``[--pairs N]``

``--model gpu-ratio`` runs the workload on a model shaped to a GPU node's recompute:load ratio
(benchmarks/models.py) against vLLM alone, kvtier and LMCache, with the ratios measured in the
run: benchmarks/serving_gpu_ratio.py says what it runs and judges. What follows is the default.

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
  quarter of it (in whole extents of up to 8 chunks) and lmdb (1 GiB) for the
  rest; ``kvtier_sidecar_object``, an arena and an lmdb budget of a quarter each, and the
  object store holding everything: moto's S3 server at nice 19 (a remote store takes no CPU the
  engine wants), reached through IRSA (no keys), ``object.admission: all``. Their throughputs
  over ``kvtier_sidecar``'s: ``lmdb_backed_vs_arena_backed`` (>= 0.9),
  ``object_backed_vs_arena_backed`` (>= 0.75); ``kvtier_sidecar_lmdb_fp8``, ``..._lmdb_i8``
  and ``kvtier_sidecar_obj_fp8`` run ``lmdb.codec`` (and ``object.codec``) fp8 or int8
  (``lmdb_fp8_backed_vs_arena_backed``, ...). ``past_the_arena`` gives each one's TTFTs and
  kvtierd's hits by tier; every sidecar's ``daemon_counters`` are kvtierd's counters over its
  levels (promotions, holds, evictions, rejected stores).
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
  vLLM alone, kvtier embedded and sidecar are started together (an idle server takes about 1 %
  of a core) and measured in cycles, each measuring every server once in an order rotated from
  cycle to cycle. Each unit waits for the machine to be quiet (below 10 % busy for a second),
  runs 4 unmeasured requests (a write-back backlog), then the measured level of 8; each server
  first runs one unmeasured level. ``no_reuse_throughput_vs_vllm_alone`` is the mean over
  cycles of sidecar over vLLM alone in the same cycle (``..._embedded``: embedded mode), with
  its standard error (``no_reuse_se``); 3 cycles with ``--quick``, 12 in the full run
  (``--no-reuse-cycles``). ``no_reuse_second_vllm_alone`` is a second vLLM alone (``vllm_b``)
  over the first: two identical servers differ by that much, and a ratio nearer 1 than it is
  within this machine's noise. Each server's speed does not move kvtier's own time per measured
  level: ``no_reuse_hook_share`` (``..._embedded``), vLLM's engine loop inside kvtier's hooks
  (``vllm:kvtier_hook_seconds_total``) over the level's wall time, and
  ``no_reuse_kvtierd_cpu_share``, kvtierd's CPU time (/proc) over it, a share of one core;
  ``no_reuse_kvtier_time`` holds every level's.

Figures per level: output tokens/s (all users, successful requests) and per user (mean of
output tokens over end-to-end latency), TTFT and ITL percentiles, and hit ratios from /metrics
(``vllm:prompt_tokens_cached_by_source_total`` over ``vllm:prompt_tokens_total``; sidecars also
kvtierd's ``kvtier_hit_chunks_total`` over ``kvtier_lookup_chunks_total``).

Headline ratios (at concurrency 4, multi-round, one run; kvtier means sidecar unless named):
``throughput_vs_vllm_alone`` (target >= 2.0), ``ttft_p50_vs_vllm_alone`` (<= 0.25),
``ttft_p99_vs_vllm_alone`` (<= 0.5), ``no_reuse_throughput_vs_vllm_alone`` and
``..._embedded`` (>= 0.98), ``spec_throughput_vs_vllm_alone_spec`` (>= 2.0),
``throughput_vs_example_connector`` (>= 1.5); ``targets`` says which were met. A user's first
round is a cold prefill for every server (a quarter of the requests), so the TTFT p99 of a
level is a cold prefill's; ``ttft_p50/p99_vs_vllm_alone_later_rounds`` compare the TTFT of the
other rounds only.

``--profile`` (and always with ``--json``): the kvtier sidecar server runs with vLLM's torch
profiler (``--profiler-config``: CPU activity, Python stacks, JSON traces) and records one more
multi-round level (4 users x 2 rounds, 8-token answers, new contexts) between
``/start_profile`` and ``/stop_profile``. In the worker's trace, step time is the sum of vLLM's
``execute_context_*_generation_*`` annotations, the model's is ``gpu_model_runner: forward``
(``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``), kvtier's is the union of the connector's ``kvtier:``
ranges (else of the Python events in ``kvtier_vllm`` modules: ``kvtier_ranges:
"python_functions"``); ``kvtier_step_share`` is kvtier's time in steps over step time, an upper
bound (Python-stack tracing slows Python more than kernels). Scheduler-side hooks run in
another process (CPU builds run the multiprocess executor) and are not in that trace.

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
import contextlib
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import serving_figures, serving_gpu_ratio
from benchmarks.harness.cli import MODEL_CACHE, emit
from benchmarks.harness.connector import connector_knows
from benchmarks.harness.system import CpuShare
from benchmarks.models import MODELS, PRESENT, ServingModel
from benchmarks.serving_cases import (
    BLOCK_SIZE,
    CAPTURE_LAYERS,
    FULL,
    HEADLINE_CONCURRENCY,
    QUICK,
    ROUNDS,
    SERVERS,
    USERS,
    VLLM,
    WARMUP,
    Case,
    Mode,
    Plan,
    every_case,
    gpu_ratio_cases,
    server_names,
)
from benchmarks.serving_figures import Outcome, daemon_cpu_seconds, profile_level
from benchmarks.serving_lmcache import lmcache_python
from benchmarks.serving_no_reuse import NoReusePhase
from benchmarks.serving_pairs import PairedLevels, Up
from benchmarks.serving_report import clean, result_of, tables, write_docs
from benchmarks.serving_servers import Servers
from kvtier.bench import BenchConfig, BenchError, LevelResult, WorkloadSpec, run_level
from tests.fixtures import models
from tests.fixtures.servers import ServerError, VllmServer, error_line, log_tail

log = logging.getLogger("kvtier.bench.serving")

ROOT = Path(__file__).resolve().parents[1]


class Bench:
    def __init__(
        self,
        mode: Mode,
        cache_dir: Path,
        *,
        sizes: ServingModel = PRESENT,
        lmcache: str = "",
        blocks_per_chunk: int,
        concurrency: tuple[int, ...],
        profile: bool,
        connector_extra: dict[str, Any] | None = None,
        only: set[str] | None = None,
        no_reuse_only: bool = False,
        doc_tokens: int | None = None,
    ) -> None:
        self.mode = mode
        self.sizes = sizes
        self.policies = connector_knows("load_policy")
        self.no_reuse_only = no_reuse_only
        self.connector_extra = dict(connector_extra or {})
        self.only = only
        self.bpc = blocks_per_chunk
        self.concurrency = concurrency
        self.profile = profile
        cache_dir.mkdir(parents=True, exist_ok=True)
        tokenizer = models.build_tokenizer(cache_dir)
        self.model = sizes.build(cache_dir, tokenizer)
        self.draft = sizes.build_draft(cache_dir, tokenizer)
        self.vocab = models.vocab_size_of(self.model)
        self.root = Path(tempfile.mkdtemp(prefix="kvt-serving-"))  # short: vLLM's unix sockets
        config = json.loads((self.model / "config.json").read_text())
        per_token = self.kv_per_token = models.kv_bytes_per_token(self.model)
        chunk_bytes = per_token * BLOCK_SIZE * blocks_per_chunk
        self.doc_fit = None  # the GPU-ratio model's prompts: fitted here unless asked
        if sizes.gpu_ratio:
            self.sizes, self.doc_fit = serving_gpu_ratio.fitted_sizes(self, doc_tokens)
        chunks = self.workload().longest_request() // (BLOCK_SIZE * blocks_per_chunk)
        self.servers = Servers(
            self.root,
            self.model,
            self.draft,
            sizes=self.sizes,
            lmcache_python=lmcache,
            blocks_per_chunk=blocks_per_chunk,
            chunk_bytes=chunk_bytes,
            working_set_bytes=USERS * chunks * chunk_bytes,
            kv_per_token=per_token,
            hidden_per_token=len(CAPTURE_LAYERS) * config["hidden_size"] * 2,  # captured in bf16
            connector_extra=self.connector_extra,
        )
        requests, pairs = USERS * ROUNDS * self.sizes.level_scale, self.sizes.gpu_ratio * mode.pairs
        self.pairs = PairedLevels(self.level, self.workload, requests, pairs)
        phase = (mode.no_reuse_cycles, self.sizes.level_scale)
        self.no_reuse = NoReusePhase(self.servers, self.level, self.workload, self.failed, *phase)

    def workload(self, kind: str = "multi-round", **overrides: Any) -> WorkloadSpec:
        settings: dict[str, Any] = {
            "kind": kind,
            "doc_tokens": self.sizes.doc_tokens,
            "question_tokens": self.sizes.question_tokens,
            "answer_tokens": self.sizes.answer_tokens,
            "rounds": ROUNDS,
            "vocab_size": self.vocab,
            "min_token_id": len(models.SPECIAL_TOKENS),
            "seed": 1,
        }
        settings.update(overrides)
        return WorkloadSpec(**settings)

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

    def started(self, out: Outcome, server: VllmServer, plan: Plan) -> None:
        out.start_s = server.start_s
        out.log_path = str(server.log)
        log.info("%s: healthy in %.1f s", out.case.name, server.start_s)
        if plan.measure_prefill:
            out.prefill = serving_gpu_ratio.engine_prefill(self, server)
            self.servers.scale_lmdb_disk(out.prefill["prefill_s_per_token"])

    def run_case(self, case: Case, plan: Plan, reference: Up | None = None) -> Outcome:
        """``case``'s levels: one per concurrency, or with a ``reference`` up (vLLM alone), its
        pairs beside it (benchmarks/serving_pairs.py)."""
        out = Outcome(case)
        started = time.perf_counter()
        log.info("%s: starting", case.name)
        try:
            with self.servers.server(case, plan) as (server, metrics_url):
                self.started(out, server, plan)
                warmup = WARMUP
                daemon = self.servers.daemons.get(case.name)
                before = daemon.counters() if daemon is not None else {}
                decisions = serving_gpu_ratio.decision_counters(server.url)
                dropper, spec = self.servers.page_cache_dropper(case), self.workload()
                with dropper or contextlib.nullcontext():
                    if reference is not None:
                        cpu_s = lambda: daemon_cpu_seconds(daemon)  # noqa: E731
                        out.pairs = list(self.pairs.run((server, metrics_url), reference, cpu_s))
                    out.multi_round = [pair.server for pair in out.pairs]
                    out.daemon_cpu_s = [pair.cpu_s for pair in out.pairs]
                    for i, c in enumerate(self.concurrency if not out.pairs else ()):
                        daemon_cpu = daemon_cpu_seconds(daemon)
                        requests = USERS * ROUNDS * self.sizes.level_scale
                        level = self.level(server, metrics_url, spec, c, requests, i, warmup)
                        out.multi_round.append(level)
                        cpu_s = daemon_cpu_seconds(daemon) - daemon_cpu
                        out.daemon_cpu_s.append(cpu_s)
                        log.info("  %s", serving_figures.describe_kvtier_time(level, cpu_s))
                        warmup = 0
                out.page_cache_drops = dropper.drops if dropper else 0
                out.load_decisions = serving_gpu_ratio.decisions_between(
                    decisions, serving_gpu_ratio.decision_counters(server.url)
                )
                if daemon is not None:
                    after = daemon.counters()
                    out.daemon_counters = {
                        k: v - before.get(k, 0)
                        for k, v in sorted(after.items())
                        if v != before.get(k, 0)
                    }
                if plan.profile:
                    traces = self.root / server.tmp.name / "traces"
                    out.profile = profile_level(
                        self.level, self.workload, traces, server, metrics_url
                    )
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

    def reference(
        self, stack: contextlib.ExitStack[Any], chosen: list[tuple[Case, Plan]]
    ) -> tuple[Outcome, Up] | None:
        """vLLM alone up (its prefill measured) for every other server's pairs, where the run
        pairs levels and vLLM alone runs first; None otherwise."""
        if not (chosen and chosen[0][0] is VLLM and self.pairs.pairs and len(chosen) > 1):
            return None
        out, plan = Outcome(VLLM), chosen[0][1]
        log.info("%s: starting, kept up beside every other server", VLLM.name)
        server, metrics_url = stack.enter_context(self.servers.server(VLLM, plan))
        self.started(out, server, plan)
        return out, (server, metrics_url)

    # -- all --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        share = CpuShare()
        cases = gpu_ratio_cases(self.policies) if self.sizes.gpu_ratio else every_case(self.profile)
        chosen = [
            (case, plan)
            for case, plan in cases
            if (self.only is None or case.name in self.only) and not self.no_reuse_only
        ]
        with contextlib.ExitStack() as stack:
            alone = self.reference(stack, chosen)
            outcomes = {
                case.name: self.run_case(case, plan, alone[1] if alone else None)
                for case, plan in chosen[bool(alone) :]
            }
        if alone:  # its levels are the pairs'
            alone[0].multi_round = [p.alone for o in outcomes.values() for p in o.pairs]
            outcomes = {VLLM.name: alone[0], **outcomes}
        ratios = {}
        if self.sizes.gpu_ratio:  # now, while no server runs
            chunk_tokens = self.bpc * BLOCK_SIZE
            ratios = serving_gpu_ratio.measure(outcomes, self.servers, chunk_tokens, self.doc_fit)
        cycles = self.no_reuse.run(outcomes, self.only)
        result = result_of(self, outcomes, cycles, ratios)
        result["wall_s"] = time.perf_counter() - started
        result["other_processes_cpu_share"] = share.others()
        return result

    def close(self) -> None:
        self.servers.close()


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
    parser.add_argument("--model", choices=sorted(MODELS), default=PRESENT.name)
    parser.add_argument(
        "--doc-tokens", type=int, help="gpu-ratio's document length (default: fitted first)"
    )
    parser.add_argument(
        "--lmcache-python",
        help="LMCache's environment's python (gpu-ratio's LMCache server; default: the one "
        "scripts/lmcache-env.sh builds, where it exists)",
    )
    parser.add_argument(
        "--no-reuse-cycles", type=int, help="no-reuse cycles (3 quick, 12 full; 0: none)"
    )
    parser.add_argument(
        "--no-reuse-only", action="store_true", help="the no-reuse phase alone: no multi-round"
    )
    parser.add_argument(
        "--pairs", type=int, help="gpu-ratio: levels beside vLLM alone's (3 quick, 6 full; 0: none)"
    )
    parser.add_argument("--concurrency", type=parse_list, help="multi-round levels")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=MODEL_CACHE,
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
    )  # the GPU-ratio model's: vllm, lmcache, kvtier_* (with _always or _measured)
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    logging.getLogger("kvtier").setLevel(logging.WARNING)
    log.setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    known = server_names(MODELS[args.model].gpu_ratio, connector_knows("load_policy"))
    unknown = set(args.servers.split(",")) - set(known) if args.servers else set()
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)} (choose from {', '.join(known)})")
    mode = QUICK if args.quick else FULL
    if args.no_reuse_cycles is not None:
        mode = replace(mode, no_reuse_cycles=args.no_reuse_cycles)
    if args.pairs is not None:
        mode = replace(mode, pairs=args.pairs)
    concurrency = args.concurrency or mode.concurrency
    if HEADLINE_CONCURRENCY not in concurrency:
        concurrency = tuple(sorted({*concurrency, HEADLINE_CONCURRENCY}))
    bench = Bench(
        mode,
        args.cache_dir,
        sizes=MODELS[args.model],
        lmcache=lmcache_python(args.lmcache_python),
        blocks_per_chunk=args.blocks_per_chunk,
        concurrency=concurrency,
        profile=args.profile or args.json,
        connector_extra=args.connector_extra,
        only=set(args.servers.split(",")) if args.servers else None,
        no_reuse_only=args.no_reuse_only,
        doc_tokens=args.doc_tokens,
    )
    try:
        result = bench.run()
        if mode is FULL and bench.only is None and not bench.sizes.gpu_ratio:
            write_docs(result, args.docs)
    finally:
        bench.close()
        if not args.keep:
            shutil.rmtree(bench.root, ignore_errors=True)
    emit(clean(result), args.json, lambda: tables(clean(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
