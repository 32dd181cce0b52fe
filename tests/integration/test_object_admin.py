"""`kvtier warmup --object-index/--fetch` and `kvtier gc` against real daemons sharing a file://
bucket: one node uploads, another rebuilds its index from a listing; gc by object age."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvtier.api.v1 import admin_pb2, admin_pb2_grpc
from kvtier.core import blockfmt
from kvtier.tiers.objstore.tier import ObjectTier
from tests.integration.daemon_harness import (
    CHUNK,
    ROOT,
    Processes,
    RunningDaemon,
    clean_env,
    expected,
    key_of,
    namespace,
    write_config,
)
from tests.support import MiB, new_arena_path, target_spec

N = 12
RETENTION_S = 86400.0
OLD = time.time() - 2 * RETENTION_S


class Fleet:
    """Daemons on one node each, sharing ``bucket``."""

    def __init__(self, procs: Processes, root: Path) -> None:
        self.procs = procs
        self.root = root
        self.bucket = root / "bucket"
        self.arenas: list[Path] = []

    def start(
        self, name: str, object_tier: bool = True, server: dict[str, Any] | None = None
    ) -> RunningDaemon:
        directory = self.root / name
        directory.mkdir()
        arena = new_arena_path()
        self.arenas.append(arena)
        overrides: dict[str, Any] = {"server": server or {}}
        if object_tier:
            overrides["object"] = {
                "url": f"file://{self.bucket}",
                "index_path": str(directory / "objindex"),
                "index_map_bytes": 64 * MiB,
                "pack_target_bytes": 4 * CHUNK,  # several chunks per object
                "pack_linger_ms": 20,
                "retries": 1,
                "backoff_s": 0.01,
                "retention_s": RETENTION_S,
            }
        return self.procs.start_daemon(write_config(directory, arena, overrides))

    def close(self) -> None:
        self.procs.close()
        for arena in self.arenas:
            arena.unlink(missing_ok=True)


@pytest.fixture
def fleet(procs: Processes, tmp_path: Path) -> Iterator[Fleet]:
    group = Fleet(procs, tmp_path)
    yield group
    group.close()


def object_usage(node: RunningDaemon) -> int:
    tiers = {t.tier: t for t in node.stats().tiers}
    return int(tiers["object"].usage.chunks) if "object" in tiers else -1


def tier_chunks(node: RunningDaemon, tier: str) -> int:
    return int(next(t for t in node.stats().tiers if t.tier == tier).usage.chunks)


def upload(fleet: Fleet, node: RunningDaemon, n: int = N) -> None:
    out = fleet.procs.client(node.files.socket, "dp0", "--store", f"0:{n}")
    assert out["stored"] == list(range(n))
    client = node.admin()
    try:
        assert client.drain(20.0).complete
    finally:
        client.close()
    deadline = time.monotonic() + 20.0
    while object_usage(node) < n:
        assert time.monotonic() < deadline, f"uploads not done:\n{node.log_text()}"
        time.sleep(0.05)


def objects(bucket: Path) -> dict[Path, int]:
    """Every object kvtier uploaded (the file:// store keeps metadata beside each), with the
    chunks it holds."""
    out = {}
    for meta in bucket.rglob("*.meta"):
        path = meta.with_name(meta.name.removesuffix(".meta"))
        if path.exists():
            out[path] = int(json.loads(meta.read_text())["kvtier-chunks"])
    return out


def cli(node: RunningDaemon, *args: str, token_file: Path | None = None) -> tuple[int, str, str]:
    argv = [sys.executable, "-m", "kvtier.cli", args[0], "--address", node.admin_address]
    if token_file is not None:
        argv += ["--token-file", str(token_file)]
    proc = subprocess.run(
        [*argv, *args[1:]], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    return proc.returncode, proc.stdout, proc.stderr


def cli_json(node: RunningDaemon, *args: str) -> dict[str, Any]:
    rc, out, err = cli(node, *args, "--json")
    assert rc == 0, err
    doc: dict[str, Any] = json.loads(out)
    return {k: int(v) if isinstance(v, str) and v.isdigit() else v for k, v in doc.items()}


def plant_corrupt_object(bucket: Path) -> Path:
    """An object named like kvtier's whose size is not a whole number of chunks."""
    key = key_of(1000)
    body = blockfmt.encode(key, blockfmt.ChunkDescriptor.from_spec(target_spec()), expected(key))
    digest = key[len(namespace()) :].hex()
    path = bucket / "default" / namespace().hex() / digest[:2] / digest
    assert ObjectTier.key_of(str(path.relative_to(bucket))) == key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body + b"torn")
    return path


def test_object_index_is_rebuilt_from_the_bucket(fleet: Fleet) -> None:
    a = fleet.start("a")
    upload(fleet, a)
    uploaded = objects(fleet.bucket)
    assert sum(uploaded.values()) == N
    assert max(uploaded.values()) > 1  # packed objects: headers past the first are read too
    corrupt = plant_corrupt_object(fleet.bucket)
    foreign = fleet.bucket / "notes.txt"
    foreign.write_text("not kvtier's")

    b = fleet.start("b")
    assert object_usage(b) == 0
    rc, out, err = cli(b, "warmup", "--object-index")
    assert rc == 0, err
    assert f"indexed {N} chunks in {len(uploaded)} objects" in out
    assert "1 corrupt objects (quarantined)" in out
    assert re.search(r"^index objects .* \d+/\d+ ", err, re.M), err  # the progress bar
    assert object_usage(b) == 0  # a's objects: indexed, but not b's own usage
    assert not corrupt.exists()
    assert foreign.exists()
    assert set(objects(fleet.bucket)) == set(uploaded)

    # the index alone answers: code 3 (object) for every chunk, nothing downloaded
    found = fleet.procs.client(b.files.socket, "dp1", "--lookup", f"0:{N}")
    assert found["hits"] == N
    assert found["tiers"] == ["object"] * N
    assert tier_chunks(b, "lmdb") == 0

    # indexed objects are skipped by a second run
    again = cli_json(b, "warmup", "--object-index")
    assert again["objectsIndexed"] == 0
    assert again["objectsTotal"] == 0
    assert again["objectsListed"] == len(uploaded) + 1


