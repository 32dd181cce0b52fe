"""Embedded mode's close under load: SIGTERM to vLLM's API server while requests run (what a pod's
stop does), then a restart on the same tiers.

Usage: ``python -m benchmarks.shutdown [--json] [--prompts N] [--prompt-tokens T]``

An embedded arena lives in the engine process's memory map, and vLLM's API server, on SIGTERM,
sends its engine process SIGTERM and kills it after ``--shutdown-timeout`` (0 by default: at
once; vLLM's process manager gives 5 s where no timeout is set): embedded mode's close cannot
count on running. What the arena held and lmdb did not is kept by the next start at the same
arena path instead (kvtier/tiers/arena_salvage.py). A real
``vllm.entrypoints.openai.api_server`` serves the locally built 12-layer model
(tests/fixtures/models.py, bf16, 12 KiB of KV per token) with ``KVTierConnector`` embedded on its
defaults (``writeback_backlog_mib``: 256), an arena and lmdb of their own. ``--prompts``
distinct prompts of ``--prompt-tokens`` random tokens run at once, each asked for 512 tokens;
once every prompt's chunks are in the arena (``vllm:kvtier_transfer_chunks_total``) and while
they decode, the API server's process (not its group) gets SIGTERM.

Reported: ``stored_chunks`` (chunks the engine copied into the arena before the signal),
``exit_s`` (SIGTERM to the engine core and its workers gone; the API server itself waits for
its clients' connections, and is then stopped as a pod's grace period would),
``shutdown_written_chunks`` and ``shutdown_write_s`` (what the connector's close wrote to lmdb,
from its log line; none when the engine was killed first), ``arena_left`` (the arena file is
still in /dev/shm), ``lmdb_chunks_before_restart``, then, from a second server started on the
same tiers, ``restart_hit_tokens`` over ``restart_hit_possible`` (each prompt again, one output
token: tokens vLLM reports cached, over whole chunks of the prompt before its last token),
``lmdb_chunks`` (keys lmdb holds after it) and ``lost_chunks`` (stored and not in lmdb).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml

from benchmarks.harness.cli import MODEL_CACHE
from benchmarks.harness.connector import kvtier_connector
from benchmarks.harness.sizes import MiB
from kvtier.tiers.commit_checksums import ledger_path
from kvtier.tiers.lmdb_env import stored_keys_read_only
from tests.fixtures import models
from tests.fixtures.servers import STOP_S, VllmServer, connector_arg

log = logging.getLogger("kvtier.bench.shutdown")

BLOCK_SIZE = 32
BLOCKS_PER_CHUNK = 4
CHUNK_TOKENS = BLOCK_SIZE * BLOCKS_PER_CHUNK
MAX_MODEL_LEN = 3744
OUTPUT_TOKENS = 512
STORED_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 60.0
WINDOW_S = 5.0
"""The most vLLM's engine-process manager gives an engine core after SIGTERM, with no
``--shutdown-timeout``; with the API server's default (0) it kills it at once."""
_CLOSE_LINE = re.compile(r"kvtier: closing wrote (\d+) arena chunks to lmdb in ([0-9.]+) s")


