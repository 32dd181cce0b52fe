"""`kvtier locate`: where a prompt's KV is, per tier, and whether loading it beats recomputing."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

Emit = Callable[[argparse.Namespace, Any, Callable[[], None]], None]
Rows = Callable[..., None]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the model, as the engines name it")
    p.add_argument("hashes", nargs="*", help="the prompt's block hashes, hex, in order")
    p.add_argument("--hashes-file", type=Path, help="file of hex block hashes, in order")
    p.add_argument("--tenant", default="", help="default: the default tenant")


def block_hashes(args: argparse.Namespace) -> list[bytes]:
    words = list(args.hashes)
    if args.hashes_file is not None:
        words += args.hashes_file.read_text().split()
    try:
        return [bytes.fromhex(w.removeprefix("0x")) for w in words]
    except ValueError as exc:
        raise SystemExit(f"kvtier locate: block hashes must be hex: {exc}") from None


def _seconds(value: float, measured: bool) -> str:
    return f"{value * 1e3:.1f} ms" if measured else "not measured"


def _row(span: Any, tokens: int) -> tuple[object, ...]:
    load = _seconds(span.load_seconds, span.measured)
    return span.tier, span.chunks, f"{span.tokens} of {tokens}", load


def run(args: argparse.Namespace, admin: Any, emit: Emit, rows: Rows) -> int:
    found = admin.locate(args.model, block_hashes(args), args.tenant)

    def table() -> None:
        rows(
            ("tier", "chunks", "leading tokens", "expected load"),
            [
                (
                    s.tier,
                    s.chunks,
                    f"{s.tokens} of {found.tokens}",
                    _seconds(s.load_seconds, s.measured),
                )
                for s in found.tiers
            ],
        )
        print(f"recompute: {_seconds(found.recompute_seconds, found.recompute_measured)}")

    emit(args, found, table)
    return 0
