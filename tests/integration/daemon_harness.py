"""kvtierd and its data-plane clients, each in a process of its own.

The test side: `write_config` lays out one daemon's files, `Processes` starts daemons and clients
and kills whatever is left at teardown.

The client side runs as ``python -m tests.integration.daemon_harness COMMAND ...``:

- ``client``: register the target pool, then optionally store, look up, load and reserve index
  ranges (``A:B``); prints one JSON line; with ``--hold`` it then keeps its session, leases and
  reservations until killed; ``--tenant`` names the pool's tenant, ``--uid`` drops root first
  (a refused registration prints ``{"refused": why}``);
- ``writer``: store fresh chunks in a loop, printing ``ack I...`` after each commit, until killed;
- ``check``: find every present chunk below ``--end`` and load it; prints one JSON line.

Chunk ``i`` is always ``key_of(i)`` with the bytes ``expected(key_of(i))``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvtier.core.errors import PermissionDeniedError
from kvtier.core.keys import ChunkKey
from kvtier.core.peers import TICKET_METADATA, peer_socket_path
from kvtier.core.protocol import SlotRef
from kvtier.rpc import AdminClient, GrpcTierClient
from kvtier.rpc.admin_client import bearer
from kvtier.rpc.session import read_ticket
from kvtier.tiers.arena import ArenaMemory
from kvtier.tiers.commit_checksums import ledger_path
from tests.support import MiB, keys_for, new_arena_path, payload_for, target_spec

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 256 << 10
READY = "kvtierd ready: "
START_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 60.0
SESSION_TIMEOUT_S = 1.5
_MAX_UNIX_PATH = 100  # sun_path holds 108 bytes


def namespace() -> bytes:
    return target_spec().digest()


def key_of(index: int) -> ChunkKey:
    return keys_for(namespace(), 1, start=index)[0]


def expected(key: ChunkKey) -> bytes:
    return payload_for(key, CHUNK)


def ticket(socket: Path) -> tuple[tuple[str, str]]:
    """The metadata that opens a session on a raw stub: a peer ticket for this process."""
    value = read_ticket(peer_socket_path(socket), 10.0)
    assert value, f"no peer ticket from {peer_socket_path(socket)}"
    return ((TICKET_METADATA, value),)


def index_range(text: str) -> range:
    start, _, end = text.partition(":")
    return range(int(start), int(end))


# -- the test side ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DaemonFiles:
    config: Path
    socket: Path
    arena: Path
    lmdb: Path
    log: Path


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def write_config(
    directory: Path, arena: Path, overrides: Mapping[str, Any] | None = None
) -> DaemonFiles:
    """A small daemon: 32 MiB arena, 96 MiB lmdb, ephemeral admin and metrics ports."""
    socket = directory / "kvtierd.sock"
    if len(str(socket)) > _MAX_UNIX_PATH:
        socket = Path(tempfile.mkdtemp(prefix="kvt-")) / "kvtierd.sock"
    tree: dict[str, Any] = {
        "arena": {"path": str(arena), "size_bytes": 32 * MiB, "extent_bytes": 2 * MiB},
        "lmdb": {
            "path": str(directory / "lmdb"),
            "budget_bytes": 96 * MiB,
            "sync_interval_s": 0.2,
        },
        "server": {
            "socket_path": str(socket),
            "admin_address": "127.0.0.1:0",
            "metrics_address": "127.0.0.1:0",
            "session_timeout_s": SESSION_TIMEOUT_S,
            "heartbeat_interval_s": 0.3,
            "workers": 4,
            "drain_timeout_s": 20.0,
        },
    }
    tree = _merge(tree, overrides or {})
    config = directory / "kvtier.yaml"
    config.write_text(yaml.safe_dump(tree))
    return DaemonFiles(config, socket, arena, directory / "lmdb", directory / "kvtierd.log")


QUICK_TO_GIVE_UP: Mapping[str, Any] = {
    "lookup_budget_ms": 3000,
    "request_timeout_s": 2.0,
    "breaker_reset_s": 0.5,
}
"""Object-store settings that turn a store that stopped answering into misses within seconds."""


def object_node(
    directory: Path, url: str, overrides: Mapping[str, Any] | None = None, **store: Any
) -> DaemonFiles:
    """A small daemon (`write_config`) in a new ``directory``, with an arena of its own and the
    object store ``url`` (``store``: its other settings), indexed in ``directory``;
    ``overrides``: other sections."""
    directory.mkdir()
    index = {"index_path": str(directory / "objindex"), "index_map_bytes": 64 * MiB}
    tree = _merge({"object": {"url": url, **index, **store}}, overrides or {})
    return write_config(directory, new_arena_path(), tree)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without KVTIER_ overrides, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(extra or {})
    return env


class LineReader:
    """Complete lines from a child's stdout, with a deadline and without blocking past it."""

    def __init__(self, proc: subprocess.Popen[bytes], what: str) -> None:
        assert proc.stdout is not None
        self._fd = proc.stdout.fileno()
        self._pending = b""
        self._lines: list[str] = []
        self.what = what

    def next_line(self, timeout_s: float) -> str | None:
        """The next line, or None once the child closed its stdout."""
        deadline = time.monotonic() + timeout_s
        while not self._lines:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.what}: no output within {timeout_s} s")
            ready, _, _ = select.select([self._fd], [], [], remaining)
            if not ready:
                continue
            data = os.read(self._fd, 1 << 16)
            if not data:
                return None
            *lines, self._pending = (self._pending + data).split(b"\n")
            self._lines.extend(line.decode() for line in lines)
        return self._lines.pop(0)


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the admin token to every call of a raw stub's channel."""

    def __init__(self, token: str) -> None:
        self._metadata = bearer(token)

    def _with_token(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), *self._metadata])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)


