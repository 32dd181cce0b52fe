"""Tenants on kvtierd's data plane, against a daemon process: a client registers only the
tenants its uid or groups are given (as the kernel reports them, not as it says), a session names
only keys and slots of the pools it registered, and registration refuses a chunk size other than
its layout's and strings that could break an object-store name."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvtier.api.v1 import admin_pb2, admin_pb2_grpc, tier_pb2, tier_pb2_grpc
from kvtier.core.chunk_size import chunk_payload_bytes
from kvtier.core.codec import spec_to
from kvtier.core.errors import PermissionDeniedError
from kvtier.core.keys import NamespaceSpec
from kvtier.rpc import GrpcTierClient
from tests.integration.daemon_harness import (
    CHUNK,
    DaemonFiles,
    Processes,
    RunningDaemon,
    key_of,
    namespace,
    ticket,
    write_config,
)
from tests.support import draft_spec, keys_for, target_spec

DENIED = grpc.StatusCode.PERMISSION_DENIED
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOBODY = 65534  # nobody, and nogroup
ROOT_ONLY = {"uids": [os.geteuid()]}


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may pass through, for a socket a dropped-root client reaches
    (asked for before `procs`, so it goes after the daemon in it)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _tenants(tmp_path: Path, shm_path: Path, **tenants: dict[str, list[int]]) -> DaemonFiles:
    return write_config(tmp_path, shm_path, {"server": {"tenants": tenants}})


def _failure(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


def _pool(spec: NamespaceSpec, **raw: Any) -> tier_pb2.PoolRegistration:
    """``spec`` on the wire, with fields set past what NamespaceSpec itself would allow."""
    pb = spec_to(spec)
    for name, value in raw.items():
        if name == "layer_name":
            pb.layout.layer_names[0] = value
        else:
            setattr(pb, name, value)
    return tier_pb2.PoolRegistration(spec=pb, chunk_bytes=chunk_payload_bytes(spec))


def _register(
    stub: tier_pb2_grpc.TierServiceStub,
    *pools: tier_pb2.PoolRegistration,
    session: str = "",
    files: DaemonFiles | None = None,
) -> tier_pb2.RegisterSessionResponse:
    """Open a session (with a peer ticket from the daemon of ``files``), or add to one."""
    request = tier_pb2.RegisterSessionRequest(replica_id="t", pools=pools, session_id=session)
    metadata = ticket(files.socket) if files is not None else ()
    return stub.RegisterSession(request, timeout=10, metadata=metadata)


def _keys(keys: Sequence[bytes]) -> tier_pb2.KeyBatch:
    return tier_pb2.KeyBatch(key_bytes=len(keys[0]) if keys else 0, packed=b"".join(keys))


def _reserve(stub: tier_pb2_grpc.TierServiceStub, sid: str, keys: Sequence[bytes]) -> list[Any]:
    request = tier_pb2.ReserveRequest(session_id=sid, keys=_keys(keys))
    return [g.ref if g.granted else None for g in stub.Reserve(request, timeout=10).grants]


def _lease(stub: tier_pb2_grpc.TierServiceStub, sid: str, keys: Sequence[bytes]) -> list[Any]:
    request = tier_pb2.PrefetchRequest(session_id=sid, keys=_keys(keys))
    return [g.ref if g.granted else None for g in stub.Prefetch(request, timeout=10).leases]


def _hits(stub: tier_pb2_grpc.TierServiceStub, sid: str, keys: Sequence[bytes]) -> int:
    request = tier_pb2.LookupRequest(session_id=sid, keys=_keys(keys))
    return int(stub.Lookup(request, timeout=10).hits)


def _leases(daemon: RunningDaemon) -> int:
    return int(daemon.stats().leases)


def test_a_session_names_only_keys_and_slots_of_its_own_pools(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    files = _tenants(tmp_path, shm_path, default=ROOT_ONLY, intruder=ROOT_ONLY)
    daemon = procs.start_daemon(files)
    # another process stores the owner's chunks 0..3 and leaves
    assert procs.client(files.socket, "writer", "--store", "0:4")["stored"] == [0, 1, 2, 3]
    theirs = [key_of(i) for i in range(4)]
    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)
        owner = _register(stub, _pool(target_spec()), files=files).session_id
        mine_reg = _register(stub, _pool(target_spec(tenant="intruder")), files=files)
        intruder = mine_reg.session_id
        (own_ns,) = mine_reg.namespaces
        mine = keys_for(own_ns, 2)

        (reservation,) = _reserve(stub, owner, [key_of(10)])
        (lease,) = _lease(stub, owner, [key_of(0)])
        assert reservation is not None
        assert lease is not None
        assert _leases(daemon) == 1

        def lookup(keys: Sequence[bytes], lease: bool = False, release: Any = ()) -> Any:
            request = tier_pb2.LookupRequest(
                session_id=intruder, keys=_keys(keys), lease=lease, release=release
            )
            return lambda: stub.Lookup(request, timeout=10)

        def reserve(keys: Sequence[bytes], commit: Any = ()) -> Any:
            request = tier_pb2.ReserveRequest(session_id=intruder, keys=_keys(keys), commit=commit)
            return lambda: stub.Reserve(request, timeout=10)

        def prefetch(keys: Sequence[bytes], release: Any = ()) -> Any:
            request = tier_pb2.PrefetchRequest(
                session_id=intruder, keys=_keys(keys), release=release
            )
            return lambda: stub.Prefetch(request, timeout=10)

        refs = {"refs": [reservation]}
        cases: dict[str, Callable[[], Any]] = {
            "lookup": lookup(theirs),
            "leasing lookup": lookup(theirs, lease=True),
            "lookup releasing their lease": lookup(mine, release=[lease]),
            "reserve": reserve(theirs),
            "reserve, one of their keys among mine": reserve([mine[0], key_of(20), mine[1]]),
            "reserve committing their reservation": reserve(mine, commit=[reservation]),
            "commit": lambda: stub.Commit(tier_pb2.CommitRequest(session_id=intruder, **refs)),
            "abort": lambda: stub.Abort(tier_pb2.AbortRequest(session_id=intruder, **refs)),
            "prefetch": prefetch(theirs),
            "prefetch releasing their lease": prefetch(mine, release=[lease]),
            "release": lambda: stub.Release(
                tier_pb2.ReleaseRequest(session_id=intruder, refs=[lease])
            ),
            "promote": lambda: stub.Promote(
                tier_pb2.PromoteRequest(session_id=intruder, keys=_keys(theirs))
            ),
        }
        failures = {name: _failure(call) for name, call in cases.items()}
        assert {name: code for name, (code, _) in failures.items()} == dict.fromkeys(cases, DENIED)
        for name, (_, details) in failures.items():
            assert namespace().hex() in details, name
            assert "this session's pools" in details, name

        # the refused calls changed nothing: the mixed reserve took none of the intruder's keys,
        # the owner's lease and reservation stand, and nothing the intruder named was stored
        assert _leases(daemon) == 1
        assert all(_reserve(stub, intruder, mine))
        assert _hits(stub, owner, [key_of(10)]) == 0
        commit = tier_pb2.CommitRequest(session_id=owner, refs=[reservation])
        assert stub.Commit(commit, timeout=10).committed == 1
        stub.Release(tier_pb2.ReleaseRequest(session_id=owner, refs=[lease]), timeout=10)
        assert _leases(daemon) == 0

        # the owner's session does everything the intruder's could not
        assert _hits(stub, owner, theirs) == 4
        assert all(_lease(stub, owner, theirs))
        stub.Promote(tier_pb2.PromoteRequest(session_id=owner, keys=_keys(theirs)), timeout=10)
        assert _reserve(stub, owner, [key_of(11)]) != [None]

        # a namespace no session registered is still "register the pool first"
        nobody = keys_for(target_spec(model="never-registered").digest(), 1)
        code, _ = _failure(lookup(nobody))
        assert code is grpc.StatusCode.FAILED_PRECONDITION

        # registering the owner's pool in the intruder's session, later, opens it
        assert list(_register(stub, _pool(target_spec()), session=intruder).namespaces) == [
            namespace()
        ]
        assert _hits(stub, intruder, theirs) == 4
    assert "Traceback" not in daemon.log_text()


def test_a_draft_revision_registered_later_belongs_to_its_session_only(
    procs: Processes, files: DaemonFiles
) -> None:
    procs.start_daemon(files)
    a = GrpcTierClient(files.socket, "dp0", timeout_s=10.0)
    b = GrpcTierClient(files.socket, "dp1", timeout_s=10.0)
    try:
        chunk = chunk_payload_bytes(draft_spec())
        d1 = a.register_pool(draft_spec(), chunk)
        assert b.register_pool(draft_spec(), chunk) == d1
        d2 = a.register_pool(draft_spec(draft_revision="d2"), chunk)
        assert d2 != d1
        d1_keys, d2_keys = keys_for(d1, 2), keys_for(d2, 2)

        refs = a.reserve(d2_keys)
        assert all(refs)
        assert a.commit([r for r in refs if r is not None]) == 2
        assert a.lookup(d2_keys).hits == 2
        assert all(a.lease(d2_keys))

        with pytest.raises(PermissionDeniedError, match=d2.hex()):
            b.lookup(d2_keys)
        with pytest.raises(PermissionDeniedError, match=d2.hex()):
            b.lease(d2_keys)
        with pytest.raises(PermissionDeniedError, match=d2.hex()):
            b.reserve(keys_for(d2, 1, start=5))
        assert all(b.reserve(d1_keys))  # its own revision still works
        assert b.lookup(d1_keys).hits == 0
    finally:
        a.close()
        b.close()


BAD_STRINGS: list[tuple[str, dict[str, str]]] = [
    ("tenant", {"tenant": "../x"}),
    ("tenant", {"tenant": "a/b"}),
    ("tenant", {"tenant": "t" * 200}),
    ("tenant", {"tenant": "\x00"}),
    ("tenant", {"tenant": ".."}),
    ("model", {"model": "m\x00"}),
    ("model", {"model": "m\nn"}),
    ("model", {"model": "m" * 513}),
    ("model_revision", {"model_revision": "r 1"}),
    ("model_revision", {"model_revision": "r" * 129}),
    ("layout.layer_names[0]", {"layer_name": "layer\x00"}),
]


def test_registering_a_string_that_could_break_an_object_name_is_invalid_argument(
    procs: Processes, files: DaemonFiles
) -> None:
    daemon = procs.start_daemon(files)
    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)
        got = {}
        for field, raw in BAD_STRINGS:
            code, details = _failure(partial(_register, stub, _pool(target_spec(), **raw)))
            got[repr(raw)] = (code, field if f"{field} must be" in details else details)
        assert got == {repr(raw): (INVALID, field) for field, raw in BAD_STRINGS}
        assert daemon.stats().sessions == 0, "a refused registration opened a session"
        # a bad pool added to a live session is refused; the session still serves its own
        sid = _register(stub, _pool(target_spec()), files=files).session_id
        code, _ = _failure(lambda: _register(stub, _pool(target_spec(), tenant="a/b"), session=sid))
        assert code is INVALID
        assert _hits(stub, sid, [key_of(0)]) == 0
    assert "Traceback" not in daemon.log_text()


def test_draft_strings_and_an_admin_draft_swap_are_checked_too(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    daemon = procs.start_daemon(_tenants(tmp_path, shm_path, **{"team.a-1": ROOT_ONLY}))
    files = daemon.files
    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)
        for field, raw in [
            ("draft_model", {"draft_model": "d\x00"}),
            ("draft_revision", {"draft_revision": "d 1"}),
            ("tenant", {"tenant": "a/b"}),
        ]:
            code, details = _failure(partial(_register, stub, _pool(draft_spec(), **raw)))
            assert (code, f"{field} must be" in details) == (INVALID, True), details
        assert daemon.stats().sessions == 0, "a refused registration opened a session"

        sid = _register(stub, _pool(draft_spec(tenant="team.a-1")), files=files).session_id
        with daemon.admin_channel() as admin_channel:
            admin = admin_pb2_grpc.AdminServiceStub(admin_channel)
            bad = admin_pb2.DraftSwapBeginRequest(revision="d2\n")
            code, details = _failure(lambda: admin.DraftSwapBegin(bad, timeout=10))
            assert code is INVALID
            assert "revision must be" in details
            (state,) = stub.Heartbeat(tier_pb2.HeartbeatRequest(session_id=sid)).drafts
            assert not state.swapping, "a refused swap began"

            began = admin.DraftSwapBegin(admin_pb2.DraftSwapBeginRequest(revision="d2"))
            assert began.previous_revision == "d1"
            commit = admin_pb2.DraftSwapCommitRequest(swap_id=began.swap_id)
            assert admin.DraftSwapCommit(commit, timeout=10).revision == "d2"
            assert admin.Stats(admin_pb2.StatsRequest(), timeout=10).sessions == 1
    with closing(daemon.admin()) as client:
        assert client.stats().sessions == 1
    assert "Traceback" not in daemon.log_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="a client drops root for another uid")
def test_a_client_gets_the_tenants_of_its_uid_whatever_its_pools_name(
    open_dir: Path, procs: Processes, shm_path: Path
) -> None:
    """A client that dropped root for nobody reaches the socket through its group, and the
    kernel, not the client, says who it is: the default tenant's pools stay root's."""
    files = write_config(
        open_dir,
        shm_path,
        {
            "server": {
                "group": NOBODY,  # the socket's and the arena's: nobody may call and map
                "tenants": {"default": ROOT_ONLY, "guest": {"uids": [NOBODY]}},
            }
        },
    )
    daemon = procs.start_daemon(files)
    assert procs.client(files.socket, "root", "--store", "0:4")["stored"] == [0, 1, 2, 3]

    theirs = procs.client(files.socket, "nobody", "--uid", str(NOBODY), "--lookup", "0:4")
    assert "refused" in theirs, f"nobody registered the default tenant's pool: {theirs}"
    assert "tenant 'default' is not open to this client (uid 65534" in theirs["refused"]

    own = ["--tenant", "guest", "--store", "0:2", "--lookup", "0:2", "--load", "0:2"]
    mine = procs.client(files.socket, "nobody", "--uid", str(NOBODY), *own)
    assert (mine["stored"], mine["hits"], mine["loaded"]) == ([0, 1], 2, [True, True])

    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)
        guests = _pool(target_spec(tenant="guest"))
        code, details = _failure(lambda: _register(stub, guests, files=files))  # root, here
        assert code is DENIED
        assert "tenant 'guest' is not open to this client (uid 0" in details
        # a session is opened only with a ticket, and a ticket opens one
        code, details = _failure(lambda: _register(stub, _pool(target_spec())))
        assert (code, "no peer ticket" in details) == (DENIED, True)
        request = tier_pb2.RegisterSessionRequest(replica_id="t", pools=[_pool(target_spec())])
        spent = ticket(files.socket)
        stub.RegisterSession(request, timeout=10, metadata=spent)
        code, details = _failure(lambda: stub.RegisterSession(request, timeout=10, metadata=spent))
        assert (code, "unknown, spent or expired" in details) == (DENIED, True)
    assert "Traceback" not in daemon.log_text()


def test_a_chunk_size_other_than_the_layouts_is_refused_and_claims_nothing(
    procs: Processes, files: DaemonFiles
) -> None:
    """Registered first with a wrong size, a namespace would refuse its real engines (their
    size differs from the first one's) until kvtierd restarts."""
    daemon = procs.start_daemon(files)
    wrong = tier_pb2.PoolRegistration(spec=spec_to(target_spec()), chunk_bytes=2 * CHUNK)
    with grpc.insecure_channel(f"unix:{files.socket}") as channel:
        stub = tier_pb2_grpc.TierServiceStub(channel)
        code, details = _failure(lambda: _register(stub, wrong))  # refused before any ticket
        assert code is INVALID
        assert f"chunk_bytes is {2 * CHUNK}, but the layout makes a chunk {CHUNK} bytes" in details
        sid = _register(stub, _pool(target_spec(model="other")), files=files).session_id
        code, _ = _failure(lambda: _register(stub, wrong, session=sid))
        assert code is INVALID
    assert daemon.stats().sessions == 1, "the refused registration opened a session"
    # an engine registering the pool rightly, in a process of its own, stores and loads
    stored = procs.client(files.socket, "dp0", "--store", "0:2", "--load", "0:2")
    assert (stored["stored"], stored["loaded"]) == ([0, 1], [True, True])
    assert "Traceback" not in daemon.log_text()
