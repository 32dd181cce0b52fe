"""A discrete-event model of a fleet serving multi-turn sessions through kvtier, and of the
routers that choose an engine for each request.

- **Fleet.** Nodes of ``engines`` engines. Each engine has a GPU prefix cache of ``gpu`` chunks;
  each node an arena of ``arena`` chunks and lmdb of ``lmdb`` chunks shared by its engines; one
  object store holds every chunk once its upload lands (``upload_delay_s`` after the store).
  Every level is LRU over sessions: a session's chunks are used together, so a level keeps or
  lets go of a session's leading chunks together (chunk by chunk would cost a Python loop per
  chunk, and change little). Every chunk an engine computes is stored in its node's arena and
  lmdb and uploaded (`object.admission: all`).
- **Sessions.** The `kvtier bench` multi-round shape: a private document, then turns, each adding
  a question and an answer to the history the next turn repeats; sessions arrive as a Poisson
  process, and a turn follows the previous one's last token after an exponential think time.
- **A request.** Its prompt's longest prefix held anywhere is loaded, each chunk from the fastest
  level holding it for the chosen engine (its GPU, its node's arena or lmdb, the object store);
  the rest is prefilled. A prompt with a full chunk past what the node's tiers and the store
  hold first waits for kvtierd's probe of the store to find nothing (a first turn, a turn whose
  previous answer filled a chunk no one stored). Loads run beside the engine's compute; prefills
  take the engine one at a time (prefill is compute-bound). TTFT is the probe and the load (or
  the wait for the engine, whichever ends later) plus the prefill, plus a fixed latency every
  request pays; the answer then decodes, a token a decode step, and a prefill on its engine
  stalls it for as long as the prefill takes.
- **Routers** see what each engine's and node's events would tell them, at once: `round_robin`;
  `gpu_prefix` (the longest prefix in an engine's GPU); `fixed_weights` (llm-d's tier weights:
  GPU 1.0, CPU 0.8, storage 0.4, object 0.2, summed over the matched blocks); `kvtier_cost`
  (the least expected TTFT from kvtier's measured load times, recompute and the engine's
  queue). The prefix routers weigh only engines that hold the prompt's first chunk somewhere
  near them (on a node whose arena or lmdb holds it, its least busy engine), plus two drawn at
  random (the power of two choices), so that a router never piles every request onto one
  engine; ties go to the engine with the shortest queue. `sticky` (every turn of a session on
  one engine) is the real fleet's second router in `benchmarks/fleet_check.py`.
- **Sessions** arrive on their own (a Poisson process, or given times), or are served by a
  number of users one after another (`Workload.users`), as the real fleet's client does.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.fleet_costs import NodeCosts

ROUTERS = ("round_robin", "gpu_prefix", "fixed_weights", "kvtier_cost")
LEVELS = ("gpu", "cpu", "lmdb", "object", "recompute")
FIXED_WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "lmdb": 0.4, "object": 0.2}
"""llm-d's published tier weights; lmdb (local storage) takes its storage weight."""


@dataclass(frozen=True)
class Shape:
    """Capacities in chunks; the GPU cache keeps and hits whole blocks of ``block_tokens``
    (vLLM's block size; 0: a chunk), the other levels whole chunks."""

    nodes: int
    engines: int = 8
    gpu: int = 1000
    arena: int = 10000
    lmdb: int = 100000
    block_tokens: int = 0


@dataclass(frozen=True)
class Workload:
    doc_tokens: int = 8192
    question_tokens: int = 128
    answer_tokens: int = 256
    turns: int = 8
    think_s: float = 30.0
    sessions_per_engine_s: float = 0.25
    arrivals_s: float = 240.0
    seed: int = 0
    arrivals: tuple[float, ...] = ()
    """When given, the sessions' arrival times instead of a Poisson process."""
    users: int = 0
    """When given, ``sessions`` sessions served by this many users, each starting after a think
    time, and its next session one think time after its previous one's last answer."""
    sessions: int = 0


class Lru:
    """Sessions' leading chunks held by one level of one place, least recently used session
    first, in chunks at most ``capacity``. A session's chunks are used together, so they are
    kept and let go together; ``evicted`` hears of each session that leaves."""

    def __init__(self, capacity: int, evicted: Callable[[int], None]) -> None:
        self.capacity = capacity
        self.used = 0
        self._held: OrderedDict[int, int] = OrderedDict()
        self._evicted = evicted

    def held(self, session: int) -> int:
        return self._held.get(session, 0)

    def put(self, session: int, chunks: int) -> bool:
        """Hold ``chunks`` leading chunks of ``session`` (refreshing it); True when new."""
        before = self._held.pop(session, None)
        kept = max(chunks, before or 0)
        self._held[session] = kept
        self.used += kept - (before or 0)
        while self.used > self.capacity and len(self._held) > 1:
            old, n = self._held.popitem(last=False)
            self.used -= n
            self._evicted(old)
        return before is None


