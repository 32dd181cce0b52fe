"""The soak's schedule: months of a fleet's events, one after the other, each followed by rounds
of traffic until node 0's current model hits as it did in steady state (or the rounds run out).

Every node serves prompts of its own and one neighbour's (which it finds through the shared
bucket); node 0 also serves its draft, hidden and encoder pools while they are on. What each
event cost is kept per event type (`EventFigures`).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.sizes import KiB, MiB
from benchmarks.soak_bucket import Ledger, listing
from benchmarks.soak_nodes import Model, Node, Served, Vitals, fill_disk
from kvtier.bench.scrape import total
from kvtier.core.keys import Pool

RECOVERED = 0.9
"""Back within 10 % of the steady hit rate."""
CHUNK_KIB = (16, 24, 32, 48, 64, 20, 40, 56, 80, 96, 28, 36, 44, 52, 60, 72, 88, 104, 112, 120)
"""A new chunk size with each model (and each again after these run out, with another model)."""
EXTRAS = (
    "draft_revision",
    "hidden_on",
    "reader_kill",
    "encoder_on",
    "hidden_off",
    "disk_full",
    "encoder_off",
    "kvtierd_kill",
)
"""The events between model switches, in turn."""
Metric = tuple[str, dict[str, str]]
"""A sample's name and the labels it must carry."""
COUNTED: dict[str, Metric] = {
    "lmdb_store_rejected": ("kvtier_store_rejected_chunks_total", {"tier": "lmdb"}),
    "disk_full_errors": ("kvtier_disk_full_errors_total", {}),
    "stale_readers_cleared": ("kvtier_lmdb_stale_readers_total", {}),
}
"""Node 0's counters kept per event type: how much of each the event and its recovery saw."""
STORED: dict[str, Metric] = {
    "lmdb": ("kvtier_tier_events_total", {"event": "stores", "tier": "lmdb"}),
    "object": ("kvtier_object_store_uploads_total", {}),
}
"""What counts a tier below the arena taking chunks."""
OWNED: Metric = ("kvtier_object_store_owned_bytes", {})
PROBE = Model("soak-probe", 16 * KiB)
"""The model whose new prompts show whether lmdb and the object tier still take chunks."""


@dataclass(frozen=True)
class Mode:
    name: str
    model_switches: int
    prompts: int
    """Prompts of its own each node serves every round."""
    chunks: int
    """Chunks per prompt."""
    recovery_deadline_s: float
    """How long after an event rounds run before it counts as not recovered."""
    readers: int
    """lmdb readers killed inside their read per reader_kill."""
    progress_s: float
    """How long a tier is given to take new chunks before it counts as wedged."""
    arena_bytes: int
    """Node 0's arena: room for a few models' working sets, not for every one's."""
    warm_up_events: int
    """Events run before memory growth is measured: every kind once (each first use of a
    path allocates what it keeps for good), where the schedule has room for that."""


QUICK = Mode("quick", 4, 4, 6, 10.0, 4, 15.0, 8 * MiB, 0)
FULL = Mode("full", 24, 6, 8, 20.0, 16, 30.0, 16 * MiB, 2 * len(EXTRAS))
WARM_UP_ROUNDS = 10


def schedule(mode: Mode) -> list[str]:
    """Model switches with the other events between them: every extra event at least once."""
    per_switch = max(1, math.ceil(len(EXTRAS) / mode.model_switches))
    extras = itertools.cycle(EXTRAS)
    events: list[str] = []
    for _ in range(mode.model_switches):
        events += ["model_switch", *(next(extras) for _ in range(per_switch))]
    return events


@dataclass
class EventFigures:
    count: int = 0
    recovery_s: list[float | None] = field(default_factory=list)
    refused_stores_with_room: int = 0
    refused_stores: int = 0
    counted: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTED, 0.0))
    foreign_objects_deleted: int = 0
    bytes_above_budget_max: int = 0
    wedged: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.recovery_s if r is not None]
        return {
            "count": self.count,
            "recovery_s_max": max(done) if len(done) == len(self.recovery_s) and done else None,
            "recovery_s_median": statistics.median(done) if done else None,
            "not_recovered": len(self.recovery_s) - len(done),
            "refused_stores_with_room": self.refused_stores_with_room,
            "refused_stores": self.refused_stores,
            **self.counted,
            "foreign_objects_deleted": self.foreign_objects_deleted,
            "bytes_above_budget_max": self.bytes_above_budget_max,
            "wedged": sorted(set(self.wedged)),
        }


