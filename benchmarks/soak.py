"""Months of kvtier in minutes: three kvtierd nodes sharing one bucket through a schedule of
model switches, draft revisions, side pools switched on and off, lmdb readers and kvtierd
itself SIGKILLed, and a full disk.

Usage: ``python -m benchmarks.soak [--quick] [--json]``

Real parts only: each node is a ``kvtier serve`` process (`KvtierdProcess`) with a small arena
(node 0's 8 MiB with ``--quick``, else 16 MiB; 1 MiB extents; at most 16 slot classes) and
lmdb budget (8 MiB), driven through kvtier's gRPC data plane as an engine drives it
(`soak_nodes`). Node 0 keeps lmdb and its event log (the fleet events' replay log, published on
a loopback port) on a tmpfs mounted with a size (lmdb's budget and headroom), so that a ballast
file fills the disk for real; where mounting is refused a note is printed and the disk_full
event is skipped. The three nodes share one bucket of moto's S3 server, reached with IRSA-style
credentials, each with an object budget (3 MiB) whose sum (9 MiB) exceeds the 6 MiB the bucket
is meant to hold; each reaches it through a proxy of its own that records which node wrote and
deleted which object (`soak_bucket`).

The schedule (`soak_schedule`): ``model_switch`` (a new model with a new chunk size: at least
20 in the full run, 4 with ``--quick``), and between them, in turn, ``draft_revision``,
``hidden_on``/``hidden_off`` and ``encoder_on``/``encoder_off`` (node 0's side pools, storing
new captures every round while on), ``reader_kill`` (processes reading node 0's lmdb map,
SIGKILLed inside their read transaction), ``disk_full`` (traffic while a ballast file holds the
tmpfs, then the ballast removed) and ``kvtierd_kill`` (node 0's daemon SIGKILLed and started
again). After each event, rounds of traffic run until node 0's hit rate on its current model is
back within 10 % of the steady state measured on the first model.

Reported per event type: ``recovery_s_max``/``_median`` (event, or the disk given back, to the
end of the first round within 10 % of steady; ``not_recovered`` counts those still short of it
after the mode's deadline, 10 s with ``--quick``, else 20 s), ``refused_stores_with_room``
(chunks node 0's arena refused while it held clean chunks other than the prompt's own: room
that could have been made; a refusal while every other chunk waits for write-back is right, and
counted only in ``refused_stores``), node 0's ``lmdb_store_rejected``,
``disk_full_errors`` and ``stale_readers_cleared`` (its counters over the event and recovery),
``foreign_objects_deleted`` (objects that vanished although none of their uploaders deleted
them, or that a node deleted without having uploaded them), ``bytes_above_budget_max`` (a
node's own objects in the bucket beyond its budget) and ``wedged`` (tiers that took no new
chunks after the event: node 0's arena on a new prompt of the current model, and after
reader_kill, disk_full and kvtierd_kill its lmdb, on a new prompt of a probe model, within the
mode's deadline; ``node0/kvtierd`` where kvtierd did not start again after its SIGKILL, and
was started once more). Overall: ``wedged_tiers`` (how many times a tier was found wedged: after the
events, and at the end every node's arena, lmdb and object tier),
``recovery_s_after_model_switch`` (the slowest, null if one did not recover),
``objects_overwritten`` (uploads that replaced another node's object), and each node's vitals
after warm-up and at the end: RSS, open files, lmdb map use, event-log bytes, live namespaces,
slot classes and free arena extents, with ``rss_growth_ratio`` (of kvtierd's own memory,
RssAnon: its RSS without the arena's and lmdb's mapped pages, which fill up to their configured
sizes over the first models; the largest over nodes, from after warm-up; a node SIGKILLed is a
new daemon warming up again, judged only once it ran as many events again, so node 0, killed
every 16 events, is not judged in the full run; ``rss_with_mappings_growth_ratio`` is the same
of the whole RSS). Warm-up is the rounds on the first model and, in the full run, the
schedule's first 16 events (every kind once): each path's first use allocates what kvtierd
keeps for good (imports, gRPC's and lmdb's buffers), which is not growth.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.harness.sizes import MiB
from benchmarks.harness.targets import Target, met
from benchmarks.soak_bucket import Ledger, RecordingProxy, create_bucket
from benchmarks.soak_nodes import Node, Vitals
from benchmarks.soak_schedule import FULL, QUICK, Mode, Soak
from kvtier.tiers.commit_checksums import ledger_path
from kvtier.tiers.lmdb_env import MAP_HEADROOM
from tests.fixtures.processes import free_port
from tests.fixtures.s3 import MotoServer, irsa_env

log = logging.getLogger("kvtier.bench.soak")

BUCKET = "kvtier-soak"
NODES = 3
ARENA_BYTES = 16 * MiB
"""The arena of nodes other than node 0 (whose size the mode sets)."""
MAX_SLOT_CLASSES = 16
"""Fewer than the run registers: classes nothing uses must expire."""
LMDB_BUDGET = 8 * MiB
OBJECT_BUDGET = 3 * MiB
BUCKET_BYTES = 6 * MiB
"""What the bucket should hold: less than the nodes' budgets together."""
PACK_BYTES = 256 << 10
IDLE_S = 2.0
"""Time compressed: a model's namespaces expire this long after its engines moved on (an hour by
default), and dead lmdb readers are looked for this often (30 s by default)."""
EVENT_LOG_BYTES = 1 * MiB
"""Reached within the run: the log's bytes must stay flat past it."""
DISK_BYTES = LMDB_BUDGET + MAP_HEADROOM + 8 * MiB
"""kvtierd checks at start that lmdb's budget and its headroom fit the disk."""
TARGETS: dict[str, Target] = {
    "wedged_tiers": ("<=", 0),
    "foreign_objects_deleted": ("<=", 0),
    "recovery_s_after_model_switch": ("<=", 10.0),
    "rss_growth_ratio": ("<=", 1.1),
    "bytes_above_budget_max": ("<=", PACK_BYTES),
}