@dataclass
class RunningDaemon:
    proc: subprocess.Popen[bytes]
    files: DaemonFiles
    admin_port: int
    metrics_port: int
    arena: Path
    admin_token: str | None
    """The token kvtierd's admin API takes (the one it wrote at its first start, by default)."""

    @property
    def admin_address(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    def admin(self, token: str | None = None) -> AdminClient:
        """A client with ``token``, by default the daemon's own; "" sends none."""
        token = self.admin_token if token is None else token
        return AdminClient(self.admin_address, token=token, timeout_s=20.0)

    def admin_channel(self) -> grpc.Channel:
        """A plaintext channel to the admin API whose calls carry the daemon's token."""
        channel = grpc.insecure_channel(self.admin_address)
        if self.admin_token is None:
            return channel
        return grpc.intercept_channel(channel, _Bearer(self.admin_token))

    def stats(self) -> Any:
        client = self.admin()
        try:
            return client.stats()
        finally:
            client.close()

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Every sample of /metrics: (name, labels, value)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return [
            (sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def chunks_moved(self, direction: str) -> float:
        """``kvtier_transfer_chunks_total`` of one direction (store, load, demote, ...)."""
        return sum(
            value
            for name, labels, value in self.metrics()
            if name == "kvtier_transfer_chunks_total" and labels.get("direction") == direction
        )

    def log_text(self) -> str:
        return self.files.log.read_text() if self.files.log.exists() else ""

    def stop(self) -> None:
        """SIGSTOP, returning once every thread has stopped: the signal alone lets a thread
        that is running finish the call in hand."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10.0
        tasks = Path(f"/proc/{self.proc.pid}/task")
        while not all(_stopped(task) for task in tasks.iterdir()):
            if time.monotonic() > deadline:
                raise AssertionError(f"kvtierd (pid {self.proc.pid}) did not stop on SIGSTOP")
            time.sleep(0.001)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def signal_and_wait(self, signum: int, timeout_s: float) -> int:
        self.proc.send_signal(signum)
        return self.proc.wait(timeout_s)


def _stopped(task: Path) -> bool:
    try:
        stat = (task / "stat").read_text()
    except FileNotFoundError:  # the thread ended
        return True
    # the state follows the command name, which may hold spaces and parentheses
    return stat[stat.rindex(")") + 2] in "tT"


def _client_command(command: str, socket: Path, replica: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tests.integration.daemon_harness",
        command,
        "--socket",
        str(socket),
        "--replica",
        replica,
        *args,
    ]


class Processes:
    """Every process a test starts; whatever is still running at `close` gets SIGKILL."""

    def __init__(self, log_dir: Path) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []
        self._ledgers: set[Path] = set()  # what a daemon killed here leaves beside its arena
        self._log_dir = log_dir
        self._n = 0

    def _log(self, name: str) -> Path:
        self._n += 1
        return self._log_dir / f"{self._n:02d}-{name}.log"

    def spawn(
        self, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with log.open("ab") as stderr:
            proc = subprocess.Popen(
                list(argv),
                cwd=ROOT,
                env=clean_env(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
        self._procs.append(proc)
        return proc

    def start_daemon(
        self, files: DaemonFiles, env: Mapping[str, str] | None = None
    ) -> RunningDaemon:
        argv = [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(files.config)]
        proc = self.spawn(argv, files.log, env)
        self._ledgers.add(ledger_path(files.arena))
        reader = LineReader(proc, "kvtierd")
        line = reader.next_line(START_TIMEOUT_S)
        if line is None or not line.startswith(READY):
            proc.kill()
            proc.wait()
            raise AssertionError(
                f"kvtierd did not start (exit {proc.returncode}, said {line!r}):\n"
                + files.log.read_text()
            )
        fields = dict(part.split("=", 1) for part in line[len(READY) :].split())
        assert fields["data"] == f"unix:{files.socket}", line
        token = fields["admin_token"]
        return RunningDaemon(
            proc,
            files,
            int(fields["admin_port"]),
            int(fields["metrics_port"]),
            Path(fields["arena"]),
            None if token == "-" else Path(token).read_text().strip(),
        )

    def run_daemon_to_exit(
        self, files: DaemonFiles, env: Mapping[str, str] | None = None, timeout_s: float = 30.0
    ) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of a daemon expected to refuse to start; one that
        starts anyway is killed at once rather than waited for."""
        argv = [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(files.config)]
        proc = self.spawn(argv, files.log, env)
        reader = LineReader(proc, "kvtierd")
        out: list[str] = []
        while (line := reader.next_line(timeout_s)) is not None:
            out.append(line)
            if line.startswith(READY):
                proc.kill()
        return proc.wait(timeout_s), "\n".join(out), files.log.read_text()

    def client(self, socket: Path, replica: str, *args: str) -> dict[str, Any]:
        """Run a client to completion; its JSON line."""
        log = self._log(f"client-{replica}")
        proc = self.spawn(_client_command("client", socket, replica, *args), log)
        out, _ = proc.communicate(timeout=CLIENT_TIMEOUT_S)
        assert proc.returncode == 0, f"client {replica} exit {proc.returncode}:\n{log.read_text()}"
        return dict(json.loads(out.decode().splitlines()[-1]))

    def check(self, socket: Path, end: int) -> dict[str, Any]:
        log = self._log("check")
        proc = self.spawn(_client_command("check", socket, "checker", "--end", str(end)), log)
        out, _ = proc.communicate(timeout=CLIENT_TIMEOUT_S)
        assert proc.returncode == 0, f"check exit {proc.returncode}:\n{log.read_text()}"
        return dict(json.loads(out.decode().splitlines()[-1]))

    def holding_client(
        self, socket: Path, replica: str, *args: str
    ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
        """Start a client that keeps what it took until killed; it and its JSON line."""
        log = self._log(f"hold-{replica}")
        proc = self.spawn(_client_command("client", socket, replica, *args, "--hold"), log)
        line = LineReader(proc, f"client {replica}").next_line(CLIENT_TIMEOUT_S)
        assert line is not None, f"client {replica} exit {proc.wait()}:\n{log.read_text()}"
        return proc, dict(json.loads(line))

    def writer(
        self, socket: Path, replica: str, start: int
    ) -> tuple[subprocess.Popen[bytes], LineReader, Path]:
        log = self._log(f"writer-{replica}")
        proc = self.spawn(_client_command("writer", socket, replica, "--start", str(start)), log)
        return proc, LineReader(proc, f"writer {replica}"), log

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self._procs:
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs.clear()
        for ledger in self._ledgers:
            ledger.unlink(missing_ok=True)
        self._ledgers.clear()


# -- the client side ----------------------------------------------------------------------------


class ArenaClient:
    def __init__(self, socket: Path, replica: str, tenant: str = "default") -> None:
        self.rpc = GrpcTierClient(socket, replica)
        try:
            self.namespace = self.rpc.register_pool(target_spec(tenant=tenant), CHUNK)
        except BaseException:
            self.rpc.close()
            raise
        self.arena = ArenaMemory.attach(self.rpc.arena_path)

    def key(self, index: int) -> ChunkKey:
        """Chunk ``index`` of this client's pool (`key_of` in the default tenant's)."""
        return keys_for(self.namespace, 1, start=index)[0]

    def store(self, indices: Sequence[int]) -> list[int]:
        """Reserve, write and commit; the indices committed (keys already present get no slot)."""
        refs = self.rpc.reserve([self.key(i) for i in indices])
        granted = [(i, ref) for i, ref in zip(indices, refs, strict=True) if ref is not None]
        for _, ref in granted:
            assert ref.nbytes == CHUNK, ref
            self.arena.view(ref.offset, ref.nbytes)[:] = expected(ref.key)
        if not granted:
            return []
        committed = self.rpc.commit([ref for _, ref in granted])
        assert committed == len(granted), (committed, len(granted))
        return [i for i, _ in granted]

    def load(self, indices: Sequence[int], keep: bool) -> tuple[list[bool | None], list[SlotRef]]:
        """Per index: None when not leased, else whether the arena holds the expected bytes."""
        leases = self.rpc.lease([self.key(i) for i in indices])
        verdicts: list[bool | None] = []
        for i, lease in zip(indices, leases, strict=True):
            if lease is None:
                verdicts.append(None)
                continue
            data = bytes(self.arena.view(lease.offset, lease.nbytes))
            verdicts.append(lease.key == self.key(i) and data == expected(self.key(i)))
        held = [lease for lease in leases if lease is not None]
        if not keep:
            self.rpc.release(held)
            held = []
        return verdicts, held

    def close(self) -> None:
        self.rpc.close()
        self.arena.close()


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _emit(doc: object) -> None:
    _say(json.dumps(doc))


def _become(uid: int) -> None:
    """Drop root for ``uid``, with its own number as its only group (65534: nobody, nogroup)."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _run_client(args: argparse.Namespace) -> None:
    if args.uid is not None:
        _become(args.uid)
    try:
        client = ArenaClient(args.socket, args.replica, args.tenant)
    except PermissionDeniedError as exc:
        _emit({"refused": str(exc)})
        return
    out: dict[str, Any] = {"session": client.rpc.session_id}
    if args.store:
        out["stored"] = client.store(index_range(args.store))
    if args.lookup:
        result = client.rpc.lookup([client.key(i) for i in index_range(args.lookup)])
        out["hits"], out["tiers"] = result.hits, result.tiers
    if args.load:
        out["loaded"], _held = client.load(index_range(args.load), keep=args.hold)
    if args.reserve:
        refs = client.rpc.reserve([client.key(i) for i in index_range(args.reserve)])
        out["reserved"] = [ref is not None for ref in refs]
    _emit(out)
    if args.hold:
        while True:  # the test ends this process with a signal
            time.sleep(60)
    client.close()


def _run_writer(args: argparse.Namespace) -> None:
    client = ArenaClient(args.socket, args.replica)
    next_index = args.start
    while True:
        batch = list(range(next_index, next_index + args.batch))
        next_index += args.batch
        _say(f"begin {next_index}")  # every index below it may have reached the daemon
        _say(" ".join(["ack", *map(str, client.store(batch))]))


def _present(client: ArenaClient, end: int) -> Iterator[int]:
    for i in range(end):
        if client.rpc.lookup([key_of(i)]).hits == 1:
            yield i


def _run_check(args: argparse.Namespace) -> None:
    client = ArenaClient(args.socket, args.replica)
    present = list(_present(client, args.end))
    mismatched: list[int] = []
    not_leased: list[int] = []
    for start in range(0, len(present), args.batch):
        batch = present[start : start + args.batch]
        verdicts, _ = client.load(batch, keep=False)
        mismatched += [i for i, v in zip(batch, verdicts, strict=True) if v is False]
        not_leased += [i for i, v in zip(batch, verdicts, strict=True) if v is None]
    _emit({"present": present, "mismatched": mismatched, "not_leased": not_leased})
    client.close()


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="daemon_harness")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("client", "writer", "check"):
        p = sub.add_parser(name)
        p.add_argument("--socket", type=Path, required=True)
        p.add_argument("--replica", required=True)
    client = sub.choices["client"]
    for op in ("store", "lookup", "load", "reserve"):
        client.add_argument(f"--{op}", metavar="A:B")
    client.add_argument("--hold", action="store_true")
    client.add_argument("--tenant", default="default", help="the tenant of its pool")
    client.add_argument("--uid", type=int, help="drop root for this uid before connecting")
    client.set_defaults(func=_run_client)
    writer = sub.choices["writer"]
    writer.add_argument("--start", type=int, required=True)
    writer.add_argument("--batch", type=int, default=4)
    writer.set_defaults(func=_run_writer)
    check = sub.choices["check"]
    check.add_argument("--end", type=int, required=True)
    check.add_argument("--batch", type=int, default=16)
    check.set_defaults(func=_run_check)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
