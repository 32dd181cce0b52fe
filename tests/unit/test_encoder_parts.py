"""Encoder outputs as chunks: namespaces, part keys and the workers' reports."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvtier_vllm.encoder.metadata import ECReport, ECStepPlan, ItemSlots
from kvtier_vllm.encoder.scheduler import tagged
from kvtier_vllm.encoder.steps import MAX_UNREPORTED_STEPS, StepLedger
from kvtier_vllm.encoder.worker import relative_error

from kvtier.core.blockfmt import ChunkDescriptor, decode, encode
from kvtier.core.codec import spec_from, spec_to
from kvtier.core.encoder import PartLayout, encoder_spec, item_keys, rows_per_part
from kvtier.core.keys import ChunkKey, NamespaceSpec, Pool
from kvtier.core.protocol import SlotRef


def spec(**changes: Any) -> NamespaceSpec:
    fields: dict[str, Any] = {
        "model": "vlm",
        "encoder_revision": "fp-1",
        "dtype": "bfloat16",
        "width": 4096,
        "rows_per_part": 32,
        "processor": "image:abc",
    }
    fields.update(changes)
    return encoder_spec(**fields)


def test_every_setting_that_changes_the_output_changes_the_namespace() -> None:
    base = spec().digest()
    for change in (
        {"model": "other"},
        {"encoder_revision": "fp-2"},
        {"dtype": "float16"},
        {"width": 2048},
        {"rows_per_part": 16},
        {"processor": "image:abd"},
        {"tenant": "team-b"},
    ):
        assert spec(**change).digest() != base, change


def test_the_spec_crosses_the_wire_and_names_its_pool_in_chunk_headers() -> None:
    s = spec()
    assert spec_from(spec_to(s)) == s
    layout = PartLayout.of(s)
    key = item_keys(s.digest(), "abc", 40, layout)[0]
    payload = bytes(layout.part_bytes)
    value = encode(key, ChunkDescriptor.from_spec(s), payload)
    assert bytes(decode(value, key)) == payload
    assert ChunkDescriptor.from_spec(s).pool is Pool.ENCODER


def test_parts_cover_the_rows_and_keys_commit_to_identifier_and_size() -> None:
    layout = PartLayout(width=4096, dtype="bfloat16", rows_per_part=32)
    assert layout.part_bytes == 32 * 4096 * 2
    assert layout.parts(1) == 1
    assert layout.parts(64) == 2
    assert layout.parts(65) == 3
    assert [layout.rows_of(p, 65) for p in range(3)] == [32, 32, 1]
    namespace = bytes(16)
    keys = item_keys(namespace, "abc", 65, layout)
    assert len(keys) == len(set(keys)) == 3
    assert all(k.startswith(namespace) for k in keys)
    assert item_keys(namespace, "abc", 65, layout) == keys  # the same on every engine
    # another size under one identifier (a reused client-provided id) shares no key
    assert not set(item_keys(namespace, "abc", 64, layout)) & set(keys)
    # a LoRA-tagged identifier never meets the base one's keys
    assert not set(item_keys(namespace, "lora-a:abc", 65, layout)) & set(keys)
    assert rows_per_part(4096, "bfloat16", 256 << 10) == 32
    assert rows_per_part(100_000, "float32", 64 << 10) == 1


def test_bad_items_are_refused() -> None:
    layout = PartLayout(width=8, dtype="float32", rows_per_part=4)
    with pytest.raises(ValueError, match="at least one row"):
        item_keys(bytes(16), "abc", 0, layout)
    with pytest.raises(ValueError, match="identifier"):
        item_keys(bytes(16), "a\nb", 3, layout)
    with pytest.raises(ValueError, match="dtype"):
        spec(dtype="int8")


def test_a_lora_tagged_item_is_not_cached() -> None:
    assert tagged(SimpleNamespace(identifier="lora-a:abc", mm_hash="abc"))
    assert not tagged(SimpleNamespace(identifier="abc", mm_hash="abc"))
    assert not tagged(SimpleNamespace(identifier="abc", mm_hash=None))


def test_reports_of_two_workers_merge_failures_first() -> None:
    one = ECReport(loaded={"a", "b"}, stored={"c"}, errors={"a": 0.1}, stored_bytes=10)
    two = ECReport(loaded={"a"}, load_failed={"b"}, store_failed={"c"}, errors={"a": 0.3})
    merged = one.merge(two)
    assert merged.loaded == {"a"}
    assert merged.load_failed == {"b"}
    assert merged.stored == set()
    assert merged.store_failed == {"c"}
    assert merged.errors == {"a": 0.3}


def test_relative_error() -> None:
    computed = torch.ones(4, 8)
    assert relative_error(computed.clone(), computed) == 0.0
    assert relative_error(computed * 1.1, computed) == pytest.approx(0.1, rel=1e-4)
    assert relative_error(torch.ones(3, 8), computed) == float("inf")


def _slots(name: str, slot: int) -> ItemSlots:
    ref = SlotRef(ChunkKey(bytes(16) + name.encode()), slot, slot * 4096, 4096, 1)
    return ItemSlots(name, 8, PartLayout(width=8, dtype="float32", rows_per_part=8), (ref,))


def test_a_report_settles_its_own_step_while_the_next_is_in_flight() -> None:
    ledger = StepLedger()
    first = ECStepPlan(loads=[_slots("a", 0)], stores=[_slots("b", 1)])
    second = ECStepPlan(loads=[_slots("c", 2)], stores=[_slots("d", 3)])
    ledger.record(first)
    ledger.record(second)  # asynchronous scheduling: planned before the first one's report
    done = ledger.settle(ECReport(step=first.step, loaded={"a"}, stored={"b"}))
    assert [r.slot for r in done.commit] == [1]
    assert [r.slot for r in done.release] == [0]
    assert done.abort == []
    assert done.read == ["a"]
    # the second step's leases and reservation stay until its own report
    left = ledger.drain()
    assert [r.slot for r in left.release] == [2]
    assert [r.slot for r in left.abort] == [3]


def test_unreported_steps_expire_their_writes_are_never_committed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ledger = StepLedger()
    plan = ECStepPlan(stores=[_slots("b", 1)], loads=[_slots("a", 0)])
    ledger.record(plan)
    for _ in range(MAX_UNREPORTED_STEPS - 1):
        ledger.record(ECStepPlan())
        assert ledger.expire().abort == []
    ledger.record(ECStepPlan())
    with caplog.at_level("ERROR", logger="kvtier_vllm.encoder.steps"):
        gone = ledger.expire()
    assert [r.slot for r in gone.abort] == [1]
    assert [r.slot for r in gone.release] == [0]
    assert gone.commit == []
    assert "not stored" in caplog.text
    # a later report of a step it never planned settles nothing
    assert ledger.settle(ECReport(step=99, stored={"b"})).commit == []
