"""`kvtier top`: a live terminal view of one kvtierd, read from its /metrics endpoint.

It shows what an operator looks at first: each tier's use and hit ratio, bytes moved per second,
queue depths and the most recent evictions. Rates are differences between two scrapes, so the
first frame comes one interval after the start. ``--once`` prints one frame and exits; on a
terminal the view is redrawn in place (rich's `Live`), elsewhere each frame is printed after the
last.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvtier.core.config import load_config
from kvtier.core.protocol import TierCode

TIERS = tuple(code.tier for code in TierCode)
DIRECTIONS = ("store", "load", "demote", "promote", "upload", "download")
QUEUES = ("writeback", "promote", "upload")
PIPE_WIDTH = 160
"""Columns of a frame written to a pipe or file, which has no width: wide enough for every
table, so none wraps."""

Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True)
class Scrape:
    at: float
    samples: dict[str, list[tuple[dict[str, str], float]]]

    def total(self, name: str, **match: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``match``."""
        return sum(
            value
            for labels, value in self.samples.get(name, [])
            if all(labels.get(k) == v for k, v in match.items())
        )

    def has(self, name: str, **match: str) -> bool:
        return any(
            all(labels.get(k) == v for k, v in match.items())
            for labels, _ in self.samples.get(name, [])
        )

    def labels(self, name: str) -> list[dict[str, str]]:
        return [labels for labels, _ in self.samples.get(name, [])]


def scrape(url: str, timeout_s: float = 5.0) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return Scrape(time.monotonic(), samples)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError("unreachable")


