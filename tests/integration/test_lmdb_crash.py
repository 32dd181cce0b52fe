"""Crash consistency of the lmdb tier: a writer process killed with SIGKILL, then reopened."""

from __future__ import annotations

import logging
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvtier.core.blockfmt import HEADER_SIZE, encoded_size
from kvtier.core.keys import ChunkKey
from kvtier.tiers.lmdb_tier import LmdbTier
from tests.integration.lmdb_writer import (
    MAX_BATCH,
    chunk_bytes_of,
    expected_payload,
    index_of,
    key_of,
    open_tier,
)

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 40
MAX_ACKS_BEFORE_KILL = 40
MAX_EXTRA_DELAY_S = 0.02
ROUND_DEADLINE_S = 20.0
FRESH_WRITES = 3


@dataclass
class WriterRun:
    begins: list[int] = field(default_factory=list)
    acks: list[list[int]] = field(default_factory=list)
    evictions: int = 0
    bad: list[str] = field(default_factory=list)
    in_flight: bool = False
    """The last complete line was a ``begin``: killed between starting a write and its ack."""

    def feed(self, line: str) -> None:
        word, *rest = line.split()
        if word == "begin":
            self.begins.append(int(rest[0]))
            self.in_flight = True
        elif word == "ack":
            self.evictions = max(self.evictions, int(rest[0]))
            self.acks.append([int(i) for i in rest[1:]])
            self.in_flight = False
        elif word == "bad":
            self.bad.append(line)


