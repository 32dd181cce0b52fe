"""kvtierd started and stopped again and again by a process that keeps gRPC channels open, as
the soak does: counts the starts that failed (kvtierd gone before its ready line).

Usage: ``python -m benchmarks.soak_starts [--starts 100]``

A start is judged by `KvtierdProcess.start`; between starts the parent keeps a data-plane
session open with the previous (SIGKILLed) kvtierd, heartbeating, so that gRPC's threads are
busy in this process whenever it starts the next one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.harness.kvtierd import KvtierdProcess
from benchmarks.harness.sizes import MiB
from benchmarks.harness.specs import small_spec
from kvtier.core.errors import KVTierError
from kvtier.rpc import GrpcTierClient


def config(root: Path) -> dict[str, object]:
    return {
        "arena": {
            "path": f"/dev/shm/kvtier-starts-{os.getpid()}",
            "size_bytes": 8 * MiB,
            "extent_bytes": MiB,
            "min_slot_bytes": 4096,
        },
        "lmdb": {"path": str(root / "lmdb"), "budget_bytes": 8 * MiB},
        "server": {
            "socket_path": str(root / "kvtierd.sock"),
            "admin_token_file": str(root / "admin.token"),
            "admin_address": "127.0.0.1:0",
            "metrics_address": "127.0.0.1:0",
        },
    }


def run(starts: int) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="kvtier-starts-"))
    failed: list[str] = []
    unreached = 0
    try:
        daemon = KvtierdProcess(root / "daemon", config(root))
        client: GrpcTierClient | None = None
        for _ in range(starts):
            try:
                daemon.start()  # the last client's heartbeats keep gRPC's threads busy here
            except RuntimeError as exc:
                failed.append(f"exit {daemon.proc.wait() if daemon.proc else None}: {exc}"[:400])
                continue
            if client is not None:
                client.close()
            client = GrpcTierClient(root / "kvtierd.sock", "starts")
            try:
                client.register_pool(small_spec("starts", 16 << 10), 16 << 10)  # heartbeats
            except KVTierError as exc:
                code = daemon.proc.poll() if daemon.proc else None
                if code is not None:  # ready, then gone: its exit and its log say why
                    failed.append(f"after ready, exit {code}: {exc}\n{daemon.log_tail()}"[:800])
                else:  # this process's channel still backs off from the killed daemon
                    unreached += 1
            daemon.kill()  # SIGKILL, as the soak's kvtierd_kill
        if client is not None:
            client.close()
    finally:
        with contextlib.suppress(Exception):
            daemon.stop()
        Path(f"/dev/shm/kvtier-starts-{os.getpid()}").unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    return {
        "starts": starts,
        "failed": len(failed),
        "failures": failed,
        "unreached_while_alive": unreached,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=100)
    print(json.dumps(run(parser.parse_args().starts), indent=2))


if __name__ == "__main__":
    main()