@dataclass
class Engine:
    index: int
    node: int
    gpu: Lru
    free_at: float = 0.0
    """When its compute finishes the prefills queued so far."""
    decoding: dict[int, float] = field(default_factory=dict)
    """Answers being decoded, by session: when each ends. A prefill stalls them."""


@dataclass
class Totals:
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEVELS, 0))
    ttft: list[float] = field(default_factory=list)
    first_ttft: list[float] = field(default_factory=list)
    """Of the sessions' first turns (nothing of theirs cached yet)."""
    later_ttft: list[float] = field(default_factory=list)
    prefill_saved_s: float = 0.0
    requests: int = 0


def _free_at(engine: Engine) -> float:
    return engine.free_at


class Fleet:
    def __init__(self, shape: Shape, costs: NodeCosts, router: str, rng: random.Random) -> None:
        if router not in (*ROUTERS, "sticky"):
            raise ValueError(f"unknown router {router!r}")
        self.shape, self.costs, self.router, self.rng = shape, costs, router, rng
        self.block = shape.block_tokens or costs.chunk_tokens
        blocks_per_chunk = costs.chunk_tokens // self.block
        self.holders: dict[str, dict[int, set[int]]] = {"gpu": {}, "cpu": {}, "lmdb": {}}
        self.engines = [
            Engine(i, i // shape.engines, self._lru(shape.gpu * blocks_per_chunk, "gpu", i))
            for i in range(shape.nodes * shape.engines)
        ]
        self.arenas = [self._lru(shape.arena, "cpu", n) for n in range(shape.nodes)]
        self.disks = [self._lru(shape.lmdb, "lmdb", n) for n in range(shape.nodes)]
        self.objects: dict[int, list[tuple[float, int]]] = {}
        """session -> (when an upload lands, the leading chunks in the store from then)."""
        self._next = itertools.count()
        self.totals = Totals()

    def _lru(self, capacity: int, level: str, place: int) -> Lru:
        holders = self.holders[level]

        def evicted(session: int) -> None:
            places = holders.get(session)
            if places is not None:
                places.discard(place)
                if not places:
                    del holders[session]

        return Lru(capacity, evicted)

    def _hold(self, level: str, lru: Lru, place: int, session: int, chunks: int) -> None:
        if lru.put(session, chunks):
            self.holders[level].setdefault(session, set()).add(place)

    def in_store(self, session: int, now: float) -> int:
        best = 0
        for lands, n in self.objects.get(session, ()):
            if lands <= now and n > best:
                best = n
        return best

    # -- where a prompt's chunks are, for one engine ------------------------------------------

    def levels_for(self, engine: Engine, session: int, tokens: int, now: float) -> dict[str, int]:
        """Of a prompt of ``tokens``, how many leading tokens come from each level for
        ``engine``: each from the fastest level that holds it (each level holds a prefix, the
        GPU in blocks, the others in chunks; the prompt's last token is always computed)."""
        out: dict[str, int] = {}
        done = 0
        chunk = self.costs.chunk_tokens
        for level, unit, held in (
            ("gpu", self.block, engine.gpu.held(session)),
            ("cpu", chunk, self.arenas[engine.node].held(session)),
            ("lmdb", chunk, self.disks[engine.node].held(session)),
            ("object", chunk, self.in_store(session, now)),
        ):
            reach = min((tokens - 1) // unit, held) * unit
            if reach > done:
                out[level] = reach - done
                done = reach
        return out

    def load_s(self, levels: dict[str, int]) -> float:
        """A level's part of a hit loads in whole chunks."""
        chunk = self.costs.chunk_tokens
        return sum(self.costs.load_s(t, -(-n // chunk)) for t, n in levels.items() if t != "gpu")

    def probe_s(self, engine: Engine, session: int, tokens: int, now: float) -> float:
        """A prompt with a full chunk past what its node's tiers and the store hold waits for
        kvtierd's probe of the store to find nothing there (whatever the GPU holds: the chunk
        is asked of the tiers all the same)."""
        node = engine.node
        held = max(
            self.arenas[node].held(session),
            self.disks[node].held(session),
            self.in_store(session, now),
        )
        return self.costs.probe_miss_s if held < (tokens - 1) // self.costs.chunk_tokens else 0.0

    # -- routing --------------------------------------------------------------------------

    def choose(self, session: int, tokens: int, now: float) -> Engine:
        if self.router == "round_robin":
            return self.engines[next(self._next) % len(self.engines)]
        if self.router == "sticky":  # the real fleet's check: a session stays on one engine
            return self.engines[session % len(self.engines)]
        candidates = {e.index: e for e in self.rng.sample(self.engines, min(2, len(self.engines)))}
        for i in self.holders["gpu"].get(session, ()):
            candidates[i] = self.engines[i]
        if self.router != "gpu_prefix":
            # a node's engines see its arena and lmdb alike: its least busy one stands for it
            per = self.shape.engines
            nodes = self.holders["cpu"].get(session, set()) | self.holders["lmdb"].get(
                session, set()
            )
            for node in nodes:
                idle = min(self.engines[node * per : (node + 1) * per], key=_free_at)
                candidates[idle.index] = idle
        return min(candidates.values(), key=lambda e: self._rank(e, session, tokens, now))

    def _rank(self, engine: Engine, session: int, tokens: int, now: float) -> tuple[float, float]:
        wait = max(0.0, engine.free_at - now)
        if self.router == "gpu_prefix":
            return (-engine.gpu.held(session), wait)
        levels = self.levels_for(engine, session, tokens, now)
        if self.router == "kvtier_cost":
            cached = sum(levels.values())
            # a load runs beside the queue; the prefill waits for both
            start = max(self.load_s(levels), wait)
            return (start + (tokens - cached) * self.costs.prefill_s_per_token, wait)
        return (-sum(FIXED_WEIGHTS[t] * n for t, n in levels.items()), wait)

    # -- serving --------------------------------------------------------------------------

    def serve(self, session: int, tokens: int, now: float) -> tuple[Engine, float]:
        """Serve a prompt of ``tokens``: the engine that serves it, and when its first token
        is out."""
        engine = self.choose(session, tokens, now)
        levels = self.levels_for(engine, session, tokens, now)
        cached = sum(levels.values())
        probe = self.probe_s(engine, session, tokens, now)
        start = max(now + probe + self.load_s(levels), engine.free_at)
        done = start + (tokens - cached) * self.costs.prefill_s_per_token
        engine.free_at = done
        for other, ends in engine.decoding.items():  # their decode steps wait for this prefill
            if ends > start:
                engine.decoding[other] = ends + done - start
        t = self.totals
        t.requests += 1
        first = done + self.costs.request_latency_s
        t.ttft.append(first - now)
        for level, n in levels.items():
            t.tokens[level] += n
        t.tokens["recompute"] += tokens - cached
        t.prefill_saved_s += cached * self.costs.prefill_s_per_token
        self.store(engine, session, tokens, done)
        return engine, first

    def store(self, engine: Engine, session: int, tokens: int, now: float) -> None:
        """``engine`` computed the KV of ``session``'s leading ``tokens``: its GPU keeps their
        full blocks, its node's tiers store their full chunks, and their upload lands a little
        later."""
        node = engine.node
        chunks = tokens // self.costs.chunk_tokens
        self._hold("gpu", engine.gpu, engine.index, session, tokens // self.block)
        self._hold("cpu", self.arenas[node], node, session, chunks)
        self._hold("lmdb", self.disks[node], node, session, chunks)
        if self.in_store(session, float("inf")) < chunks:
            self.objects.setdefault(session, []).append((now + self.costs.upload_delay_s, chunks))


def simulate(shape: Shape, costs: NodeCosts, router: str, workload: Workload) -> Totals:
    """Every session of ``workload`` on ``shape``, routed by ``router``."""
    rng = random.Random(workload.seed)
    fleet = Fleet(shape, costs, router, random.Random(workload.seed + 1))
    w = workload
    rate = w.sessions_per_engine_s * shape.nodes * shape.engines
    # (time, order, session, turn, engine): a turn's request, or (engine >= 0) its answer's end
    events: list[tuple[float, int, int, int, int]] = []
    order = itertools.count()
    arrivals = list(w.arrivals)
    if w.users:  # each starts after a think time, as between turns
        arrivals = [rng.expovariate(1 / w.think_s) for _ in range(min(w.users, w.sessions))]
    elif not arrivals:
        t = rng.expovariate(rate)
        while t < w.arrivals_s:
            arrivals.append(t)
            t += rng.expovariate(rate)
    for session, t in enumerate(arrivals):
        heapq.heappush(events, (t, next(order), session, 0, -1))
    waiting = iter(range(len(arrivals), w.sessions if w.users else 0))
    while events:
        now, _, s, turn, e = heapq.heappop(events)
        tokens = w.doc_tokens + turn * (w.question_tokens + w.answer_tokens) + w.question_tokens
        if e < 0:
            engine, first = fleet.serve(s, tokens, now)
            turns = fleet.totals.later_ttft if turn else fleet.totals.first_ttft
            turns.append(first - now)
            ends = engine.decoding[s] = first + w.answer_tokens * costs.decode_s_per_token
            heapq.heappush(events, (ends, next(order), s, turn, engine.index))
            continue
        engine = fleet.engines[e]
        if engine.decoding[s] > now:  # a prefill stalled the decode since
            heapq.heappush(events, (engine.decoding[s], next(order), s, turn, e))
            continue
        del engine.decoding[s]
        # the answer's full chunks are stored as they fill, like the prompt's; its last token
        # is never fed back, so it has no KV
        fleet.store(engine, s, tokens + w.answer_tokens - 1, now)
        if turn + 1 < w.turns:
            think = rng.expovariate(1 / w.think_s)
            heapq.heappush(events, (now + think, next(order), s, turn + 1, -1))
        elif (following := next(waiting, None)) is not None:  # its user starts the next one
            think = rng.expovariate(1 / w.think_s)
            heapq.heappush(events, (now + think, next(order), following, 0, -1))
    return fleet.totals
