from __future__ import annotations

import dataclasses

import pytest

from kvtier.core.keys import (
    NAMESPACE_BYTES,
    ChunkKey,
    NamespaceSpec,
    PageLayout,
    Pool,
    chunk_hash_of,
    make_key,
    namespace_of,
    namespaces_of,
    validate_key,
)
from tests.support import draft_spec, layout, target_spec

# One changed value per field; each must move the namespace.
SPEC_CHANGES: dict[str, object] = {
    "model": "other-model",
    "model_revision": "r2",
    "kv_dtype": "bfloat16",
    "tp_rank": 1,
    "tp_size": 8,
    "pp_rank": 1,
    "pp_size": 4,
    "hash_algo": "sha256_cbor",
    "tenant": "tenant-b",
    "attention": "sliding_window=200",
}
LAYOUT_CHANGES: dict[str, object] = {
    "tokens_per_block": 32,
    "blocks_per_chunk": 8,
    "num_kv_heads": 4,
    "head_sizes": (64, 64),
    "layer_names": ("model.layers.1.self_attn.attn", "model.layers.0.self_attn.attn"),
    "kv_order": "k_then_v",
}


def test_every_spec_field_is_covered() -> None:
    fields = {f.name for f in dataclasses.fields(NamespaceSpec)}
    assert fields - {"pool", "layout", "draft_model", "draft_revision"} == set(SPEC_CHANGES)
    assert {f.name for f in dataclasses.fields(PageLayout)} == set(LAYOUT_CHANGES)


@pytest.mark.parametrize(("field", "value"), SPEC_CHANGES.items())
def test_each_spec_field_changes_the_namespace(field: str, value: object) -> None:
    base = target_spec(tp_size=4, pp_size=2)
    changed = dataclasses.replace(base, **{field: value})
    assert changed.digest() != base.digest()


@pytest.mark.parametrize(("field", "value"), LAYOUT_CHANGES.items())
def test_each_layout_field_changes_the_namespace(field: str, value: object) -> None:
    base = target_spec()
    changed = target_spec(layout=dataclasses.replace(layout(), **{field: value}))
    assert changed.digest() != base.digest()


def test_pool_and_draft_identity_change_the_namespace() -> None:
    draft = draft_spec(kv_dtype="float16", layout=layout())
    assert draft.digest() != target_spec().digest()  # same bytes shape, other pool
    assert dataclasses.replace(draft, draft_revision="d2").digest() != draft.digest()
    assert dataclasses.replace(draft, draft_model="other-draft").digest() != draft.digest()


def test_draft_fields_belong_to_the_draft_pool_only() -> None:
    with pytest.raises(ValueError, match="draft pool only"):
        target_spec(draft_revision="d1")
    with pytest.raises(ValueError, match="needs draft_model"):
        target_spec(pool=Pool.DRAFT)


def test_namespace_is_stable_and_sixteen_bytes() -> None:
    a, b = target_spec(), target_spec()
    assert a.digest() == b.digest()
    assert len(a.digest()) == NAMESPACE_BYTES
    # Pinned value: the canonical encoding must never drift silently between releases.
    assert a.canonical().startswith(b'{"fields":{"draft_model":null')


def test_invalid_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="shard rank"):
        target_spec(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="tokens_per_block"):
        PageLayout(0, 1, 1, (32,), ("l0",))
    with pytest.raises(ValueError, match="layer_names"):
        PageLayout(16, 1, 1, (32,), ())
    with pytest.raises(ValueError, match="pool"):
        target_spec(pool="verifier")


def test_keys_join_namespace_and_engine_hash() -> None:
    ns = target_spec().digest()
    key = make_key(ns, b"\x01" * 32)
    assert namespace_of(key) == ns
    assert chunk_hash_of(key) == b"\x01" * 32
    assert make_key(ns, -5) != make_key(ns, 5)  # int hashes (builtin hash) keep their sign
    assert validate_key(key) == key
    with pytest.raises(ValueError, match="namespace"):
        make_key(b"short", 1)
    with pytest.raises(ValueError, match="chunk hash"):
        make_key(ns, b"x" * 33)
    with pytest.raises(ValueError, match="malformed"):
        validate_key(ns)


def test_namespaces_of_a_batch_names_every_pool_in_it() -> None:
    one, two = b"\x01" * NAMESPACE_BYTES, b"\x02" * NAMESPACE_BYTES
    same = [make_key(one, i) for i in range(64)]
    assert namespaces_of(same) == {one}
    assert namespaces_of([*same, make_key(two, 1)]) == {one, two}  # the last key alone differs
    assert namespaces_of([make_key(two, 1), *same]) == {one, two}
    # keys of other lengths cannot be read as one packed batch
    assert namespaces_of([*same, ChunkKey(two + b"\x00" * 40)]) == {one, two}
    assert namespaces_of([]) == set()
