"""kvtierd's CPU placement (`server.cpus`).

An engine that binds its compute threads to cores (vLLM's CPU backend does, one OpenMP thread
per core) slows down whenever another thread takes one of those cores, even briefly. kvtierd
therefore runs, when told, on the other cores only. The mask is set on every thread of the
process at start, and threads started later inherit it from their creator.
"""

from __future__ import annotations

import logging
import os
import re

from kvtier.core.errors import ConfigError

log = logging.getLogger(__name__)

KEY = "server.cpus"
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPUs in Linux's list format, as ``taskset -c`` takes them: ``"1"``, ``"2-5,8"``."""
    cpus: set[int] = set()
    for part in text.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(f"{text!r} is not a CPU list such as '1' or '2-5,8'")
        first = int(match.group(1))
        last = int(match.group(2) or first)
        if last < first:
            raise ValueError(f"{part.strip()!r}: a range runs upwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """The list format back, with runs as ranges: {0, 1, 2, 5} is ``"0-2,5"``."""
    parts: list[str] = []
    run: list[int] = []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            parts.append(_run(run))
            run = []
        run.append(cpu)
    if run:
        parts.append(_run(run))
    return ",".join(parts)


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def pin_process(cpus: frozenset[int]) -> None:
    """Run every thread of this process on ``cpus``; each must be one the process may use
    now (its cgroup's cpuset and its inherited mask), or nothing is changed."""
    allowed = os.sched_getaffinity(0)
    missing = cpus - allowed
    if missing:
        raise ConfigError(
            KEY,
            f"CPU {format_cpu_list(missing)} is not one kvtierd may run on "
            f"(it may use {format_cpu_list(allowed)})",
        )
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    log.info("kvtierd runs on CPUs %s", format_cpu_list(cpus))
