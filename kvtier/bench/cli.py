"""`kvtier bench serve` and `kvtier bench plot`: argparse wiring over the library."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kvtier.bench.errors import BenchError
from kvtier.bench.workloads import WORKLOADS, WorkloadSpec

if TYPE_CHECKING:
    from kvtier.bench.runner import BenchConfig, RunResult


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help  # nothing worth saying
        return super()._get_help_string(action)


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return levels


def _runner() -> Any:
    # httpx comes with the bench extra: the rest of the kvtier command works without it
    try:
        from kvtier.bench import runner
    except ImportError as exc:
        raise BenchError(f"kvtier bench needs {exc.name}: pip install 'kvtier[bench]'") from None
    return runner


def _config(args: argparse.Namespace) -> BenchConfig:
    make = _runner().BenchConfig
    spec = WorkloadSpec(
        kind=args.workload,
        doc_tokens=args.doc_tokens,
        question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens,
        rounds=args.rounds,
        system_tokens=args.system_tokens,
        suffix_tokens=args.suffix_tokens,
        vocab_size=args.vocab_size,
        min_token_id=args.min_token_id,
        images=args.images,
        image_side=args.image_side,
        image_tokens=args.image_tokens,
        seed=args.seed,
    )
    config: BenchConfig = make(
        url=args.url,
        workload=spec,
        concurrency=args.concurrency,
        requests=args.requests,
        warmup=args.warmup,
        model=args.model,
        timeout_s=args.timeout,
        kvtier_metrics_url=args.kvtier_metrics_url,
    )
    return config


def _sweep_with_progress(config: BenchConfig) -> RunResult:
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        tasks: dict[str, TaskID] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = progress.add_task(phase, total=total)
            progress.update(tasks[phase], completed=done)

        result: RunResult = _runner().run_sweep(config, update)
        return result


def _serve(args: argparse.Namespace) -> int:
    config = _config(args)
    from kvtier.bench.plot import Curve, require_matplotlib, save_plot
    from kvtier.bench.report import print_report, to_json

    if args.plot:
        require_matplotlib()  # fail before the run, not after it
    try:
        run = _sweep_with_progress(config)
    except KeyboardInterrupt:
        raise BenchError("interrupted; no results") from None
    if args.json:
        sys.stdout.write(to_json(run) + "\n")
    else:
        print_report(run)
    if args.plot:
        save_plot([Curve.of_run(run, args.label)], args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    failed = sum(level.errors for level in run.levels)
    if failed:
        sent = sum(level.requests for level in run.levels)
        print(f"kvtier: {failed} of {sent} measured requests failed", file=sys.stderr)
        return 1
    return 0


def _plot(args: argparse.Namespace) -> int:
    from kvtier.bench.plot import load_curves, save_plot

    out = save_plot(load_curves(args.files, args.labels), args.out)
    print(f"plot written to {out}")
    return 0


def add_bench_parser(subparsers: Any) -> None:
    """Register `bench serve` and `bench plot` on the `kvtier` command's subparsers."""
    bench = subparsers.add_parser(
        "bench", help="load-test an OpenAI-compatible server (vLLM, with or without kvtier)"
    )
    sub = bench.add_subparsers(dest="bench_command", required=True)
    d = WorkloadSpec()

    serve = sub.add_parser(
        "serve",
        help="sweep concurrency levels with a token-exact workload",
        formatter_class=_HelpWithDefaults,
    )
    serve.add_argument("--url", required=True, help="the server, e.g. http://localhost:8000")
    serve.add_argument("--model", help="served model name (default: the first one listed)")
    serve.add_argument("--workload", choices=WORKLOADS, default=d.kind, help="prompt pattern")
    serve.add_argument(
        "--concurrency", type=_levels, default="1,2,4,8", help="users in flight per level"
    )
    serve.add_argument("--requests", type=int, default=32, help="measured requests per level")
    serve.add_argument("--warmup", type=int, default=0, help="unmeasured requests per level")
    serve.add_argument("--seed", type=int, default=d.seed, help="same seed, same prompts")
    serve.add_argument(
        "--doc-tokens",
        type=int,
        default=d.doc_tokens,
        help="multi-round: each user's context; no-reuse: each prompt's body",
    )
    serve.add_argument(
        "--question-tokens", type=int, default=d.question_tokens, help="multi-round and no-reuse"
    )
    serve.add_argument(
        "--answer-tokens",
        type=int,
        default=d.answer_tokens,
        help="max_tokens of every request (sent with ignore_eos)",
    )
    serve.add_argument(
        "--rounds", type=int, default=d.rounds, help="multi-round, multimodal: per user"
    )
    serve.add_argument(
        "--images", type=int, default=d.images, help="multimodal: the shared set of images"
    )
    serve.add_argument(
        "--image-side", type=int, default=d.image_side, help="multimodal: pixels a side"
    )
    serve.add_argument(
        "--image-tokens",
        type=int,
        default=d.image_tokens,
        help="multimodal: the model's tokens of one image (checks the fit only)",
    )
    serve.add_argument(
        "--system-tokens",
        type=int,
        default=d.system_tokens,
        help="shared-prefix: the shared system prompt",
    )
    serve.add_argument(
        "--suffix-tokens",
        type=int,
        default=d.suffix_tokens,
        help="shared-prefix: each request's private part",
    )
    serve.add_argument(
        "--vocab-size", type=int, default=d.vocab_size, help="token ids are drawn below this"
    )
    serve.add_argument(
        "--min-token-id",
        type=int,
        default=d.min_token_id,
        help="and from this up, skipping special tokens",
    )
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    serve.add_argument(
        "--kvtier-metrics-url", help="kvtierd's /metrics, for the daemon's hits by tier"
    )
    serve.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (config and levels) and nothing else",
    )
    serve.add_argument("--plot", type=Path, help="also write the two-panel PNG here")
    serve.add_argument("--label", help="the run's name in the plot")
    serve.set_defaults(func=_serve)

    plot = sub.add_parser("plot", help="plot several `bench serve --json` runs together")
    plot.add_argument("files", nargs="+", type=Path)
    plot.add_argument("--out", type=Path, required=True, help="PNG to write")
    plot.add_argument("--labels", nargs="+", help="one per file (default: the file names)")
    plot.set_defaults(func=_plot)


__all__ = ["BenchError", "add_bench_parser"]
