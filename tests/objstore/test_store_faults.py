"""The object tier on real stores when the store, a request or another node's format is at
fault: an unreachable store opens the breaker at once, a request refused for its own name is not
the store's failure, an object of a newer chunk format is a miss left in place, and gc keeps
what any node pinned."""

from __future__ import annotations

import time

import pytest

from kvtier.core import blockfmt
from kvtier.core.errors import ObjectStoreError
from kvtier.tiers.objstore.backend import RequestRejectedError, StoreUnreachableError
from kvtier.tiers.objstore.catalog import Catalog
from kvtier.tiers.objstore.resilience import CircuitBreaker
from kvtier.tiers.objstore.tier import PINS_DIR
from tests.contract.tier_contract import CHUNK
from tests.objstore import test_object_tier
from tests.objstore.fixtures import GCS_ENDPOINT_ENV, StoreFactory
from tests.objstore.servers import _Handler, _LoopbackHttp, free_port
from tests.objstore.test_object_tier import Tier, keys, read
from tests.support import keys_for, payload_for, target_spec

make_tier = test_object_tier.make_tier  # the same fixture, found by name here


@pytest.mark.parametrize("fault", ["refused", "dns"])
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_an_unreachable_store_opens_the_breaker_at_its_first_request(
    make_tier: Tier,
    store_factory: StoreFactory,
    monkeypatch: pytest.MonkeyPatch,
    scheme: str,
    fault: str,
) -> None:
    url = store_factory(scheme)
    dead = (
        f"http://127.0.0.1:{free_port()}" if fault == "refused" else "http://kvtier-store.invalid:9"
    )
    # only the store is gone: the identity (STS, the metadata server) still answers
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3" if scheme == "s3" else GCS_ENDPOINT_ENV, dead)
    tier = make_tier(url, retries=3, breaker_failures=5, backoff_s=0.2, breaker_reset_s=60)
    assert tier.healthy, tier.breaker.last_error
    (key,) = keys(1)
    with pytest.raises(StoreUnreachableError):
        tier.probe(key)
    counters = tier.stats().counters
    assert counters["request_errors"] == 1, "no retry against a store that is not there"
    assert counters["retries"] == 0
    assert tier.stats().counters["healthy"] == 0
    assert tier.breaker.state == CircuitBreaker.OPEN
    assert not tier.put(key, payload_for(key, CHUNK))
    assert tier.stats().counters["breaker_rejected"] >= 1, "the open breaker sent nothing"


def test_a_name_the_store_refuses_never_counts_against_its_breaker(
    make_tier: Tier, store_factory: StoreFactory
) -> None:
    # names are prefix/tenant/namespace/hash: with this prefix only a 64-character tenant's
    # pass S3's and GCS's 1024 bytes
    url = store_factory("s3", prefix="p/" + "x" * 880)
    tier = make_tier(url, breaker_failures=2, retries=3, pack_target_bytes=0)
    long_tenant = target_spec(tenant="t" * 64)
    tier.registry.register(long_tenant, CHUNK)
    refused = keys_for(long_tenant.digest(), 5)
    assert len(tier.backend.location.join(tier.object_name(refused[0])).encode()) > 1024
    for key in refused:
        assert not tier.put(key, payload_for(key, CHUNK))
    with pytest.raises(RequestRejectedError):
        tier.probe(refused[0])
    counters = tier.stats().counters
    assert counters["requests_rejected"] == 6
    assert counters["request_errors"] == 0
    assert counters["retries"] == 0
    assert tier.breaker.state == CircuitBreaker.CLOSED
    assert tier.healthy
    (good,) = keys(1)
    assert tier.put(good, payload_for(good, CHUNK))
    assert read(tier, good) == payload_for(good, CHUNK)