class Soak:
    def __init__(
        self,
        mode: Mode,
        nodes: list[Node],
        ledger: Ledger,
        bucket_endpoint: str,
        budgets: dict[str, int],
        disk: Path,
    ) -> None:
        self.mode = mode
        self.nodes = nodes
        self.ledger = ledger
        self.endpoint = bucket_endpoint
        self.budgets = budgets
        self.disk = disk
        self.generation = 0
        self.target = self._model(0)
        self.draft: Model | None = None
        self.hidden_on = False
        self.encoder_on = False
        self.capture = itertools.count()
        """Hidden states and encoder items are new on every round: captures of new requests."""
        self.steady = math.nan
        self.figures: dict[str, EventFigures] = {}
        self.foreign = 0
        self.foreign_examples: list[str] = []
        self.above_max = 0
        self.above_by_node: dict[str, tuple[int, float]] = {}
        """The most each node's own objects in the bucket were above its budget, with the
        bytes kvtierd counted as its own then."""
        self.bucket_max = 0
        self.overwritten = 0
        self.log: Callable[[str], None] = lambda _line: None
        self.can_fill_disk = True
        """False where no small filesystem could be mounted: disk_full is skipped."""
        self.baseline: dict[str, Vitals] = {}
        """Each node's vitals after warm-up (its last start's, for a restarted node); none
        for a node restarted fewer than the mode's warm-up events ago."""
        self._rewarm: dict[str, int] = {}
        """Restarted nodes: events left before their baseline is taken again."""

    @staticmethod
    def _model(generation: int) -> Model:
        kib = CHUNK_KIB[generation % len(CHUNK_KIB)]
        return Model(f"soak-model-{generation}", kib * KiB)

    # -- traffic ---------------------------------------------------------------------------

    def prompts(self, owner: Node) -> list[str]:
        return [f"{owner.name}-prompt-{i}" for i in range(self.mode.prompts)]

    def round(self) -> Served:
        """Every node serves its prompts and two of its neighbour's; returns node 0's own."""
        mine = Served()
        chunks = self.mode.chunks
        for i, node in enumerate(self.nodes):
            neighbour = self.nodes[(i + 1) % len(self.nodes)]
            own = node.serve(self.target, self.prompts(node), chunks)
            node.serve(self.target, self.prompts(neighbour)[:2], chunks)
            if i == 0:
                mine = own
        self._side_pools(self.nodes[0])
        return mine

    def _side_pools(self, node: Node) -> None:
        chunks = self.mode.chunks
        if self.draft is not None:
            node.serve(self.draft, self.prompts(node), chunks)
        n = next(self.capture)
        if self.hidden_on:
            hidden = Model(self.target.name, self.target.chunk_bytes, Pool.HIDDEN)
            node.serve(hidden, [f"capture-{n}"], chunks)
        if self.encoder_on:
            encoder = Model(f"{self.target.name}-vision", 32 * KiB, Pool.ENCODER)
            node.serve(encoder, [f"item-{n}"], chunks)

    def warm_up(self) -> None:
        """Rounds on the first model until its hit rate settles: the steady state every
        event's recovery is held to."""
        for node in self.nodes:
            node.namespace(PROBE)
        rates: list[float] = []
        for _ in range(WARM_UP_ROUNDS):
            rates.append(self.round().hit_rate)
            if len(rates) >= 3 and abs(rates[-1] - rates[-2]) < 0.01:
                break
        self.steady = rates[-1]
        self.log(f"steady hit rate {self.steady:.3f} after {len(rates)} rounds")

    def recover(self, since: float) -> tuple[float | None, Served]:
        """Rounds until node 0's hit rate is back within 10 % of steady: seconds since
        ``since``, or None when the mode's deadline passed first."""
        served = Served()
        deadline = time.monotonic() + self.mode.recovery_deadline_s
        while time.monotonic() < deadline:
            mine = self.round()
            served.add(mine)
            if mine.hit_rate >= RECOVERED * self.steady:
                return time.monotonic() - since, served
        return None, served

    # -- events ----------------------------------------------------------------------------

    def run(self) -> Iterator[str]:
        """Run the schedule; yields each event's name after it is measured."""
        for done, event in enumerate(schedule(self.mode), 1):
            self.one(event)
            if done == self.mode.warm_up_events:
                self.baseline = {
                    n.name: n.vitals() for n in self.nodes if n.name not in self._rewarm
                }
            for node in self.nodes:
                left = self._rewarm.get(node.name)
                if left is not None and done > self.mode.warm_up_events:
                    self._rewarm[node.name] = left - 1
                if left is not None and left <= 0:
                    del self._rewarm[node.name]
                    self.baseline[node.name] = node.vitals()
            yield event

    def one(self, event: str) -> None:
        node = self.nodes[0]
        if event == "disk_full" and not self.can_fill_disk:
            return
        figures = self.figures.setdefault(event, EventFigures())
        figures.count += 1
        counters = self._counters(node)
        started = time.monotonic()
        lmdb_check = event in ("reader_kill", "disk_full", "kvtierd_kill")
        if event == "model_switch":  # every engine restarts on the new model
            self.generation += 1
            self.target = self._model(self.generation)
            for each in self.nodes:
                each.reconnect()
                each.namespace(PROBE)
        elif event == "draft_revision":
            revision = f"rev-{self.generation}-{figures.count}"
            # a draft's chunk is smaller: half the target's, in whole 4 KiB heads
            half = max(4 * KiB, self.target.chunk_bytes // (8 * KiB) * 4 * KiB)
            self.draft = Model(self.target.name, half, Pool.DRAFT, revision)
        elif event in ("hidden_on", "hidden_off"):
            self.hidden_on = event == "hidden_on"
        elif event in ("encoder_on", "encoder_off"):
            self.encoder_on = event == "encoder_on"
        elif event == "reader_kill":
            killed = node.kill_readers(self.mode.readers)
            self.log(f"{killed} lmdb readers killed inside their read")
        elif event == "disk_full":
            ballast = fill_disk(self.disk, leave_bytes=64 * KiB)
            try:  # new prompts while the disk is full: lmdb's writes fail
                fresh = [self._fresh() for _ in range(self.mode.prompts)]
                node.serve(self.target, fresh, self.mode.chunks)
                time.sleep(1.0)  # for write-back to try them
            finally:
                ballast.unlink()
            started = time.monotonic()  # recovery counts from the room given back
        elif event == "kvtierd_kill":
            try:
                node.restart(kill=True)
            except RuntimeError as exc:  # counted as a wedged daemon, and started once more
                self.log(f"{node.name}'s kvtierd did not start again: {exc}")
                figures.wedged.append(f"{node.name}/kvtierd")
                node.start()
            node.namespace(PROBE)  # as at warm-up: its class is there before the arena fills
        recovery, served = self.recover(started)
        if event == "kvtierd_kill":  # a new daemon: its warm-up starts again
            self.baseline.pop(node.name, None)
            self._rewarm[node.name] = self.mode.warm_up_events
        figures.recovery_s.append(recovery)
        figures.refused_stores += served.refused
        figures.refused_stores_with_room += served.refused_with_room
        for name, after in self._counters(node).items():
            # a restarted kvtierd counts from 0 again
            counters[name] = after - counters[name] if after >= counters[name] else after
            figures.counted[name] += counters[name]
        figures.wedged += self.stalled(node, ("cpu", "lmdb") if lmdb_check else ("cpu",))
        self._check_bucket(figures)
        shown = "not recovered" if recovery is None else f"recovered in {recovery:.2f} s"
        self.log(f"{event} ({self.target.name}, {self.target.chunk_bytes // KiB} KiB): {shown}")

    # -- checks ----------------------------------------------------------------------------

    def _counters(self, node: Node) -> dict[str, float]:
        return {name: self._metric(node, metric) for name, metric in COUNTED.items()}

    @staticmethod
    def _metric(node: Node, metric: Metric) -> float:
        name, labels = metric
        try:
            return total(node.samples(), name, **labels)
        except OSError:  # a daemon down counts nothing
            return 0.0

    def stalled(self, node: Node, tiers: tuple[str, ...]) -> list[str]:
        """Of ``tiers`` (cpu, lmdb, object), those of ``node`` that take no new chunks. The
        arena is judged on a new prompt of the current model; the tiers below it on a new
        prompt of the probe model, whose slot class was made at warm-up (so that a full arena
        does not hide them), given the mode's deadline to count its chunks stored."""
        wedged: list[str] = []
        chunks = self.mode.chunks
        if "cpu" in tiers and not node.serve(self.target, [self._fresh()], chunks).stored:
            wedged.append(f"{node.name}/cpu")
        below = {tier: self._metric(node, STORED[tier]) for tier in tiers if tier in STORED}
        if not below:
            return wedged
        if not node.serve(PROBE, [self._fresh()], chunks).stored:
            return sorted({*wedged, f"{node.name}/cpu"})  # nothing to judge the rest by
        deadline = time.monotonic() + self.mode.progress_s
        waiting = set(below)
        while waiting and time.monotonic() < deadline:
            waiting = {t for t in waiting if not self._metric(node, STORED[t]) > below[t]}
            if waiting:
                time.sleep(0.1)
        return wedged + [f"{node.name}/{tier}" for tier in sorted(waiting)]

    def _fresh(self) -> str:
        return f"fresh-{next(self.capture)}"

    def wedged_tiers(self) -> list[str]:
        """Tiers of any node that take no new chunks at the end of the run."""
        wedged: list[str] = []
        for node in self.nodes:
            wedged += self.stalled(node, ("cpu", "lmdb", "object"))
        return wedged

    def _check_bucket(self, figures: EventFigures) -> None:
        mark = self.ledger.mark()
        check = self.ledger.check(listing(self.endpoint, self.ledger.bucket), self.budgets, mark)
        figures.foreign_objects_deleted += check.foreign_deleted - self.foreign
        self.foreign = check.foreign_deleted
        self.foreign_examples = check.foreign_examples
        above = max(check.bytes_above_budget.values(), default=0)
        figures.bytes_above_budget_max = max(figures.bytes_above_budget_max, above)
        self.above_max = max(self.above_max, above)
        for name, value in check.bytes_above_budget.items():
            if value > self.above_by_node.get(name, (0, 0.0))[0]:
                node = next(n for n in self.nodes if n.name == name)
                self.above_by_node[name] = (value, self._metric(node, OWNED))
        self.bucket_max = max(self.bucket_max, check.bucket_bytes)
        self.overwritten = check.overwritten
