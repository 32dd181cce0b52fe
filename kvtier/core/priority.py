"""The CPU priority of kvtier's background threads (`manager.background_nice`).

Write-back into lmdb, uploads to and downloads from the object store, promotion ahead of a load
and the maintenance sweeps share the cores with the engine's own CPU work (its scheduler, API
server, detokenizer) and with the threads that answer lookups, leases and loads. On Linux a
thread is a task with a nice value of its own, so each background thread raises its own as it
starts (`enter_background`): under contention the CPU goes to the others first, and on idle
cores the background work still runs at full speed. Nothing else in the process changes.

The value is process-wide: the TierManager sets it from its configuration before it starts a
thread, and every background thread of the process takes it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

DEFAULT_NICE = 0
"""Off by default: on the CPU build's serving benchmark (4 users, 2 cores) a nice of 10 gave
the engines no measurable gain and starved the embedded tiers' write-back beside spinning
compute threads."""
_COMM_BYTES = 15  # the kernel keeps a task's name to 15 bytes

_nice = DEFAULT_NICE
_told = threading.Event()  # the one log line saying the nice value could not be applied


def set_background_nice(nice: int) -> None:
    """The nice value background threads started from now on take (0: they keep the
    process's)."""
    global _nice
    _nice = nice


def name_this_thread() -> None:
    """Give the calling thread's Python name to its task, where ``top -H``, ``ps -L`` and
    /proc show it (the first 15 bytes)."""
    if sys.platform != "linux":
        return
    name = threading.current_thread().name.encode(errors="replace")[:_COMM_BYTES]
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "wb") as comm:
            comm.write(name)
    except OSError:  # a /proc mounted read-only: the name is only cosmetic
        pass


def enter_background() -> None:
    """Called first on a background thread (its target, or a pool's ``initializer``): name it
    and lower its CPU priority to the configured nice value. A thread already nicer than that
    keeps its own; a failure is logged once and the thread runs on as it was."""
    name_this_thread()
    nice = _nice
    if nice <= 0:
        return
    if sys.platform != "linux":
        _tell_once("manager.background_nice applies per thread on Linux only; ignored here")
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:
        _tell_once(f"cannot lower the background threads' priority to nice {nice}: {exc}")


def _tell_once(message: str) -> None:
    if not _told.is_set():
        _told.set()
        log.warning("%s; they run at the priority of the threads serving calls", message)