class _RefusesEveryName(_Handler):
    """A store that answers every request 400, as S3 and GCS answer a name they do not take."""

    def _refuse(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if self.path.startswith(("/storage/", "/upload/storage/")):  # GCS's JSON API
            error = {
                "code": 400,
                "message": "Invalid object name",
                "errors": [{"reason": "invalid"}],
            }
            self.reply_json(400, {"error": error})
        else:
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?><Error><Code>KeyTooLongError</Code>'
                "<Message>Your key is too long</Message><RequestId>1</RequestId></Error>"
            )
            self.reply(400, xml, "application/xml")

    do_GET = do_PUT = do_POST = do_DELETE = _refuse


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_400_for_the_request_never_counts_against_the_breaker(
    make_tier: Tier, store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    url = store_factory(scheme)
    store = _LoopbackHttp(_RefusesEveryName)
    try:
        # the identity (STS, the metadata server) still answers; the store refuses the names
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3" if scheme == "s3" else GCS_ENDPOINT_ENV, store.url)
        tier = make_tier(url, breaker_failures=2, retries=3, pack_target_bytes=0)
        for key in keys(4):
            assert not tier.put(key, payload_for(key, CHUNK))
            with pytest.raises(RequestRejectedError):
                tier.probe(key)
        counters = tier.stats().counters
        assert (counters["requests_rejected"], counters["request_errors"]) == (8, 0)
        assert counters["retries"] == 0
        assert tier.breaker.state == CircuitBreaker.CLOSED
        assert tier.healthy
    finally:
        store.close()


def _set_version(body: bytearray, version: int) -> None:
    body[len(blockfmt.MAGIC) : len(blockfmt.MAGIC) + 2] = version.to_bytes(2, "little")


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_an_object_of_a_newer_chunk_format_is_a_miss_left_in_the_store(
    make_tier: Tier, store_factory: StoreFactory, scheme: str
) -> None:
    url = store_factory(scheme)
    writer, reader = make_tier(url), make_tier(url)
    (key,) = keys(1)
    assert writer.put(key, payload_for(key, CHUNK))
    name = writer.object_name(key)
    body = bytearray(writer.backend.get(name))
    newer = bytearray(body)
    _set_version(newer, blockfmt.CODED_VERSION + 1)  # as a node of the next release writes it
    meta = {"kvtier-format": str(blockfmt.CODED_VERSION + 1), "kvtier-chunks": "1"}
    writer.backend.put(name, bytes(newer), meta)

    assert reader.probe(key) is None
    assert read(writer, key) is None, "the index that named it answers a miss"
    warmup = list(Catalog(reader).rebuild_index())[-1]
    assert (warmup.indexed, warmup.unknown_format, warmup.corrupt) == (0, 1, 0)
    for tier in (writer, reader):
        counters = tier.stats().counters
        assert counters["corrupt"] == 0
        assert counters["unknown_format"] >= 1
    assert reader.stats().counters["unknown_format"] == 2  # the probe and the warmup
    assert writer.backend.get(name) == bytes(newer), "never deleted nor rewritten"

    # this build's own version failing its checks is corrupt, as ever
    body[-1] ^= 0x01
    writer.backend.put(name, bytes(body), meta | {"kvtier-format": str(blockfmt.VERSION)})
    assert reader.probe(key) is None
    assert reader.stats().counters["corrupt"] == 1
    assert writer.backend.head(name) is None


def test_gc_keeps_what_another_node_pinned(make_tier: Tier, store_factory: StoreFactory) -> None:
    url = store_factory("s3")
    a, b = make_tier(url, pack_target_bytes=0), make_tier(url, pack_target_bytes=0)
    assert a.node_id != b.node_id
    of_a, of_b = keys(2), keys(2, start=10)
    for tier, batch in ((a, of_a), (b, of_b)):
        for key in batch:
            assert tier.put(key, payload_for(key, CHUNK))
    b.pin([of_b[0]])
    later = time.time() + 3600  # every object is past a retention of 1 s

    counts = list(Catalog(a).gc(1.0, now=later))[-1]
    assert (counts.deleted, counts.pinned) == (3, 1)
    assert a.backend.head(b.object_name(of_b[0])) is not None, "b's pin holds on a's gc"
    assert a.backend.head(b.object_name(of_b[1])) is None
    assert a.backend.head(a.object_name(of_a[0])) is None
    assert a.backend.head(b.pins_name) is not None, "pins are not collected"

    b.unpin([of_b[0]])
    assert a.backend.head(b.pins_name) is None
    counts = list(Catalog(a).gc(1.0, now=later))[-1]
    assert (counts.deleted, counts.pinned) == (1, 0)
    assert a.backend.head(b.object_name(of_b[0])) is None


def test_gc_deletes_nothing_when_a_node_s_pins_cannot_be_read(
    make_tier: Tier, store_factory: StoreFactory
) -> None:
    url = store_factory("file")
    tier = make_tier(url, pack_target_bytes=0)
    batch = keys(3)
    for key in batch:
        assert tier.put(key, payload_for(key, CHUNK))
    tier.backend.put(f"{PINS_DIR}/a-newer-node", b'{"format": 99, "objects": []}', {})
    with pytest.raises(ObjectStoreError, match="a-newer-node"):
        list(Catalog(tier).gc(1.0, now=time.time() + 3600))
    assert all(tier.backend.head(tier.object_name(key)) is not None for key in batch)
