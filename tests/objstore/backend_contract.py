"""The contract every object-store backend passes, against a real store. A backend's test module
subclasses `BackendContract` and names its URL ``scheme``; ``store_factory`` (tests/objstore/
fixtures.py) makes a fresh bucket for each test, reached as in production."""

from __future__ import annotations

import time

import pytest

from kvtier.core.errors import ObjectNotFoundError
from kvtier.tiers.objstore.backend import (
    MAX_NAME_BYTES,
    PING_NAME,
    ObjectBackend,
    ObjectExistsError,
    RequestRejectedError,
)
from tests.objstore.fixtures import OpenBackend, StoreFactory

MiB = 1 << 20


def payload(n: int) -> bytes:
    # a period of 251 bytes: misplaced ranges show, and it is quick to build
    return (bytes(range(251)) * (n // 251 + 1))[:n]


class BackendContract:
    scheme: str
    """The URL scheme of the backend under test: "file", "s3" or "gs"."""
    exclusive_checked_by_server: str | None = None
    """Why the test server cannot show an exclusive put refused, where it cannot."""

    @pytest.fixture
    def url(self, store_factory: StoreFactory) -> str:
        return store_factory(self.scheme)

    @pytest.fixture
    def backend(self, url: str, opened: OpenBackend) -> ObjectBackend:
        return opened(url)

    # -- objects ----------------------------------------------------------------------------

    def test_put_get_and_ranges(self, backend: ObjectBackend) -> None:
        body = payload(1000)
        backend.put("chunks/a", body, {"kvtier-format": "1"})
        assert backend.get("chunks/a") == body
        assert backend.get("chunks/a", 10, 20) == body[10:30]
        assert backend.get("chunks/a", 990) == body[990:]
        assert backend.get("chunks/a", 995, 100) == body[995:]  # a range running past the end
        assert backend.get("chunks/a", 0, 0) == b""

    def test_put_takes_a_memoryview_and_overwrites(self, backend: ObjectBackend) -> None:
        backend.put("obj", b"old contents", {"v": "1"})
        buffer = bytearray(payload(300))
        backend.put("obj", memoryview(buffer)[100:200], {"v": "2"})
        assert backend.get("obj") == bytes(buffer[100:200])
        info = backend.head("obj")
        assert info is not None
        assert (info.size, dict(info.metadata)) == (100, {"v": "2"})

    def test_an_exclusive_put_never_replaces_an_object(self, backend: ObjectBackend) -> None:
        backend.put("fresh", b"first", {"v": "1"}, exclusive=True)
        assert backend.get("fresh") == b"first"
        if self.exclusive_checked_by_server is not None:
            pytest.skip(self.exclusive_checked_by_server)
        with pytest.raises(ObjectExistsError):
            backend.put("fresh", b"second", {"v": "2"}, exclusive=True)
        info = backend.head("fresh")
        assert info is not None
        assert (backend.get("fresh"), dict(info.metadata)) == (b"first", {"v": "1"})

    def test_head_reports_size_time_and_metadata(self, backend: ObjectBackend) -> None:
        before = time.time()
        backend.put("dir/obj", payload(123), {"kvtier-chunks": "4", "kvtier-pool": "target"})
        info = backend.head("dir/obj")
        assert info is not None
        assert info.name == "dir/obj"
        assert info.size == 123
        assert dict(info.metadata) == {"kvtier-chunks": "4", "kvtier-pool": "target"}
        # S3 keeps whole seconds; allow clock skew between this process and the server
        assert before - 5 <= info.modified <= time.time() + 5

    def test_no_metadata_reads_back_empty(self, backend: ObjectBackend) -> None:
        backend.put("bare", b"x", {})
        info = backend.head("bare")
        assert info is not None
        assert dict(info.metadata) == {}

    def test_missing_objects(self, backend: ObjectBackend) -> None:
        assert backend.head("nope") is None
        with pytest.raises(ObjectNotFoundError):
            backend.get("nope")
        with pytest.raises(ObjectNotFoundError):
            backend.get("nope", 5, 10)
        with pytest.raises(ObjectNotFoundError):
            backend.get("nope", 0, 0)
        backend.delete(["nope"])  # ignored

    def test_delete(self, backend: ObjectBackend) -> None:
        for name in ("a", "b", "c"):
            backend.put(name, name.encode(), {})
        backend.delete(["a", "c", "never-written"])
        backend.delete([])
        assert backend.head("a") is None
        assert backend.head("c") is None
        assert backend.get("b") == b"b"
        assert sorted(info.name for info in backend.list()) == ["b"]

    def test_list_with_prefix(self, backend: ObjectBackend, url: str, opened: OpenBackend) -> None:
        # a neighbour whose prefix extends ours must stay out of our listing
        neighbour = opened(url + "2")
        neighbour.put("p1/x", b"other", {})
        sizes = {"p1/a": 1, "p1/b/c": 2, "p10/d": 3, "p2/e": 4}
        for name, size in sizes.items():
            backend.put(name, b"x" * size, {})
        everything = {info.name: info.size for info in backend.list()}
        assert everything == sizes
        assert {info.name for info in backend.list("p1/")} == {"p1/a", "p1/b/c"}
        assert {info.name for info in backend.list("p1")} == {"p1/a", "p1/b/c", "p10/d"}
        assert list(backend.list("zzz")) == []
        assert all(info.modified > 0 for info in backend.list())
        assert [info.name for info in neighbour.list()] == ["p1/x"]

    def test_large_object(self, url: str, opened: OpenBackend) -> None:
        # over 1 MiB botocore sends Expect: 100-continue; over 8 MiB the GCS SDK switches from
        # one multipart request to a resumable upload
        backend = opened(url, timeout_s=20.0)
        body = payload(9 * MiB)
        backend.put("big", body, {"size": str(len(body))})
        assert backend.get("big") == body
        assert backend.get("big", 8 * MiB + 5, 1000) == body[8 * MiB + 5 : 8 * MiB + 1005]
        info = backend.head("big")
        assert info is not None
        assert info.size == len(body)

    # -- the store --------------------------------------------------------------------------

    def test_url_names_the_same_store(self, backend: ObjectBackend, opened: OpenBackend) -> None:
        backend.put("here", b"same store", {})
        assert opened(backend.url).get("here") == b"same store"

    def test_principal_names_someone(self, backend: ObjectBackend) -> None:
        assert backend.principal()

    def test_ping_writes_nothing(self, backend: ObjectBackend) -> None:
        backend.ping()
        assert backend.head(PING_NAME) is None
        assert list(backend.list()) == []

    def test_a_name_past_the_limit_is_refused_and_stores_nothing(
        self, backend: ObjectBackend
    ) -> None:
        with pytest.raises(RequestRejectedError):
            backend.put("n" * (MAX_NAME_BYTES + 1), b"x", {})
        assert list(backend.list()) == []
