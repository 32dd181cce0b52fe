"""The encoder cache in a TP=2 engine on the CPU build: one worker process per rank, the first
rank writing each output and both ranks reading every hit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_connector import embedded_yaml
from tests.e2e.test_connector_tp import engine
from tests.e2e.test_encoder_cache import FIRST, LATER, MM_LIMITS, ask, counters, ec_config

pytestmark = pytest.mark.slow


def tp2(model: Path, ec: dict[str, Any] | None, cases: list[tuple[str, int]]) -> tuple[Any, Any]:
    with engine(model, 2, None, limit_mm_per_prompt=MM_LIMITS, ec_transfer_config=ec) as llm:
        tokens = ask(llm, cases)
        return tokens, counters(llm) if ec is not None else None


def test_tp2_round_trip(vlm: Path, tmp_path: Path, shm_path: Path) -> None:
    """TP=2 engines store and load encoder outputs. (A short name: vLLM's sockets live under
    the test's temp dir, and a socket path has at most 107 characters.)"""
    alone, _ = tp2(vlm, None, LATER)
    ec = ec_config({"kvtier_config": str(embedded_yaml(tmp_path, shm_path)), "part_kib": 4})
    _, seen = tp2(vlm, ec, FIRST)
    assert seen.stores == 2
    assert seen.stored_bytes == 2 * 16 * 128 * 4  # written once, by the first rank
    tokens, seen = tp2(vlm, ec, LATER)
    assert seen.hits == 2
    assert tokens == alone
