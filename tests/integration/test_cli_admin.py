"""The admin commands of the `kvtier` CLI against a daemon serving in this process."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.core.config import from_mapping
from kvtier.core.errors import PermissionDeniedError
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.rpc import GrpcTierClient
from kvtier.server.daemon import Daemon
from kvtier.tiers.arena import ArenaMemory
from tests.support import draft_spec, keys_for, payload_for, target_spec

CHUNK = 256 << 10


@pytest.fixture
def daemon(shm_path: Path, tmp_path: Path) -> Iterator[Daemon]:
    cfg = from_mapping(
        {
            "arena": {"path": str(shm_path), "size_bytes": "32MiB", "extent_bytes": "2MiB"},
            "lmdb": {"path": str(tmp_path / "lmdb"), "budget_bytes": "64MiB"},
            "server": {
                "socket_path": str(tmp_path / "kvtierd.sock"),
                "admin_address": "127.0.0.1:0",
                "metrics_address": "",
            },
        }
    )
    d = Daemon(cfg)
    d.start()
    yield d
    d.stop()


@pytest.fixture
def stored(daemon: Daemon) -> Iterator[list[bytes]]:
    client = GrpcTierClient(daemon.config.server.socket_path, "dp0")
    ns = client.register_pool(target_spec(), CHUNK)
    keys = keys_for(ns, 8)
    arena = ArenaMemory.attach(client.arena_path)
    refs = [r for r in client.reserve(keys) if r is not None]
    for ref in refs:
        arena.view(ref.offset, ref.nbytes)[:] = payload_for(ref.key, CHUNK)
    assert client.commit(refs) == 8
    yield list(keys)
    arena.close()
    client.close()


def run(capsys: pytest.CaptureFixture[str], daemon: Daemon, *args: str) -> tuple[int, str, str]:
    rc = main([args[0], "--address", f"127.0.0.1:{daemon.admin_port}", *args[1:]])
    out, err = capsys.readouterr()
    return rc, out, err


def test_stats_table_and_json(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, stored: list[bytes]
) -> None:
    rc, out, _ = run(capsys, daemon, "stats")
    assert rc == 0
    assert "dp0" in out
    assert "sessions 1" in out
    rc, out, _ = run(capsys, daemon, "stats", "--json")
    doc = json.loads(out)
    cpu = next(t for t in doc["tiers"] if t["tier"] == "cpu")
    assert int(cpu["usage"]["chunks"]) == 8


def test_drain_verify_evict_warmup(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, stored: list[bytes]
) -> None:
    assert run(capsys, daemon, "drain")[0] == 0
    rc, out, err = run(capsys, daemon, "verify")
    assert rc == 0
    assert "verified 8 chunks, 0 corrupt" in out
    assert "8/8" in err  # the progress bar
    rc, out, _ = run(capsys, daemon, "evict", "--tier", "cpu", "--json")
    assert json.loads(out) == {"cpu": 8}
    rc, out, _ = run(capsys, daemon, "warmup")
    assert rc == 0
    assert "promoted 8 of 8 chunks" in out


def test_pin_and_quota(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, stored: list[bytes]
) -> None:
    assert run(capsys, daemon, "pin", stored[0].hex())[1].strip() == "pinned 1 keys"
    run(capsys, daemon, "evict")
    assert daemon.manager.lookup(stored[:1]).hits == 1
    quota = ("quota", "--replica", "dp0", "--pool", "target", "--bytes", "1MiB")
    assert run(capsys, daemon, *quota)[0] == 0
    assert daemon.manager.cpu.quota_bytes("dp0", "target") == 1 << 20
    rc, _, err = run(capsys, daemon, "quota", "--replica", "dp0", "--pool", "nope", "--bytes", "1")
    assert rc == 1
    assert "unknown pool" in err


DRAFT_CHUNK = 64 << 10


def test_draft_swap_needs_a_draft_pool(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    rc, _, err = run(capsys, daemon, "draft-swap", "--revision", "r2")
    assert rc == 1
    assert "no engine has registered a draft pool" in err


def test_draft_swap_switches_revision_keeps_target_and_stats_show_each_revision(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, stored: list[bytes]
) -> None:
    client = GrpcTierClient(daemon.config.server.socket_path, "dp0")
    try:
        draft = client.register_pool(draft_spec(), DRAFT_CHUNK)
        refs = [r for r in client.reserve(keys_for(draft, 3)) if r is not None]
        assert client.commit(refs) == 3
        (lineage,) = client.draft_states(refresh=True)
        assert client.draft_states()[lineage].revision == "d1"

        rc, out, _ = run(capsys, daemon, "draft-swap", "--revision", "d2", "--begin", "--json")
        assert rc == 0
        begun = json.loads(out)
        assert begun["previousRevision"] == "d1"
        assert client.draft_states(refresh=True)[lineage].swapping
        rc, out, _ = run(capsys, daemon, "draft-swap", "--commit", begun["swapId"])
        assert (rc, out.strip()) == (0, "draft revision is now d2")
        state = client.draft_states(refresh=True)[lineage]
        assert (state.revision, state.swapping) == ("d2", False)
        # the new revision's namespace is the one an engine computes for itself
        assert client.register_pool(draft_spec(draft_revision="d2"), DRAFT_CHUNK) != draft

        client.register_pool(target_spec(), CHUNK)  # a session looks up only its own pools
        assert client.lookup(stored).hits == len(stored)  # target chunks untouched
        rc, out, _ = run(capsys, daemon, "stats", "--json")
        revisions = {
            (d["revision"], d.get("current", False)): d["chunks"]
            for d in json.loads(out)["draftRevisions"]
        }
        assert revisions[("d1", False)]["cpu"] == "3"
        assert revisions[("d2", True)]["cpu"] == "0"
        rc, out, _ = run(capsys, daemon, "stats")
        assert "d2" in out
        assert "yes" in out
        rc, _, err = run(capsys, daemon, "draft-swap", "--commit", begun["swapId"])
        assert rc == 1
        assert "no draft swap" in err
    finally:
        client.close()


def test_no_daemon_says_how_to_start_one(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    rc = main(["stats", "--address", f"127.0.0.1:{port}"])
    _, err = capsys.readouterr()
    assert rc == 1
    assert f"daemon not running at 127.0.0.1:{port}: start it with `kvtier serve`" in err


def test_a_quarantine_reaches_every_session_until_an_admin_lifts_it(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, stored: list[bytes]
) -> None:
    socket_path = daemon.config.server.socket_path
    finder, other = GrpcTierClient(socket_path, "dp0"), GrpcTierClient(socket_path, "dp1")
    try:
        ns = finder.register_pool(target_spec(), CHUNK)
        assert other.register_pool(target_spec(), CHUNK) == ns
        keys = [ChunkKey(k) for k in stored]
        assert other.lookup(keys).hits == 8
        hit, refs = other.lookup(keys, lease=True)  # answered by the arena's key index
        assert hit.hits == 8
        other.release(refs)
        finder.quarantine_namespace(ns, "a target chunk differs from the recomputed KV by 1.41")
        assert other.lookup(keys).hits == 0  # no session finds its chunks
        other.draft_states(refresh=True)  # a heartbeat carries the list to every engine
        assert other.quarantined() == {ns}
        # nor does the arena's key index answer for it, read where it runs
        assert other.lookup(keys, lease=True)[0].hits == 0
        late = GrpcTierClient(socket_path, "dp3")
        try:
            late.register_pool(target_spec(), CHUNK)
            assert late.quarantined() == {ns}  # from its registration, before any heartbeat
            assert late.lookup(keys, lease=True)[0].hits == 0
        finally:
            late.close()
        rc, out, _ = run(capsys, daemon, "quarantine")
        assert rc == 0
        assert ns.hex() in out
        assert "by 1.41" in out
        assert "by replica dp0, engine " in out  # where it came from: the finder's session
        rc, out, _ = run(capsys, daemon, "quarantine", "--json")
        (listed,) = json.loads(out)["quarantined"]
        assert "1.41" in listed["reason"]
        assert listed["source"].startswith("replica dp0, engine ")
        assert run(capsys, daemon, "quarantine", "--lift", ns.hex())[0] == 0
        assert other.lookup(keys).hits == 8  # its chunks stayed: served again
        other.draft_states(refresh=True)
        assert other.quarantined() == frozenset()
        rc, out, _ = run(capsys, daemon, "quarantine", "--lift", ns.hex())
        assert (rc, out.strip()) == (1, "not quarantined")
    finally:
        finder.close()
        other.close()


def test_a_session_quarantines_only_its_own_pools(daemon: Daemon, stored: list[bytes]) -> None:
    stranger = GrpcTierClient(daemon.config.server.socket_path, "dp2")
    try:
        stranger.register_pool(draft_spec(), DRAFT_CHUNK)
        with pytest.raises(PermissionDeniedError):  # the client form of NamespaceAccessError
            stranger.quarantine_namespace(namespace_of(ChunkKey(stored[0])), "not mine")
        assert stranger.quarantined() == frozenset()
    finally:
        stranger.close()


def test_a_sampled_requests_lookups_count_as_verified_not_as_hits(
    daemon: Daemon, stored: list[bytes]
) -> None:
    from kvtier.observability.telemetry import telemetry_of
    from tests.integration.daemon_harness import wait_for

    def counts() -> tuple[int, int, int, int, int]:
        manager = daemon.manager.stats().counters
        seen = telemetry_of(daemon.manager).counts()
        return (
            manager["lookup_chunks"],
            manager["hit_chunks_cpu"],
            manager["verified_chunks"],
            seen["hit", "cpu", "target", "dp0"],
            seen["verified", "target", "dp0"],
        )

    client = GrpcTierClient(daemon.config.server.socket_path, "dp0")
    try:
        client.register_pool(target_spec(), CHUNK)
        keys = [ChunkKey(k) for k in stored]
        start = counts()

        def reported(asked: int) -> bool:
            client.report_hits()  # sent once the report before it was answered
            return counts()[0] == start[0] + asked

        # a call: kvtierd counts the 8 chunks asked for, and the 8 found as verified
        assert client.lookup(keys, verify=True).hits == 8
        assert [a - b for a, b in zip(counts(), start, strict=True)] == [8, 0, 8, 0, 8]
        # answered from the arena's key index, then reported: counted the same way
        hit, refs = client.lookup(keys, lease=True, verify=True)
        assert hit.hits == 8
        client.release([r for r in refs if r is not None])
        wait_for(lambda: reported(16), 10.0, "the verified hits reported")
        assert [a - b for a, b in zip(counts(), start, strict=True)] == [16, 0, 16, 0, 16]
        # a request that is served: hits, as before
        hit, refs = client.lookup(keys, lease=True)
        client.release([r for r in refs if r is not None])
        wait_for(lambda: reported(24), 10.0, "the served hits reported")
        assert [a - b for a, b in zip(counts(), start, strict=True)] == [24, 8, 16, 8, 16]
    finally:
        client.close()
