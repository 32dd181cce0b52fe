"""The serving benchmark's no-reuse phase: its servers up at once and measured in turn, cycle
after cycle, with kvtier's own time in each level."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import ExitStack

from benchmarks.harness.system import wait_until_quiet
from benchmarks.serving_cases import (
    HEADLINE_CONCURRENCY,
    NO_REUSE_BACKLOG,
    NO_REUSE_CASES,
    NO_REUSE_REQUESTS,
    Plan,
)
from benchmarks.serving_figures import (
    Level,
    Outcome,
    daemon_cpu_seconds,
    describe_kvtier_time,
    kvtier_time,
)
from benchmarks.serving_servers import Servers
from kvtier.bench import BenchError, LevelResult, WorkloadSpec
from tests.fixtures.servers import ServerError, VllmServer

log = logging.getLogger("kvtier.bench.serving")


class NoReusePhase:
    """``costs``: kvtier's own time of each level by server; ``error``: why the phase stopped."""

    def __init__(
        self,
        servers: Servers,
        level: Level,
        workload: Callable[..., WorkloadSpec],
        failed: Callable[[Outcome, BaseException, str], None],
        cycles: int,
        scale: int = 1,
    ) -> None:
        self.servers = servers
        self.requests = NO_REUSE_REQUESTS * scale
        self.backlog = NO_REUSE_BACKLOG * scale
        self.run_level = level
        self.workload = workload
        self.failed = failed
        self.cycles = cycles
        self.index = 100  # no-reuse levels use indices of their own, never repeated
        self.costs: dict[str, list[dict[str, float]]] = {}
        self.error = ""

    def level(self, server: VllmServer, metrics_url: str | None, n: int) -> LevelResult:
        self.index += 1  # a level of prompts of its own
        spec = self.workload("no-reuse")
        return self.run_level(server, metrics_url, spec, HEADLINE_CONCURRENCY, n, self.index, 0)

    def run(self, outcomes: dict[str, Outcome], only: set[str] | None) -> list[dict[str, float]]:
        """The no-reuse servers up at once and measured in turn, cycle after cycle (see the
        module's docstring); each cycle's output tokens/s by server. A server that fails to
        start fails the phase, whose levels then go unmeasured."""
        names = [n for n in NO_REUSE_CASES if only is None or n in only]
        if "vllm" not in names or len(names) < 2 or not self.cycles:
            return []
        cases = {n: outcomes.setdefault(n, Outcome(NO_REUSE_CASES[n])) for n in names}
        cycles: list[dict[str, float]] = []
        current = names[0]

        def run_name(name: str) -> str:
            return f"{name}_nr"  # short: vLLM puts sockets under it (sun_path holds 107)

        try:
            with ExitStack() as stack:
                up: dict[str, tuple[VllmServer, str | None]] = {}
                for current in names:
                    log.info("%s: starting", run_name(current))
                    up[current] = stack.enter_context(
                        self.servers.server(cases[current].case, Plan(), run_name(current))
                    )
                for server, url in up.values():  # the first requests of a server, unmeasured
                    self.level(server, url, self.requests)
                for cycle in range(self.cycles):
                    turn = cycle % len(names)
                    row: dict[str, float] = {}
                    for current in names[turn:] + names[:turn]:
                        server, url = up[current]
                        if wait_until_quiet() is None:
                            log.warning("the machine stayed busy: the level runs anyway")
                        self.level(server, url, self.backlog)
                        daemon = self.servers.daemons.get(run_name(current))
                        daemon_cpu = daemon_cpu_seconds(daemon)
                        level = self.level(server, url, self.requests)
                        cases[current].no_reuse.append(level)
                        daemon_cpu = daemon_cpu_seconds(daemon) - daemon_cpu
                        self.costs.setdefault(current, []).append(kvtier_time(level, daemon_cpu))
                        log.info("  %s", describe_kvtier_time(level, daemon_cpu))
                        whole = level.ok == level.requests
                        row[current] = level.output_tps if whole else math.nan
                    cycles.append(row)
                    log.info(
                        "no-reuse cycle %d: %s", cycle, {k: round(v, 1) for k, v in row.items()}
                    )
        except (ServerError, BenchError, RuntimeError, OSError) as exc:
            failure = Outcome(cases[current].case)
            self.failed(failure, exc, run_name(current))
            self.error = f"{run_name(current)}: {failure.error}"
        return cycles
