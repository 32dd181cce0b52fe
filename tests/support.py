"""Test helpers: namespace specs, keys, payloads and small configs for real arenas and LMDB."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from kvtier.core.config import (
    ArenaConfig,
    KVTierConfig,
    LMDBConfig,
    ObjectStoreConfig,
    from_mapping,
)
from kvtier.core.keys import ChunkKey, NamespaceSpec, PageLayout, Pool
from tests.fixtures.keys import keys_for as keys_for  # one copy, shared with the benchmarks

MiB = 1 << 20
SHM = Path("/dev/shm")


class HandClock:
    """A clock the test moves by hand (``now``), for code that takes a clock."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def new_arena_path() -> Path:
    """A fresh arena path in /dev/shm, named for this test process: `no_arena_left`
    (tests/conftest.py) removes it, and its ledger, when the process's run ends."""
    return SHM / f"kvtier-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def arenas_of_this_process() -> list[Path]:
    """The arenas (and their ledgers) `new_arena_path` named in this process."""
    return list(SHM.glob(f"kvtier-test-{os.getpid()}-*"))


def layout(layers: int = 2, heads: int = 16) -> PageLayout:
    """With float16, a chunk of two layers is 256 KiB (`target_spec`), of one layer in fp8 64 KiB
    (`draft_spec`): the sizes kvtierd takes for them (`kvtier.core.chunk_size`). Each head adds
    16 KiB a float16 chunk of two layers."""
    return PageLayout(
        tokens_per_block=16,
        blocks_per_chunk=4,
        num_kv_heads=heads,
        head_sizes=(32, 32),
        layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers)),
    )


def target_spec(**overrides: object) -> NamespaceSpec:
    fields: dict[str, object] = {
        "model": "tiny-llama",
        "model_revision": "r1",
        "pool": Pool.TARGET,
        "kv_dtype": "float16",
        "layout": layout(),
    }
    fields.update(overrides)
    return NamespaceSpec(**fields)  # type: ignore[arg-type]


def draft_spec(**overrides: object) -> NamespaceSpec:
    fields: dict[str, object] = {
        "pool": Pool.DRAFT,
        "draft_model": "tiny-draft",
        "draft_revision": "d1",
        "kv_dtype": "fp8",
        "layout": layout(1),
    }
    fields.update(overrides)
    return target_spec(**fields)


def payload_for(key: ChunkKey, nbytes: int) -> bytes:
    """Distinct, checkable bytes per key."""
    seed = key[-4:] * 4
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def arena_config(path: Path, size: int = 16 * MiB, **overrides: object) -> ArenaConfig:
    fields: dict[str, object] = {"path": path, "size_bytes": size, "extent_bytes": 2 * MiB}
    fields.update(overrides)
    return ArenaConfig.model_validate(fields)


def lmdb_config(path: Path, budget: int = 64 * MiB, **overrides: object) -> LMDBConfig:
    fields: dict[str, object] = {"path": path, "budget_bytes": budget, "sync_interval_s": 0.2}
    fields.update(overrides)
    return LMDBConfig.model_validate(fields)


def manager_config(
    shm: Path, tmp: Path, arena_mib: int = 16, lmdb_mib: int = 64, **manager: object
) -> KVTierConfig:
    return from_mapping(
        {
            "arena": {"path": str(shm), "size_bytes": arena_mib * MiB, "extent_bytes": 2 * MiB},
            "lmdb": {"path": str(tmp / "lmdb"), "budget_bytes": lmdb_mib * MiB},
            "manager": manager,
        }
    )


def object_node_config(
    root: Path, url: str, lmdb: dict[str, object] | None = None, **store: object
) -> KVTierConfig:
    """A node of the three tiers: a 16 MiB arena of its own, 64 MiB of lmdb under ``root`` (with
    ``lmdb``'s settings), and the object store ``url``, indexed under ``root``."""
    return from_mapping(
        {
            "arena": {
                "path": str(new_arena_path()),
                "size_bytes": 16 * MiB,
                "extent_bytes": 2 * MiB,
            },
            "lmdb": {"path": str(root / "lmdb"), "budget_bytes": 64 * MiB, **(lmdb or {})},
            "object": {
                "url": url,
                "index_path": str(root / "objindex"),
                "index_map_bytes": 64 * MiB,
                **store,
            },
        }
    )


def object_config(url: str, index: Path, **overrides: object) -> ObjectStoreConfig:
    """An object tier on ``url`` with its index under ``index``, quick to give up."""
    fields: dict[str, object] = {
        "url": url,
        "index_path": index,
        "index_map_bytes": 64 * MiB,
        "retries": 1,
        "backoff_s": 0.01,
        "request_timeout_s": 5.0,
    }
    fields.update(overrides)
    return ObjectStoreConfig.model_validate(fields)


def thread_nices(pid: int) -> dict[int, tuple[str, int]]:
    """(name, nice value) of each thread of process ``pid`` by thread id, from /proc's stat
    (the nice value is its field 19; the name is kept to 15 bytes)."""
    threads: dict[int, tuple[str, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended
            continue
        name, _, fields = stat[stat.index("(") + 1 :].rpartition(") ")
        threads[int(task.name)] = (name, int(fields.split()[16]))  # fields from the third
    return threads
