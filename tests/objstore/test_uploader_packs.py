"""How chunks are packed into objects: runs of one prompt only, whatever order they reach the
packer in, on a file:// store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.core.keys import NAMESPACE_BYTES, blank_key
from kvtier.tiering.manager import TierManager
from kvtier.tiers.objstore.tier import ObjectTier
from tests.support import keys_for, object_node_config, payload_for, target_spec

CHUNK = 256 << 10


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[TierManager]:
    # every chunk reaches the packer before a pack leaves
    config = object_node_config(tmp_path, f"file://{tmp_path}/bucket", pack_linger_ms=2000)
    m = TierManager(config)
    yield m
    m.close()
    config.arena.path.unlink(missing_ok=True)


def objects(bucket: Path) -> dict[str, int]:
    """Object name -> chunks it holds."""
    return {
        str(meta.relative_to(bucket)).removesuffix(".meta"): int(
            json.loads(meta.read_text())["kvtier-chunks"]
        )
        for meta in bucket.rglob("*.meta")
    }


def test_interleaved_prompts_are_packed_apart(manager: TierManager, tmp_path: Path) -> None:
    ns = manager.register_pool(target_spec(), CHUNK)
    first, second = keys_for(ns, 6), keys_for(ns, 6, start=100)
    refs_a = manager.reserve(first, "r0")
    refs_b = manager.reserve(second, "r0")
    interleaved = [r for pair in zip(refs_a, refs_b, strict=True) for r in pair if r is not None]
    assert len(interleaved) == 12
    for ref in interleaved:
        manager.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
    assert manager.commit(interleaved) == 12  # written back, and offered, in this order
    assert manager.flush()
    assert manager.flush_uploads(20.0)
    assert manager.object is not None
    name_of = manager.object.object_name
    assert objects(tmp_path / "bucket") == {name_of(first[0]): 6, name_of(second[0]): 6}
    for keys in (first, second):
        locations = [manager.object.index.get(k) for k in keys]
        assert [loc.obj if loc else None for loc in locations] == [name_of(keys[0])] * 6
        assert [loc.offset if loc else None for loc in locations] == sorted(
            loc.offset for loc in locations if loc
        ), "chunks in prompt order"
    assert ObjectTier.key_of(name_of(second[0])) == second[0]


def test_a_prompt_stored_over_several_steps_is_one_object(
    manager: TierManager, tmp_path: Path
) -> None:
    ns = manager.register_pool(target_spec(), CHUNK)
    prompt, other = keys_for(ns, 12), keys_for(ns, 6, start=100)
    assert manager.lookup(prompt).hits == 0  # an engine asks before computing the prompt
    refs = []
    for step in range(0, 12, 4):  # chunked prefill: each step stores the chunks it computed
        refs += [r for r in manager.reserve(prompt[step : step + 4], "r0") if r is not None]
    refs += [r for r in manager.reserve(other, "r0") if r is not None]
    assert len(refs) == 18
    for ref in refs:
        manager.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
    assert manager.commit(refs) == 18
    assert manager.flush()
    assert manager.flush_uploads(20.0)
    assert manager.object is not None
    name_of = manager.object.object_name
    assert objects(tmp_path / "bucket") == {name_of(prompt[0]): 12, name_of(other[0]): 6}


def test_a_prompt_stored_in_slots_reserved_blank_is_one_object(
    manager: TierManager, tmp_path: Path
) -> None:
    # a sidecar's stores take slots reserved ahead: the chunks are named only as they commit
    ns = manager.register_pool(target_spec(), CHUNK)
    prompt, other = keys_for(ns, 3), keys_for(ns, 3, start=100)
    hash_bytes = len(prompt[0]) - NAMESPACE_BYTES
    blanks = [blank_key(ns, serial, hash_bytes) for serial in range(6)]
    held = [r for r in manager.reserve(blanks, "r0") if r is not None]
    assert len(held) == 6
    named = [replace(ref, key=key) for ref, key in zip(held, prompt + other, strict=True)]
    for ref in named:
        manager.cpu.view(ref)[:] = payload_for(ref.key, ref.nbytes)
    for run in (named[:3], named[3:]):  # one commit a step, as the engine reports them
        assert not manager.refuse_kept(run)
        assert manager.commit(run) == 3
    assert manager.flush()
    assert manager.flush_uploads(20.0)
    assert manager.object is not None
    name_of = manager.object.object_name
    assert objects(tmp_path / "bucket") == {name_of(prompt[0]): 3, name_of(other[0]): 3}
