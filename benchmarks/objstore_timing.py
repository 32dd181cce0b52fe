"""What the object benchmark's transfers cost: wall time, this process's CPU and moto's."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.harness.buffers import no_gc

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Cost:
    """What moving some bytes took: wall seconds, CPU seconds of this process (all its
    threads) and CPU seconds of the moto server process."""

    wall: float = 0.0
    cpu: float = 0.0
    server_cpu: float = 0.0

    def __iadd__(self, other: Cost) -> Cost:
        self.wall += other.wall
        self.cpu += other.cpu
        self.server_cpu += other.server_cpu
        return self


def process_cpu(pid: int | None) -> float:
    """CPU seconds of this process, or of another one from /proc (0 where there is none)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def timed(fn: Callable[[], object], server_pid: int | None = None) -> Cost:
    with no_gc():
        server = process_cpu(server_pid) if server_pid is not None else 0.0
        cpu = process_cpu(None)
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
        cpu = process_cpu(None) - cpu
        server = process_cpu(server_pid) - server if server_pid is not None else 0.0
    return Cost(wall, cpu, server)