def _run_writer_until_killed(
    path: Path, start: int, rng: random.Random, stderr_path: Path, where: str
) -> WriterRun:
    """Start a writer, let it commit a random number of times, then SIGKILL it mid-run."""
    acks_wanted = rng.randint(1, MAX_ACKS_BEFORE_KILL)
    sync_interval_s = rng.choice([0.0, 0.05, 0.2])
    run = WriterRun()
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.lmdb_writer",
                str(path),
                str(start),
                str(rng.getrandbits(32)),
                str(sync_interval_s),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    try:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        pending = b""
        deadline = time.monotonic() + ROUND_DEADLINE_S
        while len(run.acks) < acks_wanted:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{where}: writer made no progress: {stderr_path.read_text()}"
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            data = os.read(fd, 1 << 16)
            assert data, f"{where}: writer exited early: {stderr_path.read_text()}"
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                run.feed(line.decode())
        time.sleep(rng.uniform(0.0, MAX_EXTRA_DELAY_S))
        assert proc.poll() is None, f"{where}: writer was not running when it was to be killed"
        proc.kill()
        rest, _ = proc.communicate(timeout=ROUND_DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"{where}: {stderr_path.read_text()}"
    # a trailing fragment without a newline is ignored: its write may not have finished
    *lines, _ = (pending + rest).split(b"\n")
    for line in lines:
        run.feed(line.decode())
    return run


def _read(tier: LmdbTier, key: ChunkKey) -> bytes | None:
    dst = bytearray(chunk_bytes_of(key))
    return bytes(dst) if tier.read_into(key, memoryview(dst)) else None


def _check_reopened(tier: LmdbTier, run: WriterRun, high: int, where: str) -> list[ChunkKey]:
    keys = list(tier.keys())
    assert tier.contains(keys) == [True] * len(keys), where
    for key in keys:
        index = index_of(key)
        # only keys some writer may have stored, each under its own namespace
        assert 0 <= index < high, f"{where}: key {index} was never written"
        assert key == key_of(index), f"{where}: key {index} has the wrong namespace"
        assert _read(tier, key) == expected_payload(key), (
            f"{where}: key {index} does not read back as written"
        )
    # the newest acknowledged batch is far younger than anything a later batch could evict
    if run.acks:
        last = [key_of(i) for i in run.acks[-1]]
        assert tier.contains(last) == [True] * len(last), f"{where}: committed batch lost"
    never = [key_of(i) for i in range(high, high + 2 * MAX_BATCH)]
    assert tier.contains(never) == [False] * len(never), where
    assert all(_read(tier, key) is None for key in never), where
    stats = tier.stats()
    assert stats.counters["corrupt"] == 0, where
    assert stats.chunks == len(keys), where
    assert stats.used_bytes == sum(encoded_size(chunk_bytes_of(k)) for k in keys), where
    # the three databases must agree with each other after any kill
    with tier.env.begin() as txn:
        for db in (tier.store.chunks, tier.store.meta, tier.store.lru):
            assert txn.stat(db)["entries"] == len(keys), where
    return keys


def test_sigkilled_writer_leaves_only_whole_verified_chunks(tmp_path: Path) -> None:
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    path = tmp_path / "lmdb"
    next_index = 0
    survivors = 0
    evictions = 0
    in_flight_kills = 0
    acked: set[int] = set()
    keys: list[ChunkKey] = []
    for round_no in range(ROUNDS):
        where = f"seed {seed} round {round_no}"
        run = _run_writer_until_killed(path, next_index, rng, tmp_path / "writer.err", where)
        assert not run.bad, f"{where}: {run.bad}"
        assert run.begins, where
        high = max(run.begins)
        evictions += run.evictions
        in_flight_kills += run.in_flight
        acked.update(i for batch in run.acks for i in batch)

        tier = open_tier(path)
        try:
            keys = _check_reopened(tier, run, high, where)
            survivors += len(keys)
            fresh = [key_of(i) for i in range(high, high + FRESH_WRITES)]
            assert tier.put_many([(k, expected_payload(k)) for k in fresh]) == [True] * len(fresh)
            assert all(_read(tier, k) == expected_payload(k) for k in fresh), where
            assert tier.stats().counters["corrupt"] == 0, where
        finally:
            tier.close()
        next_index = high + FRESH_WRITES

    assert survivors > 0, f"seed {seed}: nothing survived any kill"
    assert evictions > 0, f"seed {seed}: the writers never evicted"
    assert acked - {index_of(k) for k in keys}, f"seed {seed}: no acknowledged chunk was evicted"
    assert in_flight_kills > 0, f"seed {seed}: no kill landed inside a write"
    print(
        f"seed {seed}: {survivors} chunks survived over {ROUNDS} kills "
        f"({in_flight_kills} inside a write), writers evicted {evictions}"
    )


def _flip(value: bytes, other: bytes) -> bytes:
    damaged = bytearray(value)
    damaged[HEADER_SIZE + len(damaged[HEADER_SIZE:]) // 2] ^= 0x01
    return bytes(damaged)


def _truncate(value: bytes, other: bytes) -> bytes:
    return value[: HEADER_SIZE + (len(value) - HEADER_SIZE) // 2]


def _swap(value: bytes, other: bytes) -> bytes:
    return other


@pytest.mark.parametrize("damage", [_flip, _truncate, _swap], ids=["flip", "truncate", "swap"])
def test_damaged_value_is_quarantined(
    tmp_path: Path, damage: Callable[[bytes, bytes], bytes], caplog: pytest.LogCaptureFixture
) -> None:
    victim, bystander = key_of(0), key_of(1)
    tier = open_tier(tmp_path / "lmdb")
    try:
        assert tier.put_many([(k, expected_payload(k)) for k in (victim, bystander)]) == [True] * 2
        with tier.env.begin(write=True, db=tier.store.chunks) as txn:
            value = bytes(txn.get(victim))
            damaged = damage(value, bytes(txn.get(bystander)))
            assert damaged != value
            txn.put(victim, damaged)

        with caplog.at_level(logging.ERROR, logger="kvtier.tiers.lmdb_tier"):
            assert _read(tier, victim) is None
        assert victim.hex() in caplog.text
        assert tier.stats().counters["corrupt"] == 1
        assert tier.contains([victim]) == [False]
        assert _read(tier, victim) is None
        assert tier.stats().counters["corrupt"] == 1
        assert _read(tier, bystander) == expected_payload(bystander)
        with tier.env.begin() as txn:
            assert txn.get(victim, db=tier.store.chunks) is None
            assert txn.get(victim, db=tier.store.meta) is None
            assert txn.stat(tier.store.lru)["entries"] == 1
    finally:
        tier.close()

    # the quarantine was committed, not only dropped from memory
    tier = open_tier(tmp_path / "lmdb")
    try:
        assert tier.contains([victim, bystander]) == [False, True]
        assert tier.put(victim, expected_payload(victim))
        assert _read(tier, victim) == expected_payload(victim)
        assert tier.stats().counters["corrupt"] == 0
    finally:
        tier.close()