def _ratio(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _table(header: tuple[str, ...], rows: Iterable[tuple[object, ...]]) -> Table:
    table = Table(*header, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        table.add_row(*(Text(str(c)) for c in row))  # Text: label values are never markup
    return table


@dataclass
class View:
    """Keeps the previous scrape and the recent evictions between frames."""

    url: str
    evictions: deque[tuple[str, str, str, int]] = field(default_factory=lambda: deque(maxlen=8))

    def frame(self, before: Scrape, now: Scrape) -> Group:
        dt = max(now.at - before.at, 1e-9)

        def delta(name: str, **match: str) -> float:
            return max(0.0, now.total(name, **match) - before.total(name, **match))

        self._note_evictions(before, now)
        out: list[RenderableType] = []
        version = next(iter(now.labels("kvtier_build_info")), {}).get("version", "?")
        stamp = time.strftime("%H:%M:%S")
        out.append(Text(f"kvtier top  {self.url}  {stamp}  kvtier {version}", style="bold"))
        sessions, leases = now.total("kvtier_sessions"), now.total("kvtier_leases")
        out.append(
            Text(
                f"sessions {sessions:.0f}  leases {leases:.0f}"
                f"  reservations {now.total('kvtier_reservations'):.0f}  {self._object_line(now)}"
            )
        )
        out.append(Text())
        lookups_now = delta("kvtier_lookup_chunks_total")
        lookups_all = now.total("kvtier_lookup_chunks_total")
        rows = []
        for tier in TIERS:
            if not now.has("kvtier_tier_capacity_bytes", tier=tier):
                continue
            used = now.total("kvtier_tier_used_bytes", tier=tier)
            capacity = now.total("kvtier_tier_capacity_bytes", tier=tier)
            hits = delta("kvtier_hit_chunks_total", tier=tier)
            rows.append(
                (
                    tier,
                    _size(used),
                    _size(capacity) if capacity else "unbounded",
                    _ratio(used, capacity),
                    f"{now.total('kvtier_tier_chunks', tier=tier):.0f}",
                    f"{hits / dt:.1f}",
                    _ratio(hits, lookups_now),
                    _ratio(now.total("kvtier_hit_chunks_total", tier=tier), lookups_all),
                    f"{delta('kvtier_evictions_total', tier=tier) / dt:.1f}",
                )
            )
        hits_now = delta("kvtier_hit_chunks_total")
        rows.append(
            (
                "all",
                "",
                "",
                "",
                "",
                f"{hits_now / dt:.1f}",
                _ratio(hits_now, lookups_now),
                _ratio(now.total("kvtier_hit_chunks_total"), lookups_all),
                "",
            )
        )
        out.append(
            _table(
                (
                    "TIER",
                    "USED",
                    "CAPACITY",
                    "USE",
                    "CHUNKS",
                    "HITS/s",
                    "HIT% NOW",
                    "HIT% TOTAL",
                    "EVICT/s",
                ),
                rows,
            )
        )
        out.append(Text(f"looked up {lookups_now / dt:.1f} chunks/s"))
        out.append(Text())
        out.append(self._pools(now))
        out.append(Text())
        out.append(
            _table(
                ("DIRECTION", "BYTES/s", "CHUNKS/s", "FAILED/s"),
                [
                    (
                        d,
                        _size(delta("kvtier_transfer_bytes_total", direction=d) / dt) + "/s"
                        if now.has("kvtier_transfer_bytes_total", direction=d)
                        else "-",
                        f"{delta('kvtier_transfer_chunks_total', direction=d) / dt:.1f}",
                        f"{delta('kvtier_transfer_failures_total', direction=d) / dt:.1f}",
                    )
                    for d in DIRECTIONS
                    if now.has("kvtier_transfer_chunks_total", direction=d)
                ],
            )
        )
        out.append(Text())
        queues = [
            f"{q} {now.total('kvtier_queue_depth_chunks', queue=q):.0f}"
            f"/{now.total('kvtier_queue_capacity_chunks', queue=q):.0f}"
            for q in QUEUES
            if now.has("kvtier_queue_depth_chunks", queue=q)
        ]
        dropped = now.total("kvtier_queue_dropped_chunks_total")
        out.append(Text("queues  " + "  ".join(queues) + f"  dropped {dropped:.0f}"))
        out.append(Text())
        out.append(Text("RECENT EVICTIONS", style="bold"))
        if self.evictions:
            out.append(
                _table(
                    ("TIME", "TIER", "REASON", "CHUNKS"),
                    [(t, tier, reason, f"+{n}") for t, tier, reason, n in reversed(self.evictions)],
                )
            )
        else:
            out.append(Text("(none)"))
        return Group(*out)

    @staticmethod
    def _pools(now: Scrape) -> Table:
        """What each pool (target, draft, hidden, encoder) holds in each tier."""
        pools = sorted({labels.get("pool", "") for labels in now.labels("kvtier_tier_chunks")})
        tiers = [t for t in TIERS if now.has("kvtier_tier_capacity_bytes", tier=t)]
        rows = [
            (
                pool,
                *(_size(now.total("kvtier_tier_used_bytes", tier=t, pool=pool)) for t in tiers),
                f"{now.total('kvtier_tier_chunks', pool=pool):.0f}",
            )
            for pool in pools
            if pool
        ]
        return _table(("POOL", *(t.upper() for t in tiers), "CHUNKS"), rows)

    def _note_evictions(self, before: Scrape, now: Scrape) -> None:
        stamp = time.strftime("%H:%M:%S")
        for labels in now.labels("kvtier_evictions_total"):
            tier, reason = labels.get("tier", "?"), labels.get("reason", "?")
            n = now.total("kvtier_evictions_total", tier=tier, reason=reason) - before.total(
                "kvtier_evictions_total", tier=tier, reason=reason
            )
            if n > 0:
                self.evictions.append((stamp, tier, reason, int(n)))

    @staticmethod
    def _object_line(now: Scrape) -> str:
        if not now.has("kvtier_object_store_info"):
            return "object store: none"
        info = now.labels("kvtier_object_store_info")[0]
        state = next(
            (
                labels["state"]
                for labels, value in now.samples.get("kvtier_object_store_breaker_state", [])
                if value == 1
            ),
            "?",
        )
        health = "healthy" if now.total("kvtier_object_store_healthy") == 1 else "UNHEALTHY"
        return f"object store {health} (breaker {state}) as {info.get('principal', '?')}"


def metrics_url(args: argparse.Namespace) -> str:
    if args.metrics_url:
        return str(args.metrics_url)
    address = load_config(args.config).server.metrics_address
    if not address:
        raise ValueError("server.metrics_address is empty: pass --metrics-url")
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"
    return f"http://{host}:{port}/metrics"


def run(args: argparse.Namespace) -> int:
    url = metrics_url(args)
    view = View(url)
    tty = sys.stdout.isatty()
    console = Console(highlight=False, width=None if tty else PIPE_WIDTH)
    before = scrape(url)

    def frames() -> Iterable[Group]:
        nonlocal before
        while True:
            time.sleep(args.interval)
            now = scrape(url)
            yield view.frame(before, now)
            before = now

    try:
        if args.once or not tty:  # a pipe gets each frame after the last, never cursor moves
            for frame in frames():
                console.print(frame)
                if args.once:
                    break
        else:
            with Live(console=console, screen=True, auto_refresh=False) as live:
                for frame in frames():
                    live.update(frame, refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Adds ``top`` to the `kvtier` command line."""
    top = sub.add_parser(
        "top", parents=[common], help="live view of tiers, hit ratios, bandwidth and evictions"
    )
    top.add_argument("--metrics-url", help="default: http://<server.metrics_address>/metrics")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(func=run)
