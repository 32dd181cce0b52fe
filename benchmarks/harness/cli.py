"""What the benchmarks' command lines share: where the locally built models are cached, and a
run's result printed as one JSON object or as its table."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MODEL_CACHE = Path.home() / ".cache" / "kvtier-bench"
"""``--cache-dir``'s default: built models are reused from here by every benchmark."""


def emit(result: Mapping[str, Any], as_json: bool, table: Callable[[], str]) -> None:
    """``result`` on stdout: one JSON object with ``as_json``, else ``table()``."""
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table())
