"""kvtierd as a process: data plane, session reaping, drain and crash restarts, request
validation, authentication, health, reflection, metrics and configuration errors."""

from __future__ import annotations

import os
import random
import signal
import stat
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvtier import __version__
from kvtier.api.v1 import admin_pb2, admin_pb2_grpc, tier_pb2, tier_pb2_grpc
from kvtier.core.codec import spec_to
from kvtier.core.errors import KVTierError, PermissionDeniedError, TierUnavailableError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import SlotRef
from kvtier.rpc import GrpcTierClient
from tests.integration.daemon_harness import (
    CHUNK,
    SESSION_TIMEOUT_S,
    DaemonFiles,
    Processes,
    RunningDaemon,
    key_of,
    namespace,
    ticket,
    wait_for,
    write_config,
)
from tests.support import MiB, keys_for, target_spec

TIER_SERVICE = "kvtier.v1.TierService"
ADMIN_SERVICE = "kvtier.v1.AdminService"
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
EXIT_TIMEOUT_S = 10.0
CRASH_ROUNDS = 3


def _tier(stats: admin_pb2.StatsResponse, name: str) -> admin_pb2.TierStats:
    (tier,) = [t for t in stats.tiers if t.tier == name]
    return tier


def _replicas(tier: admin_pb2.TierStats) -> list[tuple[str, str, int, int]]:
    return sorted((r.replica, r.pool, r.usage.used_bytes, r.usage.chunks) for r in tier.replicas)


def _metric(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    found = [v for n, lab, v in samples if n == name and lab == labels]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]


def _reservations(daemon: RunningDaemon) -> float:
    return _metric(daemon.metrics(), "kvtier_reservations")


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


# -- the data plane across processes ----------------------------------------------------------