@contextlib.contextmanager
def small_disk(path: Path, nbytes: int) -> Iterator[bool]:
    """A tmpfs of ``nbytes`` at ``path``; False (a plain directory) where mounting is refused."""
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={nbytes},mode=0700", "tmpfs", str(path)]
    try:
        mounted = subprocess.run(mount, capture_output=True, text=True, check=False)
    except OSError as exc:
        print(f"note: no tmpfs ({exc}): the disk_full event is skipped", file=sys.stderr)
        yield False
        return
    if mounted.returncode != 0:
        why = mounted.stderr.strip() or f"exit {mounted.returncode}"
        print(f"note: no tmpfs ({why}): the disk_full event is skipped", file=sys.stderr)
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def node_config(i: int, root: Path, disk: Path, mode: Mode) -> dict[str, Any]:
    state = disk if i == 0 else root / f"node{i}"
    config: dict[str, Any] = {
        "arena": {
            "path": f"/dev/shm/kvtier-soak-{os.getpid()}-node{i}",
            "size_bytes": mode.arena_bytes if i == 0 else ARENA_BYTES,
            "extent_bytes": MiB,
            "min_slot_bytes": 4096,
            "max_slot_classes": MAX_SLOT_CLASSES,
        },
        "lmdb": {
            "path": str(state / "lmdb"),
            "budget_bytes": LMDB_BUDGET,
            "reader_check_interval_s": IDLE_S,
        },
        "object": {
            "url": f"s3://{BUCKET}/objects",
            "index_path": str(root / f"node{i}" / "objindex"),
            "index_map_bytes": 16 * MiB,
            "budget_bytes": OBJECT_BUDGET,
            "pack_target_bytes": PACK_BYTES,
            "pack_linger_ms": 20.0,
            "request_timeout_s": 5.0,
        },
        "server": {
            "socket_path": str(root / f"node{i}" / "kvtierd.sock"),
            "admin_token_file": str(root / f"node{i}" / "admin.token"),
            "namespace_idle_s": IDLE_S,
            "admin_address": "127.0.0.1:0",
            "metrics_address": "127.0.0.1:0",
        },
    }
    if i == 0:
        config["events"] = {
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "log_path": str(disk / "events"),
            "log_bytes": EVENT_LOG_BYTES,
        }
    return config


def run(mode: Mode) -> dict[str, Any]:
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    ledger = Ledger(BUCKET)
    with contextlib.ExitStack() as stack:  # undone in reverse: nodes, proxies, disk, moto, files
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        moto = MotoServer(root / "moto.log").start()
        stack.callback(moto.stop)
        create_bucket(moto.url, BUCKET)
        mounted = stack.enter_context(small_disk(root / "disk", DISK_BYTES))
        nodes: list[Node] = []
        for i in range(NODES):
            name = f"node{i}"
            proxy = RecordingProxy(name, moto.url, ledger)
            stack.callback(proxy.close)
            (root / name).mkdir()
            config = node_config(i, root, root / "disk", mode)
            node = Node(name, root / name / "daemon", config, irsa_env(root, proxy.url))
            stack.callback(stop_node, node)
            node.start()
            nodes.append(node)
        budgets = {node.name: OBJECT_BUDGET for node in nodes}
        soak = Soak(mode, nodes, ledger, moto.url, budgets, root / "disk")
        soak.can_fill_disk = mounted
        soak.log = lambda line: print(
            f"[{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True
        )
        return measure(soak, nodes, mounted, started)


def stop_node(node: Node) -> None:
    try:
        node.stop()
    except Exception:
        log.exception("%s did not stop", node.name)
    arena = Path(node.config["arena"]["path"])
    arena.unlink(missing_ok=True)
    ledger_path(arena).unlink(missing_ok=True)  # left beside it by the kvtierd SIGKILLed