def stored_chunks(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:kvtier_transfer_chunks_total{") and 'direction="store"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def gone(procs: list[psutil.Process], timeout: float) -> float | None:
    """Seconds until every one of ``procs`` has exited (a zombie nobody reaped yet counts:
    an engine's workers are not the API server's children); None past ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if not any(_running(p) for p in procs):
            return time.monotonic() - started
        time.sleep(0.01)
    return None


def _running(proc: psutil.Process) -> bool:
    try:
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


class Run:
    def __init__(
        self,
        model: Path,
        root: Path,
        *,
        prompts: int,
        prompt_tokens: int,
        arena_mib: int = 1024,
        lmdb_mib: int = 2048,
        connector_settings: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.root = root
        self.shm = Path(f"/dev/shm/kvtier-shutdown-{os.getpid()}")
        root.mkdir(parents=True, exist_ok=True)
        config = root / "kvtier.yaml"
        tree = {
            "arena": {"path": str(self.shm), "size_bytes": arena_mib * MiB},
            "lmdb": {"path": str(root / "lmdb"), "budget_bytes": lmdb_mib * MiB},
        }
        config.write_text(yaml.safe_dump(tree))
        self.connector = kvtier_connector(
            {
                "kvtier_config": str(config),
                "blocks_per_chunk": BLOCKS_PER_CHUNK,
                **(connector_settings or {}),
            }
        )
        rng = random.Random(7)
        vocab = models.vocab_size_of(model)
        low = len(models.SPECIAL_TOKENS)
        self.prompts = [
            [rng.randrange(low, vocab) for _ in range(prompt_tokens)] for _ in range(prompts)
        ]
        # every prompt and its output at once, and room for more
        tokens = prompts * (prompt_tokens + OUTPUT_TOKENS)
        self.kv_cache_bytes = tokens * models.kv_bytes_per_token(model) + 64 * MiB

    def server(self, name: str) -> VllmServer:
        return VllmServer(
            self.model,
            self.root / name,
            args=connector_arg(self.connector),
            kv_cache_bytes=self.kv_cache_bytes,
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            dtype="bfloat16",
        )

    def under_load(self) -> dict[str, Any]:
        """Serve the prompts at once, SIGTERM the API server mid-decode; what the close did."""
        server = self.server("a")
        server.start()
        exit_s: float | None = None
        try:
            threads = [
                threading.Thread(target=self._request, args=(server.url, p), daemon=True)
                for p in self.prompts
            ]
            for t in threads:
                t.start()
            expected = sum(len(p) // CHUNK_TOKENS for p in self.prompts)
            deadline = time.monotonic() + STORED_TIMEOUT_S
            while (stored := stored_chunks(server.url)) < expected:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {stored:.0f} of {expected} chunks stored")
                time.sleep(0.05)
            assert server.proc is not None
            # the engine core and its workers; the API server itself waits for its clients
            engine = [
                p
                for p in psutil.Process(server.proc.pid).children(recursive=True)
                if "VLLM::" in " ".join(p.cmdline())  # not its resource tracker
            ]
            if not engine:
                raise RuntimeError("no engine process found under the API server")
            os.kill(server.proc.pid, signal.SIGTERM)
            exit_s = gone(engine, EXIT_TIMEOUT_S)
        finally:
            # the rest of the group, as a pod's grace period ends: with the engine gone, only
            # the API server is left, waiting for the cut requests' connections to close
            server.stop(grace_s=0.0 if exit_s is not None else STOP_S)
        text = server.log.read_text(errors="replace")
        close = _CLOSE_LINE.search(text)
        return {
            "stored_chunks": stored,
            "exit_s": exit_s,
            "shutdown_written_chunks": int(close.group(1)) if close else None,
            "shutdown_write_s": float(close.group(2)) if close else None,
            "not_written_back": "not written back to lmdb" in text,
        }

    def _request(self, url: str, prompt: list[int]) -> None:
        # cut by the SIGTERM, as clients of a stopping pod are
        with contextlib.suppress(urllib.error.URLError, OSError):
            complete(url, str(self.model), prompt, OUTPUT_TOKENS)

    def restart(self) -> dict[str, Any]:
        """A second server on the same tiers: each prompt again."""
        hit = possible = 0
        with self.server("b") as server:
            for prompt in self.prompts:
                usage = complete(server.url, str(self.model), prompt, 1)["usage"]
                hit += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                possible += (len(prompt) - 1) // CHUNK_TOKENS * CHUNK_TOKENS
        return {"restart_hit_tokens": hit, "restart_hit_possible": possible}

    def lmdb_chunks(self) -> int:
        return len(stored_keys_read_only(self.root / "lmdb", b""))

    def run(self) -> dict[str, Any]:
        try:
            result = self.under_load()
            result["arena_left"] = self.shm.exists()
            result["lmdb_chunks_before_restart"] = self.lmdb_chunks()
            result.update(self.restart())
            held = self.lmdb_chunks()
            result["lmdb_chunks"] = held
            result["lost_chunks"] = max(0, int(result["stored_chunks"]) - held)
            result["chunk_bytes"] = CHUNK_TOKENS * models.kv_bytes_per_token(self.model)
            result["window_s"] = WINDOW_S
            return result
        finally:
            self.shm.unlink(missing_ok=True)
            ledger_path(self.shm).unlink(missing_ok=True)  # left by an engine killed at once


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=3072)
    parser.add_argument("--cache-dir", type=Path, default=MODEL_CACHE)
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    tokenizer = models.build_tokenizer(args.cache_dir)
    model = models.build_benchmark_llama(args.cache_dir, tokenizer_dir=tokenizer)
    with tempfile.TemporaryDirectory(prefix="kvtier-shutdown-", dir=args.cache_dir) as tmp:
        run = Run(model, Path(tmp), prompts=args.prompts, prompt_tokens=args.prompt_tokens)
        result = run.run()
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        mib = result["chunk_bytes"] / MiB
        print(f"stored before SIGTERM   {result['stored_chunks']:.0f} chunks")
        print(f"engine gone after       {result['exit_s']} s of SIGTERM")
        written = result["shutdown_written_chunks"]
        print(
            f"written at close        {written} chunks ({(written or 0) * mib:.0f} MiB) in "
            f"{result['shutdown_write_s']} s"
        )
        print(f"arena file left         {result['arena_left']}")
        print(f"in lmdb before restart  {result['lmdb_chunks_before_restart']}")
        print(f"in lmdb after restart   {result['lmdb_chunks']} (lost {result['lost_chunks']})")
        print(
            f"restart hits            {result['restart_hit_tokens']} of "
            f"{result['restart_hit_possible']} tokens"
        )
    return 0 if result["lost_chunks"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