def test_chunks_stored_by_one_process_load_byte_exact_in_another(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    assert daemon.arena == files.arena

    stored = procs.client(files.socket, "dp0", "--store", "0:6")
    assert stored["stored"] == list(range(6))

    other = procs.client(
        files.socket, "dp1", "--lookup", "0:8", "--load", "0:6", "--reserve", "0:6"
    )
    assert other["session"] != stored["session"]
    assert other["hits"] == 6
    assert other["tiers"] == ["cpu"] * 6
    assert other["loaded"] == [True] * 6
    assert other["reserved"] == [False] * 6  # present already: never stored twice

    stats = daemon.stats()
    cpu = _tier(stats, "cpu")
    assert cpu.usage.chunks == 6
    assert cpu.usage.used_bytes == 6 * CHUNK
    assert _replicas(cpu) == [("dp0", "target", 6 * CHUNK, 6)]
    assert cpu.counters["stores"] == 6
    assert cpu.counters["store_duplicate"] == 6
    assert stats.counters["hit_chunks_cpu"] == 6
    assert stats.leases == 0
    # an operator can tell which build serves, from the admin API and from the metrics
    assert stats.version == __version__
    builds = [labels for name, labels, _ in daemon.metrics() if name == "kvtier_build_info"]
    assert builds == [{"version": __version__}]


def test_killed_client_loses_its_leases_and_reservations_after_the_session_timeout(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    assert procs.client(files.socket, "dp0", "--store", "0:4")["stored"] == [0, 1, 2, 3]

    holder, held = procs.holding_client(
        files.socket, "doomed", "--load", "0:4", "--reserve", "100:104"
    )
    taken = time.monotonic()
    assert held["loaded"] == [True] * 4
    assert held["reserved"] == [True] * 4
    assert daemon.stats().leases == 4
    assert _reservations(daemon) == 4
    # in flight in another session, and leased chunks are not evictable
    assert procs.client(files.socket, "dp2", "--reserve", "100:104")["reserved"] == [False] * 4
    with closing(daemon.admin()) as admin:
        assert admin.evict(tier="cpu") == {"cpu": 0}

    # heartbeats keep a live holder's session past the timeout
    time.sleep(max(0.0, taken + 1.5 * SESSION_TIMEOUT_S - time.monotonic()))
    assert daemon.stats().leases == 4
    assert _reservations(daemon) == 4

    holder.send_signal(signal.SIGKILL)
    assert holder.wait(EXIT_TIMEOUT_S) == -signal.SIGKILL
    wait_for(
        lambda: daemon.stats().leases == 0 and _reservations(daemon) == 0,
        SESSION_TIMEOUT_S + 3.0,
        "the dead client's leases and reservations reclaimed",
    )
    wait_for(lambda: daemon.stats().sessions == 0, SESSION_TIMEOUT_S + 3.0, "sessions reaped")

    assert procs.client(files.socket, "dp2", "--store", "100:104")["stored"] == [100, 101, 102, 103]
    with closing(daemon.admin()) as admin:
        assert admin.evict(tier="cpu") == {"cpu": 8}
    assert f"{held['session']} (replica doomed) expired" in daemon.log_text()


def test_sigterm_drains_the_arena_and_a_warm_restart_serves_it_from_lmdb(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    # a connected client, still holding leases, must not hold the drain up
    holder, held = procs.holding_client(files.socket, "dp0", "--store", "0:4", "--load", "0:2")
    assert held["stored"] == [0, 1, 2, 3]
    stats = daemon.stats()
    assert stats.leases == 2
    assert _tier(stats, "cpu").usage.chunks == 4
    assert _tier(stats, "lmdb").usage.chunks == 0  # below the clean reserve: not written back yet

    # within EXIT_TIMEOUT_S, half the drain timeout: the holder's leases did not hold it up
    assert daemon.signal_and_wait(signal.SIGTERM, EXIT_TIMEOUT_S) == 0, daemon.log_text()
    assert holder.poll() is None
    assert not files.socket.exists()
    assert not files.arena.exists()
    assert "kvtierd stopped" in daemon.log_text()

    daemon = procs.start_daemon(files)
    assert _tier(daemon.stats(), "lmdb").usage.chunks == 4
    back = procs.client(files.socket, "dp1", "--lookup", "0:5", "--load", "0:4")
    assert back["hits"] == 4
    assert back["tiers"] == ["lmdb"] * 4
    assert back["loaded"] == [True] * 4
    lmdb = _tier(daemon.stats(), "lmdb")
    assert [(r.replica, r.usage.chunks) for r in lmdb.replicas] == [("dp0", 4)]


def test_sigterm_under_write_load_keeps_every_acknowledged_chunk(
    procs: Processes, files: DaemonFiles
) -> None:
    rng = random.Random()
    daemon = procs.start_daemon(files)
    writer, lines, log = procs.writer(files.socket, "w", 0)
    acked: set[int] = set()
    high = 0
    wanted = rng.randint(16, 48)
    signalled = False
    while (line := lines.next_line(EXIT_TIMEOUT_S)) is not None:
        word, *rest = line.split()
        if word == "begin":
            high = int(rest[0])
        else:
            acked.update(map(int, rest))
        if len(acked) >= wanted and not signalled:
            daemon.proc.send_signal(signal.SIGTERM)
            signalled = True
    assert signalled, f"writer stopped early:\n{log.read_text()}"
    assert daemon.proc.wait(EXIT_TIMEOUT_S) == 0, daemon.log_text()
    assert writer.wait(EXIT_TIMEOUT_S) != 0
    # nothing can have been evicted for room: everything written fits under the low-water mark
    assert high * CHUNK < 0.85 * 96 * MiB

    daemon = procs.start_daemon(files)
    report = procs.check(files.socket, high + 8)
    assert sorted(acked - set(report["present"])) == []
    assert report["mismatched"] == []
    assert report["not_leased"] == []
    assert all(i < high for i in report["present"])


def _writer_round(
    procs: Processes, daemon: RunningDaemon, files: DaemonFiles, start: int, rng: random.Random
) -> int:
    """Write until some chunks reached lmdb, SIGKILL the daemon mid-stream; the next free index."""
    before = _tier(daemon.stats(), "lmdb").usage.chunks
    writer, lines, log = procs.writer(files.socket, f"w{start}", start)
    high = start
    acked = 0
    wanted = rng.randint(12, 40)
    deadline = time.monotonic() + 30.0
    # kill only once this round's chunks are being written back too
    while acked < wanted or _tier(daemon.stats(), "lmdb").usage.chunks <= before:
        assert time.monotonic() < deadline, f"writer made no progress:\n{log.read_text()}"
        line = lines.next_line(10.0)
        assert line is not None, f"writer exited:\n{log.read_text()}"
        word, *rest = line.split()
        if word == "begin":
            high = int(rest[0])
        else:
            acked += len(rest)
    time.sleep(rng.uniform(0.0, 0.05))
    assert daemon.proc.poll() is None
    daemon.proc.send_signal(signal.SIGKILL)
    assert daemon.proc.wait(EXIT_TIMEOUT_S) == -signal.SIGKILL
    # the writer fails on its next call; anything it began before that counts
    while (line := lines.next_line(10.0)) is not None:
        if line.startswith("begin "):
            high = int(line.split()[1])
    assert writer.wait(EXIT_TIMEOUT_S) != 0
    return high


def _check_restarted(procs: Processes, daemon: RunningDaemon, high: int, where: str) -> int:
    assert _tier(daemon.stats(), "cpu").usage.chunks == 0, where
    # registering keeps what the killed daemon had committed to its arena (written to lmdb)
    report = procs.check(daemon.files.socket, high + 8)
    assert report["mismatched"] == [], where
    assert report["not_leased"] == [], where
    assert all(i < high for i in report["present"]), where
    with closing(daemon.admin()) as admin:
        *_, last = admin.verify("lmdb")
    assert last.done, where
    assert last.corrupt == 0, where
    in_lmdb = _tier(daemon.stats(), "lmdb").usage.chunks
    assert last.checked == in_lmdb, where
    assert len(report["present"]) == in_lmdb, where
    return in_lmdb


def test_daemon_sigkilled_under_write_load_restarts_with_only_sound_chunks(
    procs: Processes, files: DaemonFiles
) -> None:
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    daemon = procs.start_daemon(files)
    next_index = 0
    survivors = 0
    for round_no in range(CRASH_ROUNDS):
        where = f"seed {seed} round {round_no}"
        next_index = _writer_round(procs, daemon, files, next_index, rng)
        assert files.socket.exists(), where  # what a killed daemon leaves behind
        assert files.arena.exists(), where
        daemon = procs.start_daemon(files)
        survivors = _check_restarted(procs, daemon, next_index, where)
        assert survivors > 0, where
        print(f"{where}: wrote below {next_index}, {survivors} chunks survived")
    assert daemon.signal_and_wait(signal.SIGTERM, EXIT_TIMEOUT_S) == 0, daemon.log_text()


# -- request validation -----------------------------------------------------------------------


def _registration(chunk_bytes: int = CHUNK, **spec: Any) -> tier_pb2.PoolRegistration:
    pb = spec_to(target_spec())
    for name, value in spec.items():
        if name == "layout":
            pb.layout.CopyFrom(value)
        else:
            setattr(pb, name, value)
    return tier_pb2.PoolRegistration(spec=pb, chunk_bytes=chunk_bytes)


def _keys(keys: Sequence[bytes], key_bytes: int | None = None) -> tier_pb2.KeyBatch:
    size = key_bytes if key_bytes is not None else len(keys[0]) if keys else 0
    return tier_pb2.KeyBatch(key_bytes=size, packed=b"".join(keys))


def _raw_session(stub: tier_pb2_grpc.TierServiceStub, replica: str, files: DaemonFiles) -> str:
    request = tier_pb2.RegisterSessionRequest(replica_id=replica, pools=[_registration()])
    return str(stub.RegisterSession(request, timeout=10, metadata=ticket(files.socket)).session_id)


def _reserve_one(stub: tier_pb2_grpc.TierServiceStub, sid: str, key: bytes) -> tier_pb2.SlotRef:
    (grant,) = stub.Reserve(tier_pb2.ReserveRequest(session_id=sid, keys=_keys([key]))).grants
    assert grant.granted
    return grant.ref


def test_malformed_requests_get_their_status_and_the_daemon_keeps_serving(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    files = write_config(tmp_path, shm_path, {"server": {"max_batch_keys": 4}})
    daemon = procs.start_daemon(files)
    unregistered = keys_for(target_spec(model="never-registered").digest(), 2)
    bad_layout = spec_to(target_spec()).layout
    bad_layout.tokens_per_block = 0

    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)
        reg = stub.RegisterSession(
            tier_pb2.RegisterSessionRequest(replica_id="raw", pools=[_registration()]),
            timeout=10,
            metadata=ticket(files.socket),
        )
        sid = reg.session_id
        assert list(reg.namespaces) == [namespace()]
        good = key_of(0)
        ref = tier_pb2.SlotRef(key=good)
        short_ref = tier_pb2.SlotRef(key=b"k")

        def register(**request: Any) -> Callable[[], Any]:
            request.setdefault("pools", [_registration()])
            return lambda: stub.RegisterSession(
                tier_pb2.RegisterSessionRequest(**request), timeout=10
            )

        def lookup(batch: tier_pb2.KeyBatch, session: str = sid) -> Callable[[], Any]:
            return lambda: stub.Lookup(tier_pb2.LookupRequest(session_id=session, keys=batch))

        def reserve(batch: tier_pb2.KeyBatch, **request: Any) -> Callable[[], Any]:
            request.setdefault("session_id", sid)
            return lambda: stub.Reserve(tier_pb2.ReserveRequest(keys=batch, **request))

        def prefetch(batch: tier_pb2.KeyBatch, **request: Any) -> Callable[[], Any]:
            request.setdefault("session_id", sid)
            return lambda: stub.Prefetch(tier_pb2.PrefetchRequest(keys=batch, **request))

        invalid = grpc.StatusCode.INVALID_ARGUMENT
        not_found = grpc.StatusCode.NOT_FOUND
        precondition = grpc.StatusCode.FAILED_PRECONDITION
        five = [key_of(i) for i in range(5)]
        cases: list[tuple[str, Callable[[], Any], grpc.StatusCode]] = [
            ("namespace-only key", lookup(_keys([namespace()])), invalid),
            ("key too long", lookup(_keys([namespace() + bytes(33)])), invalid),
            ("key length 0", reserve(_keys([good], key_bytes=0)), invalid),
            ("packed not whole keys", lookup(_keys([good, b"tail"], key_bytes=len(good))), invalid),
            ("5 keys, limit 4", lookup(_keys(five)), invalid),
            ("5 keys, reserve", reserve(_keys(five)), invalid),
            ("5 keys, prefetch", prefetch(_keys(five)), invalid),
            (
                "5 refs, commit",
                lambda: stub.Commit(tier_pb2.CommitRequest(session_id=sid, refs=[ref] * 5)),
                invalid,
            ),
            ("5 refs, reserve", reserve(_keys([]), commit=[ref] * 5), invalid),
            ("5 refs, prefetch", prefetch(_keys([]), release=[ref] * 5), invalid),
            (
                "short ref key, release",
                lambda: stub.Release(tier_pb2.ReleaseRequest(session_id=sid, refs=[short_ref])),
                invalid,
            ),
            (
                "short ref key, abort",
                lambda: stub.Abort(tier_pb2.AbortRequest(session_id=sid, refs=[short_ref])),
                invalid,
            ),
            ("short ref key, reserve", reserve(_keys([]), commit=[short_ref]), invalid),
            ("unknown session", lookup(_keys([good]), session="no-such-session"), not_found),
            ("no session", lookup(_keys([good]), session=""), not_found),
            ("unknown session, prefetch", prefetch(_keys([good]), session_id="nope"), not_found),
            ("unknown session, register", register(session_id="nope"), not_found),
            (
                "pool unset",
                register(pools=[_registration(pool=tier_pb2.POOL_UNSPECIFIED)]),
                invalid,
            ),
            ("pool out of range", register(pools=[_registration(pool=7)]), invalid),
            (
                "draft without model",
                register(pools=[_registration(pool=tier_pb2.POOL_DRAFT)]),
                invalid,
            ),
            ("zero tokens per block", register(pools=[_registration(layout=bad_layout)]), invalid),
            ("tp_rank >= tp_size", register(pools=[_registration(tp_rank=2, tp_size=2)]), invalid),
            ("bad replica id", register(replica_id="a b"), invalid),
            ("17 pools", register(pools=[_registration()] * 17), invalid),
            (
                "chunk size other than the layout's",
                register(pools=[_registration(chunk_bytes=2 * CHUNK)]),
                invalid,
            ),
            (
                "zero chunk size",
                register(pools=[_registration(chunk_bytes=0, model="m0")]),
                invalid,
            ),
            ("unregistered pool, lookup", lookup(_keys(unregistered)), precondition),
            ("unregistered pool, reserve", reserve(_keys(unregistered)), precondition),
        ]
        got = {name: _code(call) for name, call, _ in cases}
        assert got == {name: code for name, _, code in cases}

        assert not stub.Heartbeat(tier_pb2.HeartbeatRequest(session_id="nope")).alive
        assert stub.Heartbeat(tier_pb2.HeartbeatRequest(session_id=sid)).alive
        assert lookup(_keys([good]))().hits == 0
        assert lookup(_keys([]))().hits == 0

    assert "Traceback" not in daemon.log_text()
    assert procs.client(files.socket, "dp0", "--store", "0:4")["stored"] == [0, 1, 2, 3]
    after = procs.client(files.socket, "dp1", "--lookup", "0:4", "--load", "0:4")
    assert after["loaded"] == [True] * 4
    assert daemon.proc.poll() is None


def test_malformed_admin_requests_get_their_status(procs: Processes, files: DaemonFiles) -> None:
    daemon = procs.start_daemon(files)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    with daemon.admin_channel() as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        cases: list[tuple[str, Callable[[], Any], grpc.StatusCode]] = [
            ("verify cpu", lambda: list(stub.Verify(admin_pb2.VerifyRequest(tier="cpu"))), invalid),
            ("evict unknown tier", lambda: stub.Evict(admin_pb2.EvictRequest(tier="gpu")), invalid),
            (
                "evict short namespace",
                lambda: stub.Evict(admin_pb2.EvictRequest(namespace=b"short")),
                invalid,
            ),
            (
                "quota without replica",
                lambda: stub.SetQuota(admin_pb2.SetQuotaRequest(pool="target", bytes=1)),
                invalid,
            ),
            (
                "quota of unknown pool",
                lambda: stub.SetQuota(admin_pb2.SetQuotaRequest(replica="r", pool="nope")),
                invalid,
            ),
            ("pin short key", lambda: stub.Pin(admin_pb2.PinRequest(keys=[b"k"])), invalid),
            (
                "draft swap with no draft pool",
                lambda: stub.DraftSwapBegin(admin_pb2.DraftSwapBeginRequest(revision="d2")),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
            (
                "draft swap commit of an unknown swap",
                lambda: stub.DraftSwapCommit(admin_pb2.DraftSwapCommitRequest(swap_id="x")),
                invalid,
            ),
        ]
        got = {name: _code(call) for name, call, _ in cases}
        assert got == {name: code for name, _, code in cases}
        assert stub.Stats(admin_pb2.StatsRequest(), timeout=10).sessions == 0
    assert "Traceback" not in daemon.log_text()


def test_a_session_commits_aborts_and_releases_only_what_it_holds(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    key = key_of(0)
    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)

        def commit(sid: str, ref: tier_pb2.SlotRef) -> int:
            return int(stub.Commit(tier_pb2.CommitRequest(session_id=sid, refs=[ref])).committed)

        def hits(sid: str) -> int:
            request = tier_pb2.LookupRequest(session_id=sid, keys=_keys([key]))
            return int(stub.Lookup(request).hits)

        a, b = _raw_session(stub, "a", files), _raw_session(stub, "b", files)
        ref = _reserve_one(stub, a, key)
        assert commit(b, ref) == 0
        stub.Abort(tier_pb2.AbortRequest(session_id=b, refs=[ref]))
        forged = tier_pb2.SlotRef()
        forged.CopyFrom(ref)
        forged.generation += 1
        assert commit(a, forged) == 0
        assert hits(a) == 0
        assert commit(a, ref) == 1
        assert commit(a, ref) == 0
        assert hits(b) == 1

        request = tier_pb2.PrefetchRequest(session_id=b, keys=_keys([key]))
        (lease,) = stub.Prefetch(request).leases
        assert lease.granted
        stub.Release(tier_pb2.ReleaseRequest(session_id=a, refs=[lease.ref]))
        assert daemon.stats().leases == 1
        for _ in range(2):
            stub.Release(tier_pb2.ReleaseRequest(session_id=b, refs=[lease.ref]))
        assert daemon.stats().leases == 0
        with closing(daemon.admin()) as admin:
            assert admin.evict(tier="cpu") == {"cpu": 1}  # no lease left behind


def test_a_rejected_reserve_commits_nothing(procs: Processes, files: DaemonFiles) -> None:
    procs.start_daemon(files)
    key = key_of(0)
    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)
        sid = _raw_session(stub, "a", files)
        ref = _reserve_one(stub, sid, key)
        bad = tier_pb2.ReserveRequest(session_id=sid, keys=_keys([b"short"]), commit=[ref])
        assert _code(lambda: stub.Reserve(bad)) is grpc.StatusCode.INVALID_ARGUMENT
        lookup = tier_pb2.LookupRequest(session_id=sid, keys=_keys([key]))
        assert stub.Lookup(lookup).hits == 0, "the commit carried by a rejected Reserve took effect"
        commit = tier_pb2.CommitRequest(session_id=sid, refs=[ref])
        assert stub.Commit(commit).committed == 1


def test_a_rejected_prefetch_releases_nothing(procs: Processes, files: DaemonFiles) -> None:
    daemon = procs.start_daemon(files)
    key = key_of(0)
    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)
        sid = _raw_session(stub, "a", files)
        ref = _reserve_one(stub, sid, key)
        assert stub.Commit(tier_pb2.CommitRequest(session_id=sid, refs=[ref])).committed == 1
        request = tier_pb2.PrefetchRequest(session_id=sid, keys=_keys([key]))
        (lease,) = stub.Prefetch(request).leases
        assert daemon.stats().leases == 1
        bad = tier_pb2.PrefetchRequest(session_id=sid, keys=_keys([b"short"]), release=[lease.ref])
        assert _code(lambda: stub.Prefetch(bad)) is grpc.StatusCode.INVALID_ARGUMENT
        assert daemon.stats().leases == 1, "the release carried by a rejected Prefetch took effect"


def _committed(
    client: GrpcTierClient, count: int, more: int = 0
) -> tuple[list[ChunkKey], list[SlotRef]]:
    """Keys of a new target pool, the first ``count`` stored in the arena (``more`` not), and
    the refs they were stored through."""
    keys = keys_for(client.register_pool(target_spec(), CHUNK), count + more)
    refs = [r for r in client.reserve(keys[:count]) if r is not None]
    assert client.commit(refs) == count
    return keys, refs


def test_a_leasing_lookup_leases_the_arena_prefix_and_releases_in_one_call(
    procs: Processes, files: DaemonFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = procs.start_daemon(files)
    # a client that cannot read the arena's index: every answer comes from kvtierd
    monkeypatch.setattr("kvtier.rpc.arena_view.readable_here", lambda: False)
    client = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    try:
        keys, _ = _committed(client, 3, more=1)
        result, leases = client.lookup(keys, lease=True)
        assert (result.hits, result.tiers) == (3, ["cpu"] * 3)
        assert [lease.key if lease else None for lease in leases] == keys[:3]
        assert daemon.stats().leases == 3
        # the leases go back in the next call, which leases only what it finds
        held = [lease for lease in leases if lease is not None]
        result, leases = client.lookup(keys[3:], release=held, lease=True)
        assert (result.hits, leases) == (0, [])
        assert daemon.stats().leases == 0
        # an unregistered namespace is refused before anything is released or leased
        foreign = keys_for(target_spec(model="unregistered").digest(), 1)
        (lease,) = client.lease(keys[:1])
        with pytest.raises(KVTierError):
            client.lookup(foreign, release=[lease] if lease else [], lease=True)
        assert daemon.stats().leases == 1
    finally:
        client.close()


def test_an_arena_whose_file_is_gone_from_its_path_is_not_read_as_holding_nothing(
    procs: Processes, files: DaemonFiles
) -> None:
    procs.start_daemon(files)
    client = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    moved = files.arena.with_name(files.arena.name + ".moved")
    try:
        keys, _ = _committed(client, 2)
        assert client.in_arena(keys) is not None
        assert len(client.in_arena(keys) or []) == 2
        # the path no longer names an arena (removed by hand): the index cannot be read, which
        # says nothing of what the arena holds, so a caller asks kvtierd
        files.arena.rename(moved)
        wait_for(lambda: client.in_arena(keys) is None, 10.0, "the client's next look at the path")
        assert client.lookup(keys).hits == 2
    finally:
        if moved.exists():
            moved.rename(files.arena)
        client.close()


def test_the_arenas_part_of_a_hit_comes_from_its_index_and_kvtierd_answers_the_rest(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    client = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    try:
        keys, refs = _committed(client, 3, more=2)
        assert not client.object_tier  # the session said this daemon has no object store
        before = daemon.stats().counters
        result, found = client.lookup(keys, lease=True)
        assert (result.hits, result.tiers) == (3, ["cpu"] * 3)
        slots = [(r.slot, r.generation) for r in refs]
        assert [(r.slot, r.generation) for r in found if r is not None] == slots
        after = daemon.stats().counters
        # one call, about the two keys past the arena's part only; nothing leased for it
        assert after["lookups"] - before["lookups"] == 1
        assert after["lookup_chunks"] - before["lookup_chunks"] == 2
        assert daemon.stats().leases == 0
        # asked again (the same request, waiting): answered, not counted again
        client.lookup(keys, lease=True, again=True)
        client.report_hits()
        wait_for(
            lambda: daemon.stats().counters["lookup_chunks"] == after["lookup_chunks"] + 3,
            10.0,
            "the first answer's index hits reported",
        )
        client.report_hits()  # the second kind of report goes with the next one
        wait_for(lambda: daemon.stats().leases == 0, 10.0, "the reports' leases ended")
        counted = daemon.stats().counters
        assert counted["lookup_chunks"] - before["lookup_chunks"] == 5
        assert counted["hit_chunks_cpu"] - before["hit_chunks_cpu"] == 3
    finally:
        client.close()


def test_a_hit_the_arena_holds_whole_is_found_in_its_index_and_reported_later(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    client = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    try:
        keys, refs = _committed(client, 3)
        lookups = daemon.stats().counters["lookups"]
        # the daemon stopped: the answer cannot come from it
        daemon.stop()
        try:
            started = time.monotonic()
            result, found = client.lookup(keys, lease=True)
            answered_s = time.monotonic() - started
        finally:
            daemon.resume()
        assert answered_s < 5.0  # a call would have waited for its 10 s timeout
        assert (result.hits, result.tiers, result.pending) == (3, ["cpu"] * 3, False)
        # the committed slots, at their current generation, with no lease behind them
        slots = [(r.slot, r.generation) for r in refs]
        assert [(r.slot, r.generation) for r in found if r is not None] == slots
        assert (daemon.stats().leases, daemon.stats().counters["lookups"]) == (0, lookups)
        client.release([r for r in found if r is not None])  # nothing to end: no call made
        # the report counts the hits (and refreshes their recency) without keeping a lease
        cpu_hits = _tier(daemon.stats(), "cpu").counters["hits"]
        client.report_hits()
        wait_for(
            lambda: daemon.stats().counters["lookups"] == lookups + 1, 10.0, "the hits reported"
        )
        wait_for(lambda: _tier(daemon.stats(), "cpu").counters["hits"] == cpu_hits + 3, 10.0, "")
        wait_for(lambda: daemon.stats().leases == 0, 10.0, "the report's leases ended")
        # a chunk gone from the arena is not answered from the index
        daemon.admin().evict(tier="cpu")
        result, leases = client.lookup(keys, lease=True)
        assert result.tiers != ["cpu"] * 3
        assert daemon.stats().leases == sum(lease is not None for lease in leases)
    finally:
        client.close()


def test_a_ref_answered_from_the_index_never_ends_a_lease_on_the_same_slot(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    client = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    try:
        (key,), _ = _committed(client, 1)
        (lease,) = client.lease([key])
        assert lease is not None
        assert daemon.stats().leases == 1
        _, (answered,) = client.lookup([key], lease=True)
        assert answered is not None
        assert (answered.slot, answered.generation) == (lease.slot, lease.generation)
        client.release([answered])
        assert daemon.stats().leases == 1  # the lease still stands...
        client.release([lease])
        assert daemon.stats().leases == 0  # ...until its holder ends it
    finally:
        client.close()


def test_chunk_events_tell_a_session_what_entered_and_left_the_tiers_of_its_pools(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    client = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    other = GrpcTierClient(files.socket, "dp1", timeout_s=10.0)
    try:
        keys = keys_for(client.register_pool(target_spec(), CHUNK), 2)
        theirs = keys_for(other.register_pool(target_spec(model="other"), CHUNK), 1)
        start = client.chunk_events(-1).result()
        for owner, owned in ((client, keys), (other, theirs)):
            assert owner.commit([r for r in owner.reserve(owned) if r is not None]) == len(owned)
        daemon.admin().evict(tier="cpu")  # written to lmdb first, then out of the arena
        found = client.chunk_events(start.cursor).result()
        events = {(e.stored, e.tier, e.key) for e in found.events}
        expected = {(stored, tier, k) for k in keys for stored, tier in _ENTERED_AND_LEFT}
        assert events == expected  # only this session's pools
        assert len(found.events) == len(expected)
        assert found.lost == 0
        assert client.chunk_events(found.cursor).result().events == []
    finally:
        client.close()
        other.close()


_ENTERED_AND_LEFT = ((True, "cpu"), (True, "lmdb"), (False, "cpu"))


def test_client_carries_on_in_a_new_session_after_the_daemon_restarts(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    client = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    try:
        client.register_pool(target_spec(), CHUNK)
        first = client.session_id
        assert daemon.signal_and_wait(signal.SIGTERM, EXIT_TIMEOUT_S) == 0
        procs.start_daemon(files)

        def recovered() -> bool:
            try:
                return client.lookup([key_of(0)]).hits == 0
            except TierUnavailableError:
                return False  # the channel is still backing off from the outage

        # the client opens a new session with its pools by itself; the caller does nothing
        wait_for(recovered, 10.0, "the client carries on against the restarted daemon")
        assert client.session_id != first
        client.register_pool(target_spec(), CHUNK)
        assert client.lookup([key_of(0)]).hits == 0
    finally:
        client.close()


# -- security ---------------------------------------------------------------------------------


def _refusals(tmp_path: Path) -> dict[str, tuple[dict[str, Any], str]]:
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    token = tmp_path / "read.token"
    token.write_text("read-only-token\n")
    token.chmod(0o600)
    return {
        "any-v4": ({"admin_address": "0.0.0.0:0"}, "server.admin_address"),
        "any-v6": ({"admin_address": "[::]:0"}, "server.admin_address"),
        "public-host": ({"admin_address": "192.0.2.1:0"}, "server.admin_address"),
        "empty-token": ({"admin_token_file": str(empty)}, "server.admin_token_file"),
        # under mTLS with no admin token file there is no admin token for it to go with
        "read-token-alone": (
            {
                "read_token_file": str(token),
                "tls_cert_file": str(tmp_path / "server.crt"),
                "tls_key_file": str(tmp_path / "server.key"),
                "tls_client_ca_file": str(tmp_path / "ca.crt"),
            },
            "server.read_token_file",
        ),
    }


@pytest.mark.parametrize(
    "case", ["any-v4", "any-v6", "public-host", "empty-token", "read-token-alone"]
)
def test_daemon_refuses_an_unauthenticated_or_broken_admin_setup(
    procs: Processes, tmp_path: Path, shm_path: Path, case: str
) -> None:
    server, key = _refusals(tmp_path)[case]
    files = write_config(tmp_path, shm_path, {"server": server})
    rc, out, err = procs.run_daemon_to_exit(files)
    assert rc == 2, err
    assert key in err
    assert "kvtierd ready" not in out
    assert not files.socket.exists()  # refused before anything was created
    assert not files.arena.exists()


def test_admin_api_needs_the_right_token_and_read_token_only_reads(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    admin_token, read_token = tmp_path / "admin.token", tmp_path / "read.token"
    admin_token.write_text("admin-secret-1\n")
    read_token.write_text("read-secret-2\n")
    admin_token.chmod(0o600)
    read_token.chmod(0o600)
    files = write_config(
        tmp_path,
        shm_path,
        {"server": {"admin_token_file": str(admin_token), "read_token_file": str(read_token)}},
    )
    daemon = procs.start_daemon(files)
    assert stat.S_IMODE(os.stat(files.socket).st_mode) == 0o660

    def stats(token: str | None) -> admin_pb2.StatsResponse:
        with closing(daemon.admin(token)) as client:
            return client.stats()

    def evict(token: str | None) -> dict[str, int]:
        with closing(daemon.admin(token)) as client:
            return client.evict(tier="cpu")

    for token in ("", "wrong-secret", "admin-secret-1x", "Bearer admin-secret-1"):
        with pytest.raises(PermissionDeniedError, match="not authenticated"):
            stats(token)
    assert stats("admin-secret-1").sessions == 0
    assert evict("admin-secret-1") == {"cpu": 0}
    assert stats("read-secret-2").sessions == 0
    with pytest.raises(PermissionDeniedError) as denied:
        evict("read-secret-2")
    assert "not authenticated" not in str(denied.value)

    with grpc.insecure_channel(daemon.admin_address) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)

        def as_(token: str | None) -> tuple[tuple[str, str], ...]:
            return (("authorization", f"Bearer {token}"),) if token else ()

        def call(token: str | None, method: str = "Evict") -> Callable[[], Any]:
            if method == "Verify":
                return lambda: list(stub.Verify(admin_pb2.VerifyRequest(), metadata=as_(token)))
            return lambda: stub.Evict(admin_pb2.EvictRequest(tier="cpu"), metadata=as_(token))

        unauthenticated = grpc.StatusCode.UNAUTHENTICATED
        assert _code(call(None)) is unauthenticated
        assert _code(call("nope")) is unauthenticated
        assert _code(call("read-secret-2")) is grpc.StatusCode.PERMISSION_DENIED
        assert _code(call(None, "Verify")) is unauthenticated
        assert _code(call("read-secret-2", "Verify")) is grpc.StatusCode.PERMISSION_DENIED
        assert list(stub.Verify(admin_pb2.VerifyRequest(), metadata=as_("admin-secret-1")))
        # probes and discovery stay open
        health = health_pb2_grpc.HealthStub(channel)
        response = health.Check(health_pb2.HealthCheckRequest(service=ADMIN_SERVICE), timeout=10)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_second_daemon_on_a_live_socket_or_arena_is_refused_and_leaves_the_first_serving(
    procs: Processes, files: DaemonFiles, tmp_path: Path, shm_path: Path
) -> None:
    daemon = procs.start_daemon(files)
    other_arena = shm_path.with_name(shm_path.name + "-b")
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    same_socket = write_config(
        tmp_path / "b", other_arena, {"server": {"socket_path": str(files.socket)}}
    )
    same_arena = write_config(tmp_path / "c", shm_path)
    try:
        rc, _, err = procs.run_daemon_to_exit(same_socket)
        assert rc == 2, err
        assert "server.socket_path" in err
        assert not other_arena.exists()
        rc, _, err = procs.run_daemon_to_exit(same_arena)
        assert rc == 2, err
        assert "arena.path" in err
        assert not same_arena.socket.exists()
    finally:
        other_arena.unlink(missing_ok=True)

    assert files.socket.exists()
    assert files.arena.exists()
    assert procs.client(files.socket, "dp0", "--store", "0:2")["stored"] == [0, 1]
    assert procs.client(files.socket, "dp1", "--load", "0:2")["loaded"] == [True, True]
    assert daemon.proc.poll() is None


# -- health, reflection, metrics --------------------------------------------------------------


def _health(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status)


def _reflect(
    channel: grpc.Channel, **request: str
) -> list[reflection_pb2.ServerReflectionResponse]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    asked = reflection_pb2.ServerReflectionRequest(**request)
    return list(stub.ServerReflectionInfo(iter([asked]), timeout=10))


def _listed(channel: grpc.Channel) -> set[str]:
    (response,) = _reflect(channel, list_services="")
    return {s.name for s in response.list_services_response.service}


def test_health_and_reflection_on_both_endpoints(procs: Processes, files: DaemonFiles) -> None:
    daemon = procs.start_daemon(files)
    serving = health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(f"unix:{files.socket}") as data:
        assert _health(data, "") == serving
        assert _health(data, TIER_SERVICE) == serving
        assert _code(lambda: _health(data, "kvtier.v1.NoSuchService")) is grpc.StatusCode.NOT_FOUND
        assert {TIER_SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE} <= _listed(data)
        (found,) = _reflect(data, file_containing_symbol=TIER_SERVICE)
        assert found.file_descriptor_response.file_descriptor_proto
    with grpc.insecure_channel(daemon.admin_address) as admin:
        assert _health(admin, "") == serving
        assert _health(admin, ADMIN_SERVICE) == serving
        assert {ADMIN_SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE} <= _listed(admin)
        (found,) = _reflect(admin, file_containing_symbol=ADMIN_SERVICE)
        assert found.file_descriptor_response.file_descriptor_proto


def test_each_endpoint_advertises_only_the_services_it_serves(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    with grpc.insecure_channel(f"unix:{files.socket}") as data:
        stub = admin_pb2_grpc.AdminServiceStub(data)
        assert _code(lambda: stub.Stats(admin_pb2.StatsRequest(), timeout=10)) is (
            grpc.StatusCode.UNIMPLEMENTED
        )
        assert ADMIN_SERVICE not in _listed(data)
        assert _code(lambda: _health(data, ADMIN_SERVICE)) is grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(daemon.admin_address) as admin:
        assert TIER_SERVICE not in _listed(admin)
        assert _code(lambda: _health(admin, TIER_SERVICE)) is grpc.StatusCode.NOT_FOUND


def test_metrics_follow_stored_bytes_and_sessions(procs: Processes, files: DaemonFiles) -> None:
    daemon = procs.start_daemon(files)
    samples = daemon.metrics()
    assert _metric(samples, "kvtier_sessions") == 0
    assert _metric(samples, "kvtier_tier_capacity_bytes", tier="lmdb") == 96 * MiB

    holder, held = procs.holding_client(
        files.socket, "dp0", "--store", "0:5", "--load", "0:2", "--reserve", "100:103"
    )
    assert held["stored"] == [0, 1, 2, 3, 4]
    samples = daemon.metrics()
    assert _metric(samples, "kvtier_tier_used_bytes", tier="cpu", pool="target") == 5 * CHUNK
    assert _metric(samples, "kvtier_tier_chunks", tier="cpu", pool="target") == 5
    assert (
        _metric(samples, "kvtier_replica_used_bytes", tier="cpu", replica="dp0", pool="target")
        == 5 * CHUNK
    )
    assert _metric(samples, "kvtier_sessions") == 1
    assert _metric(samples, "kvtier_leases") == 2
    assert _metric(samples, "kvtier_reservations") == 3
    stats = daemon.stats()
    assert (stats.sessions, stats.leases) == (1, 2)
    assert _tier(stats, "cpu").usage.used_bytes == 5 * CHUNK

    holder.send_signal(signal.SIGKILL)
    holder.wait(EXIT_TIMEOUT_S)

    def released() -> bool:
        now = daemon.metrics()
        return all(_metric(now, name) == 0 for name in ("kvtier_sessions", "kvtier_leases"))

    wait_for(released, SESSION_TIMEOUT_S + 3.0, "metrics show the session gone")
    samples = daemon.metrics()
    assert _metric(samples, "kvtier_reservations") == 0
    assert _metric(samples, "kvtier_tier_used_bytes", tier="cpu", pool="target") == 5 * CHUNK


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"KVTIER_LMDB__HIGH_WATER": "3"}, "lmdb.high_water"),
        ({"KVTIER_SERVER__MAX_BATCH_KEYS": "0"}, "server.max_batch_keys"),
        ({"KVTIER_SERVER__HEARTBEAT_INTERVAL_S": "5"}, "heartbeat_interval_s"),
        ({"KVTIER_ARENA__SIZE_BYTES": "lots"}, "arena.size_bytes"),
        ({"KVTIER_SERVER__SOKCET_PATH": "/tmp/x.sock"}, "server.sokcet_path"),
    ],
    ids=["high-water", "batch", "heartbeat", "size", "typo"],
)
def test_invalid_configuration_exits_non_zero_naming_the_key(
    procs: Processes, files: DaemonFiles, env: dict[str, str], names: str
) -> None:
    rc, out, err = procs.run_daemon_to_exit(files, env)
    assert rc == 2, err
    assert "invalid configuration" in err
    assert names in err
    assert "kvtierd ready" not in out
    assert not files.arena.exists()
    assert not files.socket.exists()
