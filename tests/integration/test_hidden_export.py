"""``kvtier hidden export --namespace`` on a node whose arena gives the hidden pool a single
extent: the manifests are read straight from lmdb, so the states get the extent, and a chunk
lmdb holds that cannot reach the arena is said to be so, not "in no tier". And beside a running
kvtierd: through it, its lmdb listed read-only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from kvtier.cli.main import main
from kvtier.client import InProcessClient
from kvtier.core.config import from_mapping
from kvtier.core.keys import ChunkKey, NamespaceSpec, PageLayout, Pool, make_key
from kvtier.hidden.export import listed_refs
from kvtier.hidden.reader import (
    HEADS_FIRST,
    MANIFEST_PART_BYTES,
    HiddenStatesError,
    HiddenStatesReader,
    HiddenStatesRef,
    manifest_parts,
    manifest_spec,
)
from kvtier.tiering.manager import TierManager
from tests.integration.daemon_harness import Processes, write_config

MiB = 1 << 20
BLOCK, BLOCKS_PER_CHUNK, LAYERS, HIDDEN = 32, 2, 2, 512
CHUNK_BYTES = BLOCK * BLOCKS_PER_CHUNK * LAYERS * HIDDEN * 4  # 256 KiB: a slot class of its own
TOKENS = 100  # two chunks, the second part full
REQUESTS = 3


def hidden_spec() -> NamespaceSpec:
    return NamespaceSpec(
        model="m",
        model_revision="r",
        pool=Pool.HIDDEN,
        kv_dtype="float32",
        layout=PageLayout(
            BLOCK, BLOCKS_PER_CHUNK, LAYERS, (HIDDEN,), ("cache_only_layers.2",), HEADS_FIRST
        ),
        attention="hidden_states=0,2",
    )


def tree(shm: Path, lmdb: Path, arena_mib: int) -> dict[str, Any]:
    return {
        "arena": {"path": str(shm), "size_bytes": arena_mib * MiB, "extent_bytes": 2 * MiB},
        "lmdb": {"path": str(lmdb), "budget_bytes": 64 * MiB},
    }


def write(m: TierManager, keys: list[ChunkKey], payloads: list[bytes]) -> None:
    refs = m.reserve(keys, "dp0")
    assert all(r is not None for r in refs)
    for ref, payload in zip(refs, payloads, strict=True):
        assert ref is not None
        m.cpu.view(ref)[: len(payload)] = payload
    assert m.commit([r for r in refs if r is not None]) == len(keys)


@pytest.fixture
def captured(shm_path: Path, tmp_path: Path) -> tuple[Path, list[HiddenStatesRef]]:
    """Three requests' states and manifests, as a capturing engine leaves them in lmdb."""
    m = TierManager(from_mapping(tree(shm_path, tmp_path / "lmdb", arena_mib=64)))
    refs = []
    try:
        spec = hidden_spec()
        namespace = m.register_pool(spec, CHUNK_BYTES)
        manifests = m.register_pool(manifest_spec(namespace), MANIFEST_PART_BYTES)
        rng = np.random.default_rng(0)
        for r in range(REQUESTS):
            chunks = tuple(bytes([r, c]) * 16 for c in range(2))
            ref = HiddenStatesRef(spec, chunks, TOKENS, tuple(range(TOKENS)))
            states = [rng.standard_normal(CHUNK_BYTES // 4, "float32").tobytes() for _ in chunks]
            write(m, ref.keys(), states)
            parts = manifest_parts(ref)
            write(m, [make_key(manifests, name) for name, _ in parts], [p for _, p in parts])
            refs.append(ref)
        assert m.flush()
    finally:
        m.close()
    shm_path.unlink(missing_ok=True)
    return tmp_path / "lmdb", refs


def small_node(shm: Path, lmdb: Path) -> TierManager:
    m = TierManager(from_mapping(tree(shm, lmdb, arena_mib=8)))
    # the case: one extent for the hidden pool, which a slot class keeps once it took it
    assert m.cpu.pool_capacity_bytes("hidden") == 2 * MiB
    return m


def test_export_by_namespace_from_a_small_arena_writes_every_request(
    captured: tuple[Path, list[HiddenStatesRef]], shm_path: Path, tmp_path: Path
) -> None:
    lmdb, refs = captured
    small_node(shm_path, lmdb).close()
    config = tmp_path / "export.yaml"
    config.write_text(yaml.safe_dump(tree(shm_path, lmdb, arena_mib=8)))
    out = tmp_path / "states"
    namespace = refs[0].namespace.hex()
    argv = ["hidden", "export", "--config", str(config), "--namespace", namespace]
    assert main([*argv, "--to", str(out), "--timeout", "2"]) == 0
    assert len(list(out.glob("*.safetensors"))) == REQUESTS


def test_a_chunk_lmdb_holds_but_the_arena_cannot_take_is_said_to_be_so(
    captured: tuple[Path, list[HiddenStatesRef]], shm_path: Path
) -> None:
    lmdb, refs = captured
    m = small_node(shm_path, lmdb)
    # manifests read through the arena: their 64 KiB slot class takes the pool's only extent
    reader = HiddenStatesReader(InProcessClient(m), timeout_s=0.5)
    try:
        listed, failed = listed_refs(m, reader, refs[0].namespace, "default")
        assert (len(listed), failed) == (REQUESTS, 0)
        with pytest.raises(HiddenStatesError) as raised:
            reader.load(listed[0])
    finally:
        reader.close()
        m.close()
    message = str(raised.value)
    assert message.startswith("2 of 2 chunks are in lmdb or the object store but were not promoted")
    assert "no free arena slot of their size" in message
    assert "in no tier" not in message


def test_export_beside_a_running_kvtierd_reads_through_it(
    captured: tuple[Path, list[HiddenStatesRef]], shm_path: Path, tmp_path: Path, procs: Processes
) -> None:
    lmdb, refs = captured
    (tmp_path / "node").mkdir()
    files = write_config(tmp_path / "node", shm_path, {"lmdb": {"path": str(lmdb)}})
    daemon = procs.start_daemon(files)
    out = tmp_path / "states"
    command = [sys.executable, "-m", "kvtier.cli", "hidden", "export", "--config"]
    command += [str(files.config), "--namespace", refs[0].namespace.hex(), "--to", str(out)]
    # the node's own config opens tiers of its own: kvtierd holds its arena
    alone = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert alone.returncode != 0
    assert "in use by another kvtier process" in alone.stderr
    beside = subprocess.run(
        [*command, "--through-daemon"], capture_output=True, text=True, timeout=120, check=False
    )
    assert beside.returncode == 0, beside.stdout + beside.stderr
    assert f"{REQUESTS} written" in beside.stdout
    assert len(list(out.glob("*.safetensors"))) == REQUESTS
    # kvtierd served them: its lmdb was read, nothing of it was written by the export
    assert daemon.stats().counters["promotions"] >= REQUESTS * 2
