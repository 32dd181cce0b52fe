"""A real vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``) in a subprocess.

`VllmServer` starts one on a free loopback port with its own cache and temp directories, a
fixed KV cache size (``--kv-cache-memory-bytes``; ``VLLM_CPU_KVCACHE_SPACE`` is removed from
its environment, since it would override that), ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (so that a
server with a connector gets no more compute threads than one without), any extra arguments
(``--kv-transfer-config``, ``--speculative-config``, ...) and environment overrides. Its log goes
to a file, and a start-up failure raises `ServerError` with the log's tail. It runs in a process
group of its own, so that stopping it (SIGTERM, then SIGKILL) stops its engine core too.
`vllm_server` is the same as a context manager.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:
    from benchmarks.models import engine_env
except ImportError:  # run as a script from benchmarks/
    from models import engine_env

MAX_MODEL_LEN = 512
BLOCK_SIZE = 32
KV_CACHE_BYTES = 1 << 30
STARTUP_S = 180.0
STOP_S = 20.0


class ServerError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(log: Path, n: int = 40) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(lines[-n:])


_RAISED = re.compile(r"^[A-Za-z_.]*(?:Error|Exception): \S")
_PREFIX = re.compile(r"^\(\S+ pid=\d+\) [A-Z]+ \S+ \S+ \[[^\]]*\]\s*")


def error_line(log: Path) -> str:
    """The first exception the log shows (the root cause, before what it set off), without
    vLLM's log prefix; the log's last line when it shows none."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for line in lines:
        text = _PREFIX.sub("", line.strip())
        if _RAISED.match(text):
            return text
    return lines[-1].strip() if lines else ""


def connector_arg(config: Mapping[str, Any]) -> list[str]:
    return ["--kv-transfer-config", json.dumps(dict(config))]


class VllmServer:
    """One api_server process; `start` returns once ``/health`` answers 200."""

    def __init__(
        self,
        model: Path,
        tmp: Path,
        *,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        kv_cache_bytes: int = KV_CACHE_BYTES,
        max_model_len: int = MAX_MODEL_LEN,
        block_size: int = BLOCK_SIZE,
        dtype: str = "float32",
        log_name: str = "server.log",
        startup_s: float = STARTUP_S,
    ) -> None:
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.tmp / log_name
        self.startup_s = startup_s
        self.start_s = float("nan")
        self.env = {**os.environ, **engine_env(self.tmp)}
        # the API server always runs its engine in a child process
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
        self.env.update(env or {})
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--max-model-len", str(max_model_len),
            "--block-size", str(block_size),
            "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--dtype", dtype,
            "--enforce-eager",
            "--seed", "0",
            "--enable-prompt-tokens-details",
            *args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        started = time.monotonic()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        deadline = started + self.startup_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise ServerError(
                        f"vLLM exited with {self.proc.returncode}:\n{log_tail(self.log)}"
                    )
                try:
                    with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"vLLM not healthy after {self.startup_s:.0f} s:\n{log_tail(self.log)}"
                    )
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - started
        return self.url

    def post(self, path: str, body: Mapping[str, Any] | None = None, timeout: float = 120) -> int:
        data = json.dumps(dict(body or {})).encode()
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return int(r.status)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)  # the group holds the engine core too
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        # whatever of the group is still there (the engine core outliving its parent)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def vllm_server(model: Path, tmp: Path, **kwargs: Any) -> Iterator[str]:
    """Serve ``model`` (see `VllmServer` for ``kwargs``); yields the base URL."""
    with VllmServer(model, tmp, **kwargs) as server:
        yield server.url