def test_fetch_downloads_a_namespace_into_lmdb_and_the_arena(fleet: Fleet) -> None:
    a = fleet.start("a")
    upload(fleet, a)
    b = fleet.start("b")
    ns = namespace().hex()

    # not registered on b yet: refused rather than taking its objects for corrupt ones
    rc, _, err = cli(b, "warmup", "--namespace", ns, "--fetch")
    assert rc == 1
    assert "not registered on this node" in err
    assert sum(objects(fleet.bucket).values()) == N

    fleet.procs.client(b.files.socket, "dp1")  # registers the pool, as an engine would
    doc = cli_json(b, "warmup", "--object-index", "--namespace", ns, "--fetch")
    assert doc["chunksIndexed"] == N
    assert doc["chunksFetched"] == N
    assert doc["promoted"] == N
    assert doc["done"] is True
    assert tier_chunks(b, "lmdb") == N
    assert tier_chunks(b, "cpu") == N
    check = fleet.procs.check(b.files.socket, N)
    assert check == {"present": list(range(N)), "mismatched": [], "not_leased": []}
    found = fleet.procs.client(b.files.socket, "dp1", "--lookup", f"0:{N}")
    assert found["tiers"] == ["cpu"] * N


def test_gc_deletes_only_objects_past_the_retention(fleet: Fleet) -> None:
    a = fleet.start("a")
    upload(fleet, a)
    uploaded = objects(fleet.bucket)
    assert len(uploaded) >= 2
    old = dict(list(sorted(uploaded.items()))[: len(uploaded) // 2])
    for path in old:
        os.utime(path, (OLD, OLD))
    foreign = fleet.bucket / "notes.txt"
    foreign.write_text("not kvtier's")
    os.utime(foreign, (OLD, OLD))

    dry = cli_json(a, "gc", "--dry-run")  # retention from the daemon's configuration
    assert dry["dryRun"] is True
    assert dry["deleted"] == len(old)
    assert dry["total"] == len(uploaded)
    assert set(objects(fleet.bucket)) == set(uploaded)
    assert object_usage(a) == N

    rc, out, err = cli(a, "gc")
    assert rc == 0, err
    assert f"deleted {len(old)} of {len(uploaded)} objects" in out
    assert set(objects(fleet.bucket)) == set(uploaded) - set(old)
    assert foreign.exists()
    assert object_usage(a) == N - sum(old.values())

    # a retention given on the command line wins
    everything = cli_json(a, "gc", "--retention-s", "0")
    assert everything["deleted"] == len(uploaded) - len(old)
    assert objects(fleet.bucket) == {}
    assert object_usage(a) == 0


def test_gc_needs_the_admin_token(fleet: Fleet, tmp_path: Path) -> None:
    admin_token, read_token = tmp_path / "admin.token", tmp_path / "read.token"
    admin_token.write_text("admin-secret\n")
    read_token.write_text("read-secret\n")
    admin_token.chmod(0o600)
    read_token.chmod(0o600)
    server = {"admin_token_file": str(admin_token), "read_token_file": str(read_token)}
    a = fleet.start("a", server=server)

    def gc_code(token: str) -> grpc.StatusCode:
        with grpc.insecure_channel(a.admin_address) as channel:
            return _gc_code(admin_pb2_grpc.AdminServiceStub(channel), token)

    def _gc_code(stub: admin_pb2_grpc.AdminServiceStub, token: str) -> grpc.StatusCode:
        stream = stub.Gc(
            admin_pb2.GcRequest(retention_s=0), metadata=[("authorization", f"Bearer {token}")]
        )
        try:
            list(stream)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    rc, _, err = cli(a, "gc", "--dry-run", token_file=read_token)
    assert rc == 1
    assert "read-only token cannot call this" in err
    assert gc_code("read-secret") is grpc.StatusCode.PERMISSION_DENIED
    assert gc_code("admin-secret") is grpc.StatusCode.OK
    rc, _, err = cli(a, "gc", "--dry-run", token_file=admin_token)
    assert rc == 0, err


def test_without_an_object_tier_both_are_refused(fleet: Fleet) -> None:
    a = fleet.start("a", object_tier=False)
    with a.admin_channel() as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        for call, request in (
            (stub.Gc, admin_pb2.GcRequest()),
            (stub.Warmup, admin_pb2.WarmupRequest(object_index=True)),
            (stub.Warmup, admin_pb2.WarmupRequest(fetch=True)),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                list(call(request))
            assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "set object.url" in (caught.value.details() or "")
    for args in (("gc",), ("warmup", "--object-index")):
        rc, _, err = cli(a, *args)
        assert rc == 1
        assert "needs the object tier, and this daemon has none" in err
    # a plain warmup still works
    rc, out, err = cli(a, "warmup")
    assert rc == 0, err
    assert "promoted 0 of 0 chunks" in out