def measure(soak: Soak, nodes: list[Node], mounted: bool, started: float) -> dict[str, Any]:
    soak.warm_up()
    first = {node.name: node.vitals() for node in nodes}
    soak.baseline = dict(first)
    for _event in soak.run():
        pass
    first.update(soak.baseline)  # after the warm-up events, or a node's last start
    wedged = soak.wedged_tiers()
    end = {node.name: node.vitals() for node in nodes}
    switches = soak.figures["model_switch"].recovery_s
    slowest = None if None in switches else max(r for r in switches if r is not None)
    # kvtierd's own memory: the arena's and lmdb's mapped pages fill to their sizes over the
    # first models (warm-up, bounded by the configuration), and are not growth
    judged = sorted(soak.baseline)  # a node restarted within its warm-up is not
    growth = max(end[n].own_bytes / soak.baseline[n].own_bytes for n in judged)
    rss_growth = max(end[n].rss_bytes / soak.baseline[n].rss_bytes for n in judged)
    figures: dict[str, Any] = {
        "mode": soak.mode.name,
        "seconds": time.monotonic() - started,
        "tmpfs": mounted,
        "steady_hit_rate": soak.steady,
        "model_switches": len(switches),
        "events": {name: f.summary() for name, f in soak.figures.items()},
        "wedged_tiers": len(wedged)
        + sum(len(f.summary()["wedged"]) for f in soak.figures.values()),
        "wedged": wedged,
        "recovery_s_after_model_switch": slowest,
        "refused_stores_with_room": sum(f.refused_stores_with_room for f in soak.figures.values()),
        "foreign_objects_deleted": soak.foreign,
        "foreign_examples": soak.foreign_examples,
        "objects_overwritten": soak.overwritten,
        "bytes_above_budget_max": soak.above_max,
        "bytes_above_budget_by_node": soak.above_by_node,
        "bucket_bytes_max": soak.bucket_max,
        "budgets": {
            "object_bytes": OBJECT_BUDGET,
            "bucket_bytes": BUCKET_BYTES,
            "pack_bytes": PACK_BYTES,
        },
        "vitals": {
            "start": {n: dataclasses.asdict(v) for n, v in first.items()},
            "end": {n: dataclasses.asdict(v) for n, v in end.items()},
        },
        "rss_growth_ratio": growth,
        "rss_with_mappings_growth_ratio": rss_growth,
        "rss_growth_nodes": judged,
    }
    figures["targets"] = {
        name: {"target": f"{op} {bound:g}", "met": met(figures[name], op, bound)}
        for name, (op, bound) in TARGETS.items()
    }
    return figures


def print_report(figures: dict[str, Any]) -> None:
    console = Console(highlight=False, width=160)
    table = Table(title=f"soak ({figures['mode']}, {figures['seconds']:.0f} s)")
    columns = (
        "count", "recovery_s_max", "recovery_s_median", "not_recovered",
        "refused_stores_with_room", "lmdb_store_rejected", "disk_full_errors",
        "stale_readers_cleared", "foreign_objects_deleted",
        "bytes_above_budget_max", "wedged",
    )  # fmt: skip
    table.add_column("event")
    for column in columns:
        table.add_column(column.replace("_", " "), justify="right")
    for event, row in figures["events"].items():
        table.add_row(event, *(_cell(row[c]) for c in columns))
    console.print(table)
    vitals = Table(title="node vitals: after warm-up (or a node's last start) -> end")
    vitals.add_column("node")
    fields = [f.name for f in dataclasses.fields(Vitals)]
    for name in fields:
        vitals.add_column(name.replace("_", " "), justify="right")
    start, end = figures["vitals"]["start"], figures["vitals"]["end"]
    for node in start:
        vitals.add_row(node, *(f"{_cell(start[node][f])} -> {_cell(end[node][f])}" for f in fields))
    console.print(vitals)
    console.print(
        "rss_growth_ratio: kvtierd's own memory (RssAnon) at the end over after warm-up, the "
        f"largest of {', '.join(figures['rss_growth_nodes'])} (a node SIGKILLed within its "
        "warm-up of the end is not judged); with the arena's and lmdb's mapped pages, which "
        f"fill up to their sizes: {figures['rss_with_mappings_growth_ratio']:.2f}"
    )
    for name, target in figures["targets"].items():
        verdict = "met" if target["met"] else "MISSED"
        console.print(f"{name}: {_cell(figures[name])} (target {target['target']}: {verdict})")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, list):
        return ",".join(value) or "-"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short schedule (< 2 min)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # SIGTERM unwinds like an error: nodes stopped, the tmpfs unmounted, files removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"{parser.prog}: terminated"))
    figures = run(QUICK if args.quick else FULL)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print_report(figures)


if __name__ == "__main__":
    main()
