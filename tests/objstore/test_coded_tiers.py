"""Coded tiers below the arena (int8, fp8), end to end through real tiers: a node writes KV
through its arena into lmdb and S3 (moto, reached through IRSA) in pairings of codecs, the bytes
kept and uploaded are the coded size where a tier codes, and another node, whatever its own
codecs, reads every chunk back into its arena within the codec's bound."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from kvtier.core import blockfmt
from kvtier.core.keys import ChunkKey
from kvtier.core.kvcodec import Codec, error_bound
from kvtier.tiering.manager import TierManager
from tests.objstore.fixtures import ObjectNodes, StoreFactory
from tests.support import keys_for, target_spec

CHUNK = 64 << 10
HEAD = 32  # tests.support.layout's head size
ROWS = CHUNK // (2 * HEAD)  # float16 rows
CODED = blockfmt.HEADER_SIZE + ROWS * (HEAD + 4)
RAW = blockfmt.HEADER_SIZE + CHUNK
CHUNKS = 6


def kv_for(key: ChunkKey) -> np.ndarray:
    """KV-like float16 rows for ``key``: magnitudes that differ by row, as K and V do."""
    rng = np.random.default_rng(int.from_bytes(key[-4:], "little"))
    rows = rng.standard_normal((ROWS, HEAD)) * 10.0 ** rng.uniform(-2, 1, (ROWS, 1))
    return rows.astype(np.float16)


def row_errors(stored: np.ndarray, loaded: bytes) -> np.ndarray:
    a = stored.astype(np.float64)
    b = np.frombuffer(loaded, np.float16).reshape(ROWS, HEAD).astype(np.float64)
    return np.linalg.norm(a - b, axis=1) / np.linalg.norm(a, axis=1)


@pytest.fixture
def node(object_nodes: ObjectNodes) -> Callable[[str, str, Codec, Codec], TierManager]:
    def make(url: str, name: str, lmdb: Codec, store: Codec) -> TierManager:
        return object_nodes(
            url, name, {"codec": lmdb.value}, codec=store.value, request_timeout_s=5.0
        )

    return make


@pytest.mark.parametrize(
    ("lmdb", "store"),
    [
        (Codec.FP8, Codec.FP8),
        (Codec.NONE, Codec.FP8),
        (Codec.FP8, Codec.NONE),
        (Codec.INT8, Codec.INT8),
    ],
    ids=["both-fp8", "store-fp8", "lmdb-fp8", "both-int8"],
)
def test_coded_tiers_keep_half_the_bytes_and_any_node_reads_them_back_within_the_bound(
    node: Callable[[str, str, Codec, Codec], TierManager],
    store_factory: StoreFactory,
    lmdb: Codec,
    store: Codec,
) -> None:
    url = store_factory("s3")
    writer = node(url, "writer", lmdb, store)
    ns = writer.register_pool(target_spec(), CHUNK)
    bound = max(error_bound(lmdb, HEAD), error_bound(store, HEAD))
    assert writer.registry.coded(writer.config.lower_codecs) == {ns: bound}
    keys = keys_for(ns, CHUNKS)
    kv = {key: kv_for(key) for key in keys}
    refs = [r for r in writer.reserve(keys, "r0") if r is not None]
    for ref in refs:
        writer.cpu.view(ref)[:] = kv[ref.key].tobytes()
    assert writer.commit(refs) == CHUNKS
    assert writer.flush()
    assert writer.flush_uploads(10.0)

    assert writer.lmdb is not None
    assert writer.object is not None
    assert writer.lmdb.stats().used_bytes == CHUNKS * (RAW if lmdb is Codec.NONE else CODED)
    uploaded = sum(info.size for info in writer.object.backend.list())
    assert uploaded == CHUNKS * (RAW if store is Codec.NONE else CODED)
    assert writer.object.counters.snapshot().get("uploads_codec_refused", 0) == 0

    # a node that codes nothing reads what the other coded: each chunk's header says how
    reader = node(url, "reader", Codec.NONE, Codec.NONE)
    reader.register_pool(target_spec(), CHUNK)
    assert reader.registry.coded(reader.config.lower_codecs) == {}
    assert reader.object is not None
    assert reader.object.principal_resolved.wait(10)
    deadline = time.monotonic() + 20.0
    while (found := reader.lookup(keys)).hits < CHUNKS:
        assert time.monotonic() < deadline, f"only {found.hits} of {CHUNKS} chunks found"
        time.sleep(0.05)
    leased = reader.lease(keys, "r1")
    assert all(ref is not None for ref in leased)
    worst = []
    for ref in leased:
        assert ref is not None
        loaded = bytes(reader.cpu.view(ref))
        errors = row_errors(kv[ref.key], loaded)
        assert errors.max() <= bound
        worst.append(errors.max())
    reader.release([ref for ref in leased if ref is not None])
    # the bytes came through the codec (off, within the bound), not around it
    assert min(worst) > 1e-3, worst


def test_a_chunk_with_a_value_no_code_stands_for_stays_out_of_a_coded_lmdb(
    node: Callable[[str, str, Codec, Codec], TierManager], store_factory: StoreFactory
) -> None:
    writer = node(store_factory("file"), "writer", Codec.FP8, Codec.FP8)
    ns = writer.register_pool(target_spec(), CHUNK)
    good, bad = keys_for(ns, 2)
    broken = kv_for(bad)
    broken[3, 5] = np.inf
    refs = [r for r in writer.reserve([good, bad], "r0") if r is not None]
    for ref, rows in zip(refs, (kv_for(good), broken), strict=True):
        writer.cpu.view(ref)[:] = rows.tobytes()
    assert writer.commit(refs) == 2
    assert writer.flush()
    assert writer.lmdb is not None
    assert writer.lmdb.contains([good, bad]) == [True, False]
    assert writer.lmdb.stats().counters["codec_refused"] == 1
    # the arena still serves it exactly, as it was committed
    (ref,) = writer.lease([bad], "r0")
    assert ref is not None
    assert bytes(writer.cpu.view(ref)) == broken.tobytes()
    writer.release([ref])
