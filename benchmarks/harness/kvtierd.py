"""kvtierd for the benchmarks: ``kvtier serve`` in a subprocess with a configuration written for
the run, found ready from its first line, stopped with SIGTERM (killed if it ignores it); and
`Kvtierd`, one with an arena and lmdb sized for an engine benchmark and its admin client."""

from __future__ import annotations

import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness.sizes import LMDB_BUDGET, MAX_SOCKET_PATH, KiB
from kvtier.core.config import ENV_PREFIX
from kvtier.rpc import AdminClient

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("kvtier.bench")

READY = "kvtierd ready: "
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 120.0


def _dying_with_parent() -> list[str]:
    """A prefix that gives kvtierd SIGTERM when this process dies (a daemon outliving a killed
    benchmark keeps its arena and ports). Not a preexec_fn: that forks this process, whose gRPC
    threads are busy, and runs Python in the child before exec; gRPC's fork handlers there have
    aborted the child (``epoll_wait error: Bad file descriptor``, exit -6) before kvtierd ran.
    Without one, the child is started by vfork and exec at once."""
    setpriv = shutil.which("setpriv")
    if sys.platform != "linux" or setpriv is None:
        return []
    return [setpriv, "--pdeathsig", "TERM", "--"]


class KvtierdProcess:
    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.config_path = root / "kvtierd.yaml"
        self.log_path = root / "kvtierd.log"
        self.config_path.write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[str] | None = None
        self.admin_port = 0
        self.metrics_port = 0
        self.admin_token: str | None = None
        """What kvtierd's admin API takes: the token it wrote at its first start."""
        self.start_s = math.nan
        self.stop_s = math.nan
        self.exit_code: int | None = None
        self.env: dict[str, str] = {}
        """Set in the daemon's environment (an object store's identity, say)."""
        self.env_drop: tuple[str, ...] = ()
        """Left out of it."""

    def admin_client(self, timeout_s: float = 30.0) -> AdminClient:
        return AdminClient(f"127.0.0.1:{self.admin_port}", self.admin_token, timeout_s=timeout_s)

    def start(self) -> None:
        # only the file configures the daemon: KVTIER_ variables would override it
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(ENV_PREFIX) and k not in self.env_drop
        }
        env.update(self.env)
        self.exit_code = None
        argv = [
            *_dying_with_parent(),
            sys.executable,
            *("-m", "kvtier.cli", "serve", "--config", str(self.config_path)),
        ]
        started = time.perf_counter()
        with open(self.log_path, "wb") as stderr:
            self.proc = subprocess.Popen(
                [*argv, "--log-level", "warning"],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
                text=True,
            )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith(READY):
            raise RuntimeError(f"kvtierd did not start: {line!r}\n{self.log_tail()}")
        fields = dict(part.split("=", 1) for part in line[len(READY) :].split())
        self.start_s = time.perf_counter() - started
        self.admin_port = int(fields["admin_port"])
        self.metrics_port = int(fields["metrics_port"])
        token = fields["admin_token"]
        self.admin_token = None if token == "-" else Path(token).read_text().strip()
        log.info("kvtierd pid %d ready in %.2f s", self.proc.pid, self.start_s)

    def metrics(self) -> str:
        """The /metrics page."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.exit_code is None else None

    def kill(self) -> None:
        """SIGKILL, as the kernel's OOM killer or a node's failure would end it; `start` again
        restarts it on the same configuration."""
        proc = self.proc
        if proc is None or self.exit_code is not None:
            return
        proc.kill()
        self.exit_code = proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def stop(self) -> None:
        proc = self.proc
        if proc is None or self.exit_code is not None:
            return
        started = time.perf_counter()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("kvtierd ignored SIGTERM for %.0f s; killing it", STOP_TIMEOUT_S)
            proc.kill()
            self.exit_code = proc.wait()
        self.stop_s = time.perf_counter() - started
        if proc.stdout is not None:
            proc.stdout.close()
        if self.exit_code != 0:
            log.error("kvtierd exited %d:\n%s", self.exit_code, self.log_tail())


class Kvtierd(KvtierdProcess):
    """kvtierd with an arena and lmdb sized for an engine benchmark, and its admin client."""

    def __init__(self, root: Path, shm: Path, arena_bytes: int, extent_bytes: int) -> None:
        self.shm = shm
        self.socket_dir = root
        if len(str(root / "kvtierd.sock")) > MAX_SOCKET_PATH:
            self.socket_dir = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
        self.socket_path = self.socket_dir / "kvtierd.sock"
        self.lmdb_path = root / "lmdb"
        config = {
            "arena": {
                "path": str(shm),
                "size_bytes": arena_bytes,
                "extent_bytes": extent_bytes,
                "min_slot_bytes": 64 * KiB,
            },
            "lmdb": {"path": str(self.lmdb_path), "budget_bytes": LMDB_BUDGET},
            "server": {
                "socket_path": str(self.socket_path),
                "admin_address": "127.0.0.1:0",
                "metrics_address": "127.0.0.1:0",
            },
        }
        super().__init__(root, config)
        self.admin: AdminClient | None = None

    def start(self) -> None:
        super().start()
        self.admin = self.admin_client(timeout_s=STOP_TIMEOUT_S)

    def counters(self) -> dict[str, int]:
        """The manager's counters, and each tier's as ``<tier>.<name>``."""
        assert self.admin is not None
        stats = self.admin.stats()
        out = {k: int(v) for k, v in stats.counters.items()}
        for tier in stats.tiers:
            out.update({f"{tier.tier}.{k}": int(v) for k, v in tier.counters.items()})
        return out

    def stop(self) -> None:
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        stopping = self.proc is not None and self.exit_code is None
        super().stop()
        if stopping:
            self.shm.unlink(missing_ok=True)
            if self.socket_dir != self.root:
                shutil.rmtree(self.socket_dir, ignore_errors=True)
