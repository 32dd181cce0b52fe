"""The object tier on real stores: the shared tier contract on file://, S3 (moto, through IRSA)
and GCS (the emulator, through GKE Workload Identity), then faults between tier and store."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest

from kvtier.core.errors import CredentialError, ObjectStoreError
from kvtier.core.keys import ChunkKey
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.objstore.tier import ObjectTier
from tests.contract.tier_contract import CHUNK, TierContract
from tests.objstore.fixtures import AwsIrsa, ProxiedStore, StoreFactory
from tests.objstore.servers import FaultMode, FaultProxy, ServerProcess
from tests.support import MiB, keys_for, object_config, payload_for, target_spec


class TestObjectTierContract(TierContract):
    capacity_chunks = 15  # 4 MiB budget of 256 KiB chunks plus headers

    @pytest.fixture(autouse=True)
    def _store(self, store_url: str) -> None:
        self.url = store_url

    def make_tier(self, registry: PoolRegistry, root: Path) -> ObjectTier:
        config = object_config(self.url, root / "objindex", budget_bytes=4 * MiB)
        return ObjectTier(config, registry)


Tier = Callable[..., ObjectTier]


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[Tier]:
    made: list[ObjectTier] = []

    def make(url: str, **overrides: object) -> ObjectTier:
        registry = PoolRegistry()
        registry.register(target_spec(), CHUNK)
        tier = ObjectTier(object_config(url, tmp_path / f"idx{len(made)}", **overrides), registry)
        made.append(tier)
        assert tier.principal_resolved.wait(10), "the identity is resolved in the background"
        return tier

    yield make
    for tier in made:
        tier.close()


def keys(n: int, start: int = 0) -> list[ChunkKey]:
    return keys_for(target_spec().digest(), n, start)


def read(tier: ObjectTier, key: ChunkKey) -> bytes | None:
    dst = bytearray(CHUNK)
    return bytes(dst) if tier.read_into(key, memoryview(dst)) else None


def wait_healthy(tier: ObjectTier, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not tier.healthy:
        assert time.monotonic() < deadline, f"not healthy: {tier.breaker.last_error}"
        time.sleep(0.05)


FAST_FAIL = {"request_timeout_s": 0.5, "retries": 2, "backoff_s": 0.01, "breaker_reset_s": 0.5}


def put_when_ready(tier: ObjectTier, key: ChunkKey) -> None:
    """A first upload under `FAST_FAIL`, tried until it goes through: on a loaded machine the
    role's credentials can take STS longer than the 0.5 s each call waits, which is not what
    the tests that use it are about."""
    deadline = time.monotonic() + 30.0
    while not tier.put(key, payload_for(key, CHUNK)):
        assert time.monotonic() < deadline, "no upload went through in 30 s"
        time.sleep(0.6)  # past the breaker's reset


def test_s3_runs_as_the_irsa_role_and_names_objects_by_the_documented_layout(
    make_tier: Tier, s3_store: str, aws_irsa: AwsIrsa
) -> None:
    tier = make_tier(s3_store, pack_target_bytes=0)
    assert tier.principal.startswith("arn:aws:sts::")
    assert "assumed-role" in tier.principal
    (key,) = keys(1)
    assert tier.put(key, payload_for(key, CHUNK))
    bucket, _, prefix = s3_store.removeprefix("s3://").partition("/")
    s3 = boto3.session.Session().client("s3")
    listed = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    digest = key[16:].hex()
    assert listed == [f"{prefix}/default/{key[:16].hex()}/{digest[:2]}/{digest}"]
    head = s3.head_object(Bucket=bucket, Key=listed[0])
    assert head["Metadata"]["kvtier-format"] == "1"
    assert len(head["Metadata"]["kvtier-xxh3-128"]) == 32


@pytest.mark.parametrize("scheme", ["s3", "gs"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_a_corrupt_object_is_a_miss_deleted_and_counted(
    make_tier: Tier, store_factory: StoreFactory, scheme: str, damage: str
) -> None:
    url = store_factory(scheme)
    writer, reader = make_tier(url), make_tier(url)
    a, b = keys(2)
    assert writer.put(a, payload_for(a, CHUNK))
    assert writer.put(b, payload_for(b, CHUNK))
    name_a, name_b = writer.object_name(a), writer.object_name(b)
    body = bytearray(writer.backend.get(name_a))
    if damage == "flip":
        body[len(body) // 3] ^= 0x04
    elif damage == "truncate":
        del body[-1:]
    else:  # another chunk's object under this name
        body = bytearray(writer.backend.get(name_b))
    writer.backend.put(name_a, bytes(body), {})
    assert reader.probe(a) is None
    assert reader.stats().counters["corrupt"] == 1
    assert writer.backend.head(name_a) is None, "the corrupt object is deleted"
    assert read(writer, a) is None, "the index that named it answers a miss"
    assert read(reader, b) is None, "never seen by the reader yet"
    assert reader.probe(b) is not None, "other objects unharmed"


def test_500s_fail_fast_open_the_breaker_and_the_tier_recovers(
    make_tier: Tier, proxied_store: ProxiedStore
) -> None:
    url, proxy = proxied_store("s3")
    tier = make_tier(url, breaker_failures=3, **FAST_FAIL)
    stored, later = keys(2)
    put_when_ready(tier, stored)
    proxy.set_mode(FaultMode.HTTP_500)
    started = time.monotonic()
    assert not tier.put(later, payload_for(later, CHUNK))
    assert read(tier, stored) is None
    assert time.monotonic() - started < 5.0
    assert not tier.healthy
    requests = len(proxy.requests)
    assert read(tier, stored) is None  # the open breaker sends nothing
    assert len(proxy.requests) == requests
    assert tier.stats().counters["misses_unhealthy"] >= 1
    proxy.set_mode(FaultMode.PASS)
    wait_healthy(tier)  # past breaker_reset_s, the tier's own trial goes through
    assert read(tier, stored) == payload_for(stored, CHUNK)
    assert tier.stats().counters["healthy"] == 1
    assert tier.put(later, payload_for(later, CHUNK))


def test_a_slow_store_never_holds_a_request_past_its_timeout(
    make_tier: Tier, proxied_store: ProxiedStore
) -> None:
    url, proxy = proxied_store("s3")
    tier = make_tier(url, **{**FAST_FAIL, "retries": 0})
    (key,) = keys(1)
    put_when_ready(tier, key)
    proxy.set_mode(FaultMode.DELAY, delay_ms=3000)
    started = time.monotonic()
    assert read(tier, key) is None
    assert time.monotonic() - started < 2.0
    proxy.set_mode(FaultMode.PASS)
    time.sleep(0.6)
    assert read(tier, key) == payload_for(key, CHUNK)


def test_the_server_killed_during_uploads_then_back(
    make_tier: Tier,
    store_factory: StoreFactory,
    spawn_server: Callable[[str], ServerProcess],
    fault_proxy: Callable[[str], FaultProxy],
) -> None:
    server = spawn_server("moto")
    proxy = fault_proxy(server.url)
    url = store_factory("s3", endpoint=proxy.url)
    tier = make_tier(url, **FAST_FAIL)
    put_when_ready(tier, keys(1, start=100)[0])  # the uploads before the kill must succeed
    batch = keys(12)
    results = []
    for i, key in enumerate(batch):
        if i == 4:
            server.kill()  # SIGKILL, mid-run
        results.append(tier.put(key, payload_for(key, CHUNK)))
    assert results[:4] == [True] * 4
    assert results[4:] == [False] * 8
    assert tier.stats().counters["store_errors"] >= 1
    assert tier.contains(batch) == [True] * 4 + [False] * 8, "failed uploads are not indexed"
    with pytest.raises(ObjectStoreError):
        tier.backend.head(tier.object_name(batch[0]))
    # back on another port, empty (moto keeps nothing), with the bucket made again
    server.start()
    proxy.upstream = ("127.0.0.1", server.port)
    bucket = url.removeprefix("s3://").partition("/")[0]
    boto3.session.Session().client("s3").create_bucket(Bucket=bucket)
    # the tier's own trial closes the breaker; a read while that trial is out would be refused
    # unsent, and the index would keep naming the lost object
    wait_healthy(tier)
    assert read(tier, batch[0]) is None  # gone with the old server: a miss, then forgotten
    assert tier.contains(batch[:1]) == [False]
    assert tier.put(batch[5], payload_for(batch[5], CHUNK)), "uploads resume"
    assert read(tier, batch[5]) == payload_for(batch[5], CHUNK)


def test_a_missing_token_file_makes_the_tier_unhealthy_not_the_process(
    make_tier: Tier, s3_store: str, aws_irsa: AwsIrsa, tmp_path: Path
) -> None:
    aws_irsa.token_file.unlink()
    tier = make_tier(s3_store, **FAST_FAIL)
    assert tier.principal == "unknown"
    assert not tier.healthy
    (key,) = keys(1)
    assert not tier.put(key, payload_for(key, CHUNK))
    assert (
        tier.stats().counters["credential_errors"] + tier.stats().counters["breaker_rejected"] >= 1
    )
    with pytest.raises(CredentialError):
        tier.backend.principal()
    aws_irsa.write_token()  # the kubelet projects it again
    wait_healthy(tier)
    assert tier.put(key, payload_for(key, CHUNK))
    assert tier.healthy
