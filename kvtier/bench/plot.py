"""Two panels per figure: throughput against interactivity, and TTFT against concurrency; one
curve per run, one point per concurrency level. matplotlib is imported only when plotting."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.bench.errors import BenchError

if TYPE_CHECKING:
    from kvtier.bench.runner import RunResult


@dataclass(frozen=True)
class Curve:
    label: str
    concurrency: list[int]
    output_tps: list[float]
    output_tps_per_user: list[float]
    ttft_p50_s: list[float]
    ttft_p99_s: list[float]

    @classmethod
    def of_run(cls, run: RunResult, label: str | None = None) -> Curve:
        levels = run.levels
        return cls(
            label or f"{run.config.workload.kind} {run.server.model}",
            [lv.concurrency for lv in levels],
            [lv.output_tps for lv in levels],
            [lv.output_tps_per_user for lv in levels],
            [lv.ttft_s.p50 for lv in levels],
            [lv.ttft_s.p99 for lv in levels],
        )

    @classmethod
    def of_json(cls, document: Mapping[str, Any], label: str) -> Curve:
        """From the document `kvtier bench serve --json` prints."""

        def num(value: Any) -> float:
            return math.nan if value is None else float(value)

        try:
            levels = document["levels"]
            return cls(
                label,
                [int(lv["concurrency"]) for lv in levels],
                [num(lv["output_tps"]) for lv in levels],
                [num(lv["output_tps_per_user"]) for lv in levels],
                [num(lv["ttft_s"]["p50"]) for lv in levels],
                [num(lv["ttft_s"]["p99"]) for lv in levels],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BenchError(
                f"{label}: not a `kvtier bench serve --json` document ({exc})"
            ) from None


def load_curves(paths: Sequence[Path], labels: Sequence[str] | None = None) -> list[Curve]:
    if labels and len(labels) != len(paths):
        raise BenchError(f"{len(labels)} labels for {len(paths)} files")
    curves = []
    for i, path in enumerate(paths):
        try:
            document = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise BenchError(f"cannot read {path}: {exc}") from None
        curves.append(Curve.of_json(document, labels[i] if labels else Path(path).stem))
    return curves


def require_matplotlib() -> Any:
    """matplotlib.pyplot on the Agg backend, or a BenchError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise BenchError("plotting needs matplotlib: pip install 'kvtier[bench]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def build_figure(curves: Sequence[Curve]) -> Any:
    """The matplotlib Figure, with its two axes."""
    plt = require_matplotlib()
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    for curve in curves:
        (line,) = tput.plot(curve.output_tps_per_user, curve.output_tps, marker="o")
        line.set_label(curve.label)
        for x, y, c in zip(
            curve.output_tps_per_user, curve.output_tps, curve.concurrency, strict=True
        ):
            tput.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        colour = line.get_color()
        ttft.plot(
            curve.concurrency,
            [v * 1000 for v in curve.ttft_p50_s],
            marker="o",
            color=colour,
            label=f"{curve.label} p50",
        )
        ttft.plot(
            curve.concurrency,
            [v * 1000 for v in curve.ttft_p99_s],
            marker="^",
            linestyle="--",
            color=colour,
            label=f"{curve.label} p99",
        )
    tput.set_xlabel("interactivity (output tokens/s per user)")
    tput.set_ylabel("throughput (output tokens/s)")
    tput.set_title("throughput vs interactivity")
    ttft.set_xlabel("concurrency")
    ttft.set_ylabel("TTFT (ms)")
    ttft.set_title("time to first token")
    ttft.set_xscale("log", base=2)
    ticks = sorted({c for curve in curves for c in curve.concurrency})
    ttft.set_xticks(ticks, [str(c) for c in ticks])
    ttft.minorticks_off()
    for ax in (tput, ttft):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def save_plot(curves: Sequence[Curve], out: Path) -> Path:
    fig = build_figure(curves)
    try:
        fig.savefig(str(out), dpi=100)
    except OSError as exc:
        raise BenchError(f"cannot write {out}: {exc}") from None
    finally:
        require_matplotlib().close(fig)
    return Path(out)
