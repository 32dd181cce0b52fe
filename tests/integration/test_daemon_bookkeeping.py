"""kvtierd's bookkeeping against one client: refused registrations record nothing, sessions,
namespaces and slot classes are bounded, a reservation or lease whose call was lost is reclaimed,
and refs a failed call did not hand back are handed back later, once. Real daemons; a stall is a
real SIGSTOP."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls
from kvtier_vllm.kv.scheduler_side.unreturned import Handback, Unreturned

from kvtier.api.v1 import admin_pb2, tier_pb2, tier_pb2_grpc
from kvtier.core.codec import spec_to
from kvtier.core.errors import KVTierError
from kvtier.core.keys import NAMESPACE_BYTES, blank_key, namespace_of
from kvtier.rpc import GrpcTierClient
from kvtier.server.sessions import EXPIRED_COUNTER
from kvtier.tiers.arena import ArenaMemory
from tests.integration.daemon_harness import (
    CHUNK,
    DaemonFiles,
    Processes,
    RunningDaemon,
    expected,
    key_of,
    ticket,
    wait_for,
    write_config,
)
from tests.support import layout, target_spec

STALL_S = 0.5
# a stalled test's daemon: its session outlives the stall (call timeout, then STALL_S) by far,
# and a call that is not stalled has room on a loaded machine
STALLED_SESSION_S = 30.0
STALLED_CALL_S = 1.0


def _cpu(stats: admin_pb2.StatsResponse) -> admin_pb2.TierStats:
    (tier,) = [t for t in stats.tiers if t.tier == "cpu"]
    return tier


def _reservations(daemon: RunningDaemon) -> float:
    (value,) = [v for n, _, v in daemon.metrics() if n == "kvtier_reservations"]
    return value


def _pool(model: str = "", layers: int = 2) -> tier_pb2.PoolRegistration:
    """A target pool of ``layers`` layers: CHUNK bytes a chunk for every two."""
    spec = target_spec(model=model or "tiny-llama", layout=layout(layers))
    return tier_pb2.PoolRegistration(spec=spec_to(spec), chunk_bytes=CHUNK * layers // 2)


def _register(
    stub: tier_pb2_grpc.TierServiceStub,
    pool: tier_pb2.PoolRegistration,
    session_id: str = "",
    files: DaemonFiles | None = None,
) -> str:
    """Open a session (``files`` name the daemon, for a peer ticket) or add to one."""
    request = tier_pb2.RegisterSessionRequest(replica_id="r", pools=[pool], session_id=session_id)
    metadata = ticket(files.socket) if files is not None else ()
    return str(stub.RegisterSession(request, timeout=10, metadata=metadata).session_id)


def _refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


@contextmanager
def _stalled(daemon: RunningDaemon) -> Iterator[None]:
    """The daemon stopped (SIGSTOP), as a machine too busy to schedule it would."""
    daemon.stop()
    try:
        yield
    finally:
        time.sleep(STALL_S)
        daemon.resume()


def _client(files: DaemonFiles, timeout_s: float = 10.0) -> GrpcTierClient:
    client = GrpcTierClient(files.socket, "dp0", timeout_s=timeout_s, tune_memory=False)
    client.register_pool(target_spec(), CHUNK)
    return client


def _stallable(tmp_path: Path, shm_path: Path) -> DaemonFiles:
    return write_config(tmp_path, shm_path, {"server": {"session_timeout_s": STALLED_SESSION_S}})


def test_a_refused_registration_records_nothing_and_leaves_no_session(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)
        huge = _pool("m", layers=32)  # 4 MiB chunks, past the arena's 2 MiB extents
        refused = _refused(lambda: _register(stub, huge, files=files))
        assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "extent_bytes" in (refused.details() or "")
        assert daemon.stats().sessions == 0, "the refused registration kept a session"
        # a pool the arena takes: registered as if the refused one never was
        sid = _register(stub, _pool("m"), files=files)
        again = _refused(lambda: _register(stub, huge, sid))
        assert again.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "extent_bytes" in (again.details() or "")
        assert _register(stub, _pool("m"), sid) == sid
        assert daemon.stats().sessions == 1


def test_sessions_namespaces_and_slot_classes_are_bounded(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    files = write_config(
        tmp_path,
        shm_path,
        {
            "server": {"max_sessions": 2, "max_namespaces": 3, "max_session_leases": 1},
            "arena": {"max_slot_classes": 2},
        },
    )
    daemon = procs.start_daemon(files)
    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)
        first = _register(stub, _pool(), files=files)
        _register(stub, _pool(), files=files)
        refused = _refused(lambda: _register(stub, _pool(), files=files))
        assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.max_sessions" in (refused.details() or "")

        _register(stub, _pool("half", layers=4), first)  # a second slot class
        refused = _refused(lambda: _register(stub, _pool("quarter", layers=8), first))
        assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "arena.max_slot_classes" in (refused.details() or "")
        _register(stub, _pool("quarter"), first)  # refused above: nothing of it was recorded

        refused = _refused(lambda: _register(stub, _pool("fourth"), first))
        assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.max_namespaces" in (refused.details() or "")
        stats = daemon.stats()
        assert stats.sessions == 2
        keys = tier_pb2.KeyBatch(key_bytes=len(key_of(0)), packed=key_of(0))
        (grant,) = stub.Reserve(tier_pb2.ReserveRequest(session_id=first, keys=keys)).grants
        assert grant.granted, "the daemon stopped serving past its bounds"
        commit = tier_pb2.CommitRequest(session_id=first, refs=[grant.ref])
        assert stub.Commit(commit).committed == 1
        prefetch = tier_pb2.PrefetchRequest(session_id=first, keys=keys)
        (lease,) = stub.Prefetch(prefetch).leases
        assert lease.granted
        refused = _refused(lambda: stub.Prefetch(prefetch))
        assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.max_session_leases" in (refused.details() or "")
        assert daemon.stats().leases == 1


def test_a_call_in_a_reaped_session_is_told_it_expired(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)
        sid = _register(stub, _pool(), files=files)
        wait_for(lambda: daemon.stats().sessions == 0, 5.0, "the silent session reaped")
        keys = tier_pb2.KeyBatch(key_bytes=len(key_of(0)), packed=key_of(0))
        late = _refused(lambda: stub.Reserve(tier_pb2.ReserveRequest(session_id=sid, keys=keys)))
        assert late.code() is grpc.StatusCode.NOT_FOUND
        assert "heartbeat lapsed" in (late.details() or "")
        assert _reservations(daemon) == 0


def test_a_reservation_whose_commit_never_came_is_aborted_and_its_key_stored_again(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    files = write_config(tmp_path, shm_path, {"server": {"reservation_timeout_s": 1.0}})
    daemon = procs.start_daemon(files)
    with closing(_client(files)) as client:
        (ref,) = client.reserve([key_of(0)])
        assert ref is not None
        assert client.reserve([key_of(0)]) == [None]  # in flight: not storable
        wait_for(lambda: _reservations(daemon) == 0, 5.0, "the stuck reservation aborted")
        stats = daemon.stats()
        assert stats.sessions == 1, "the session itself was alive all along"
        assert _cpu(stats).counters[EXPIRED_COUNTER] == 1
        assert client.commit([ref]) == 0  # too late: the slot is no longer its reservation
        (again,) = client.reserve([key_of(0)])
        assert again is not None, "the key stayed unstorable"


def test_a_release_whose_answer_was_lost_is_sent_again_and_ends_only_its_lease(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    files = _stallable(tmp_path, shm_path)
    daemon = procs.start_daemon(files)
    with closing(_client(files, timeout_s=STALLED_CALL_S)) as client:
        with closing(ArenaMemory.attach(daemon.arena)) as arena:
            (ref,) = client.reserve([key_of(0)])
            assert ref is not None
            arena.view(ref.offset, ref.nbytes)[:] = expected(key_of(0))
            assert client.commit([ref]) == 1
        lost, other = (client.lease([key_of(0)])[0] for _ in range(2))  # two requests share it
        assert lost is not None
        assert other is not None
        assert daemon.stats().leases == 2
        unreturned = Unreturned(every_s=0.0)
        with _stalled(daemon):
            with pytest.raises(KVTierError):
                client.release([lost])
            unreturned.keep(Handback.RELEASE, [lost])
        # kvtierd may or may not have run the release the client gave up on; sent again, it
        # ends that lease once either way
        wait_for(lambda: unreturned.retry(client) == 1 or not len(unreturned), 20.0, "retried")
        assert len(unreturned) == 0
        stats = daemon.stats()
        assert (stats.sessions, stats.leases) == (1, 1), "the retry ended the other lease"
        client.release([lost])  # once more, as if the retry's own answer had been lost
        assert daemon.stats().leases == 1, "a repeated release ended the other lease"
        with closing(daemon.admin()) as admin:
            assert admin.evict(tier="cpu") == {"cpu": 0}  # `other` still holds it
            client.release([other])
            assert daemon.stats().leases == 0
            assert admin.evict(tier="cpu") == {"cpu": 1}


def test_a_commit_lost_to_a_stalled_daemon_is_sent_again_and_the_chunk_stored(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    files = _stallable(tmp_path, shm_path)
    daemon = procs.start_daemon(files)
    arena = ArenaMemory.attach(daemon.arena)
    with closing(_client(files, timeout_s=STALLED_CALL_S)) as client:
        (ref,) = client.reserve([key_of(0)])
        assert ref is not None
        arena.view(ref.offset, ref.nbytes)[:] = expected(key_of(0))
        unreturned = Unreturned(every_s=0.0)
        with _stalled(daemon):
            with pytest.raises(KVTierError):
                client.commit([ref])
            unreturned.keep(Handback.COMMIT, [ref])
        wait_for(lambda: unreturned.retry(client) == 1 or not len(unreturned), 20.0, "retried")
        assert len(unreturned) == 0
        assert client.lookup([key_of(0)]).hits == 1
        assert _reservations(daemon) == 0
        assert daemon.stats().sessions == 1
    arena.close()
    assert procs.check(files.socket, 1)["present"] == [0]


def test_hand_backs_go_without_waiting_and_what_a_stalled_daemon_failed_goes_back_later(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    files = _stallable(tmp_path, shm_path)
    daemon = procs.start_daemon(files)
    with closing(_client(files, timeout_s=STALLED_CALL_S)) as client:
        refs = client.reserve([key_of(0), key_of(1)])
        with closing(ArenaMemory.attach(daemon.arena)) as arena:
            for index, ref in enumerate(refs):
                assert ref is not None
                arena.view(ref.offset, ref.nbytes)[:] = expected(key_of(index))
        first, second = (r for r in refs if r is not None)
        calls = TierCalls(client, Unreturned(every_s=0.0))
        with _stalled(daemon):
            calls.settle_behind([first])
            # a stopped daemon answers nothing: the caller went on without the answer
            assert calls.in_flight == 1
            calls.settle(10 * STALLED_CALL_S)  # past the call's deadline: it failed
            assert calls.in_flight == 0
            assert len(calls.unreturned) == 1, "the failed commit's reservation was not kept"
        calls.settle_behind([second])
        calls.settle(10.0)
        assert calls.in_flight == 0
        assert client.lookup([key_of(1)]).hits == 1
        wait_for(lambda: calls.hand_back() or not len(calls.unreturned), 20.0, "handed back")
        assert client.lookup([key_of(0)]).hits == 1
        assert _reservations(daemon) == 0


def test_slots_reserved_blank_take_the_chunks_their_stores_name_and_go_back_with_the_session(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    files = write_config(tmp_path, shm_path, {})
    daemon = procs.start_daemon(files)
    arena = ArenaMemory.attach(daemon.arena)
    key, other = key_of(0), key_of(1)
    blanks = [blank_key(namespace_of(key), i, len(key) - NAMESPACE_BYTES) for i in range(5)]
    with closing(_client(files)) as client:
        answer = client.reserve_behind(blanks[:3])
        assert answer.wait(10.0)
        first, second, third = (ref for ref in answer.result() if ref is not None)
        assert _reservations(daemon) == 3
        arena.view(first.offset, first.nbytes)[:] = expected(key)
        assert client.commit([replace(first, key=key)]) == 1
        assert client.lookup([key, other]).hits == 1
        assert client.commit([replace(second, key=key)]) == 0, "stored already: freed"
        client.abort([replace(third, key=other)])  # its store never ran
        assert _reservations(daemon) == 0
        held = client.reserve_behind(blanks[3:])
        assert held.wait(10.0)
        assert all(held.result())
        assert _reservations(daemon) == 2
    # a client gone with slots held: they go back with its session
    wait_for(lambda: _reservations(daemon) == 0, 10.0, "the held slots given back")
    arena.close()
    assert procs.check(files.socket, 1)["present"] == [0]


def test_a_session_mark_holds_while_kvtierd_answers_and_a_restarted_one_gives_another(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    files = write_config(tmp_path, shm_path, {})
    daemon = procs.start_daemon(files)
    with closing(_client(files)) as client:
        first = client.session_mark()
        assert first is not None
        assert first[0] == client.session_id
        daemon.stop()  # no heartbeat is answered: the session may end unheard
        wait_for(lambda: client.session_mark() is None, 10.0, "the mark given up")
        daemon.signal_and_wait(signal.SIGKILL, 10.0)
        procs.start_daemon(files)  # another session, in another arena under the same path
        wait_for(lambda: client.session_mark() is not None, 20.0, "the client's new session")
        second = client.session_mark()
        assert second is not None
        assert second[0] != first[0]
        assert second[1] != first[1], "the same arena file"
