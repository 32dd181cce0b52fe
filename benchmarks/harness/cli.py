"""What the benchmarks' command lines share: where the locally built models are cached, and a
run's result printed as one JSON object or as its table."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MODEL_CACHE = Path.home() / ".cache" / "kvtier-bench"
"""``--cache-dir``'s default: built models are reused from here by every benchmark."""


def model_bench_args(description: str, argv: list[str] | None) -> argparse.Namespace:
    """The command line of a benchmark that builds its models: ``--json`` (print one JSON
    object) and ``--cache-dir``, created if missing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cache-dir", type=Path, default=MODEL_CACHE, help="models")
    args = parser.parse_args(argv)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    return args


def log_progress(log: logging.Logger, *quiet: str) -> None:
    """``log``, a benchmark's own progress, on stderr with times; kvtier's loggers (and those
    named in ``quiet``) only with warnings."""
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    for name in ("kvtier", *quiet):
        logging.getLogger(name).setLevel(logging.WARNING)
    log.setLevel(logging.INFO)


def emit(result: Mapping[str, Any], as_json: bool, table: Callable[[], str]) -> None:
    """``result`` on stdout: one JSON object with ``as_json``, else ``table()``."""
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table())
