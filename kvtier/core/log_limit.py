"""Log lines of a failure that can repeat on every request, at a bounded rate.

A tier that keeps failing the same way (an lmdb map that cannot be read, say) would otherwise
write one line per lookup: thousands a minute under load, burying every other line. The first
failure is logged at once; after it, one line each ``interval_s`` at most, counting the
failures it stands for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class LimitedLog:
    """One logger's lines at ``level`` for one kind of failure, at most one each
    ``interval_s`` after the first."""

    def __init__(
        self,
        logger: logging.Logger,
        level: int,
        interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._level = level
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._quiet_until: float | None = None
        self._held = 0
        """Lines left out since the last one logged."""

    def log(self, msg: str, *args: object) -> None:
        now = self._clock()
        with self._lock:
            if self._quiet_until is not None and now < self._quiet_until:
                self._held += 1
                return
            held, self._held = self._held, 0
            self._quiet_until = now + self._interval_s
        if held:
            msg = f"{msg} (and {held} more like it since the last line)"
        self._logger.log(self._level, msg, *args)
