"""The sections of kvtier's configuration tree (`kvtier.core.config.KVTierConfig`): the arena and
its pools, lmdb, the tier manager and the object store; kvtierd's own section is in
`config_server`. Every key has a default and a description."""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    model_validator,
)

from kvtier.core.kvcodec import Codec
from kvtier.core.priority import DEFAULT_NICE

EvictionPolicyName = Literal["lru", "fifo"]
"""The eviction policies a tier can be configured with."""

MiB = 1 << 20
DEFAULT_EXTENT_BYTES = 96 * MiB
"""Holds every 256-token chunk of the published shapes `benchmarks/arena_waste.py` measures."""
CODEC_DESCRIPTION = (
    "none: chunks as the arena holds them. int8 or fp8 (e4m3): the target's and the draft's KV "
    "(bf16, fp16 or fp32) one byte an element, with a float32 scale per row (a token's head of "
    "K or V): about half the bytes {verb}, decoded on the way back into the arena. A decoded "
    "row is off by at most sqrt(head size) / 254 of its norm with int8 (0.031 for heads of 64), "
    "2**-4 with fp8; measured on KV, int8 is several times closer. Verified reuse holds a coded "
    "pool to that bound. Other pools are stored as they are; the arena is always exact."
)


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local/state")
    return Path(base) / "kvtier"


class ConfigSection(BaseModel):
    """A section of the tree: frozen, and a key it does not know is an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class PoolConfig(ConfigSection):
    max_share: float = Field(
        1.0, gt=0.0, le=1.0, description="Largest fraction of the arena this pool may occupy."
    )
    replica_share: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Quota of one replica, as a fraction of the pool's capacity; a replica over "
        "its quota is evicted first.",
    )
    floor_share: float = Field(
        0.125,
        ge=0.0,
        le=1.0,
        description="Fraction of the arena (at most max_share) this pool keeps while a namespace "
        "of it is registered, when other pools' classes take its idle extents.",
    )


def _default_pools() -> dict[str, PoolConfig]:
    return {
        "target": PoolConfig(),
        "draft": PoolConfig(max_share=0.5),
        "hidden": PoolConfig(max_share=0.25),
        "encoder": PoolConfig(max_share=0.25),
        # a state chunk is about one attention chunk's size, and every hit needs one
        "state": PoolConfig(max_share=0.5),
    }


class ArenaConfig(ConfigSection):
    path: Path = Field(
        Path("/dev/shm/kvtier-arena"), description="Arena file; other processes map it by path."
    )
    size_bytes: ByteSize | None = Field(
        None, description="Arena size. Unset: `auto_fraction` of available memory."
    )
    auto_fraction: float = Field(
        0.25, gt=0.0, le=0.9, description="Share of available memory used when size_bytes is unset."
    )
    extent_bytes: ByteSize | None = Field(
        None,
        description="Allocation unit handed to a slot class; the largest chunk it can hold. "
        "Unset: 96 MiB, or a tenth of the arena (in whole MiB) where that is smaller, so a "
        "small arena still has extents to move between classes.",
    )
    min_slot_bytes: ByteSize = Field(
        ByteSize(64 << 10), description="Smallest chunk a pool may register; sizes the slot table."
    )
    prefault: bool = Field(True, description="Touch every page at start so stores never fault.")
    file_mode: int = Field(
        0o660,
        description="Mode of the arena file (octal): 0660, like the socket, lets the socket's "
        "group (server.group) map it; 0600 only kvtierd's own user. Never open to others.",
    )
    group: str | int | None = Field(
        None,
        description="Group (name or gid) given the arena file. Unset: server.group under "
        "kvtierd, else the creating process's group.",
    )
    commit_checksum: bool = Field(
        True,
        description="Checksum each chunk's bytes (xxh3-128) once it is committed, on a thread "
        "of the process that owns the tiers, and check it before the chunk is written to lmdb: "
        "a chunk changed in the arena after its commit is dropped and counted, never written "
        "back. Kept on file beside the arena too: after a kill, only chunks that match theirs "
        "are kept; off, none are.",
    )
    eviction_policy: EvictionPolicyName = Field(
        "lru", description="Eviction policy by name (lru, fifo)."
    )
    max_slot_classes: int = Field(
        64,
        ge=1,
        description="Most slot size classes (distinct pool and chunk size pairs) in use at once; "
        "a registration past it is RESOURCE_EXHAUSTED. A class no registered namespace uses "
        "gives its extents back and no longer counts.",
    )
    reclaim_idle_s: float = Field(
        30.0,
        gt=0,
        description="A slot class no store or load used this long lends its extents (its clean "
        "chunks evicted) to a class that has no free slot and no free extent.",
    )
    pools: dict[str, PoolConfig] = Field(
        default_factory=_default_pools, description="Per-pool budgets, by pool name."
    )

    def extent_for(self, arena_bytes: int) -> int:
        """The extent an arena of ``arena_bytes`` is cut into: `extent_bytes` where set."""
        if self.extent_bytes is not None:
            return int(self.extent_bytes)
        tenth = arena_bytes // 10 // MiB * MiB
        return max(min(DEFAULT_EXTENT_BYTES, tenth), int(self.min_slot_bytes))

    @model_validator(mode="after")
    def _check_sizes(self) -> ArenaConfig:
        if self.min_slot_bytes <= 0:
            raise ValueError("min_slot_bytes must be positive")
        if self.extent_bytes is not None and self.extent_bytes < self.min_slot_bytes:
            raise ValueError("extent_bytes must be at least min_slot_bytes")
        if self.size_bytes is not None and self.size_bytes < self.extent_for(self.size_bytes):
            raise ValueError("size_bytes must hold at least one extent")
        if self.file_mode & ~0o660:
            raise ValueError(
                f"file_mode {self.file_mode:#o} opens the arena to others or makes it "
                "executable; use 0660 (the socket's group) or 0600"
            )
        return self


class Durability(StrEnum):
    FAST = "fast"
    CONSISTENT = "consistent"
    FULL = "full"


class LMDBConfig(ConfigSection):
    enabled: bool = Field(True, description="Run the lmdb tier.")
    path: Path = Field(
        default_factory=lambda: default_state_dir() / "lmdb", description="LMDB environment dir."
    )
    budget_bytes: ByteSize | None = Field(
        None, description="Bytes of chunks kept. Unset: `auto_fraction` of free disk."
    )
    auto_fraction: float = Field(
        0.5, gt=0.0, le=0.95, description="Share of free disk used when budget_bytes is unset."
    )
    high_water: float = Field(
        0.95, gt=0.0, le=1.0, description="Eviction starts when use passes this share of budget."
    )
    low_water: float = Field(
        0.85, gt=0.0, le=1.0, description="Eviction stops when use falls to this share."
    )
    sync_interval_s: float = Field(
        1.0, ge=0.0, description="Seconds between background syncs; 0 syncs every commit."
    )
    durability: Durability = Field(
        Durability.FAST,
        description="fast: commits are not flushed (synced every sync_interval_s); an OS crash "
        "can corrupt the environment, which is then moved aside at start and lmdb starts empty. "
        "consistent: each commit flushes its data, not the metadata; an OS crash can undo the "
        "last commits, never corrupt. full: each commit is on disk when it returns.",
    )
    max_readers: int = Field(126, ge=1, description="Concurrent LMDB read transactions.")
    reader_check_interval_s: float = Field(
        30.0,
        ge=0.0,
        description="Seconds between clearing dead processes' reader slots, which keep LMDB "
        "from reusing pages; also at open and after a map-full. 0: only then.",
    )
    file_mode: int | None = Field(
        None,
        description="Mode of the environment's files (octal): 0600, or 0640 (lock file 0660) "
        "for engines of lmdb.group to read its map. Unset: 0640 with a group, else 0600.",
    )
    group: str | int | None = Field(
        None,
        description="Group (name or gid) given the environment's files. Unset: server.group "
        "under kvtierd, else the creating process's group.",
    )
    eviction_policy: EvictionPolicyName = Field(
        "lru", description="Eviction policy by name (lru, fifo)."
    )
    keep_freed_pages: bool = Field(
        True,
        description="Tune glibc to keep freed heap pages (process-wide), so LMDB's per-write "
        "buffers are not faulted in afresh on every transaction; about 2x faster writes.",
    )
    codec: Codec = Field(
        Codec.NONE,
        description=CODEC_DESCRIPTION.format(verb="kept on disk"),
    )
    preallocate: bool = Field(
        False,
        description="With durability fast: allocate the whole map on disk at start (about "
        "1.25 x budget_bytes + 64 MiB) and write chunks straight into it, one copy fewer per "
        "chunk (writes into reused pages measured about 2x faster). A disk too small is then "
        "found at start, and writes stay staged. Off: the data file grows with its pages.",
    )

    @model_validator(mode="after")
    def _check_marks(self) -> LMDBConfig:
        if self.low_water > self.high_water:
            raise ValueError("low_water must not exceed high_water")
        if self.file_mode is not None and self.file_mode & ~0o640:
            raise ValueError(
                f"file_mode {self.file_mode:#o} opens lmdb to others, or lets the group write "
                "it; use 0640 (the group reads) or 0600"
            )
        return self


class DemoteMode(StrEnum):
    WRITE_BACK = "write_back"
    WRITE_THROUGH = "write_through"


class ManagerConfig(ConfigSection):
    demote_mode: DemoteMode = Field(
        DemoteMode.WRITE_BACK,
        description="write_back: copy arena chunks to lmdb before they are evicted; "
        "write_through: on every commit.",
    )
    writeback_queue_chunks: int = Field(
        256, ge=1, description="Bound on chunks queued for write-back; beyond it work is dropped."
    )
    promote_queue_chunks: int = Field(
        1024,
        ge=1,
        description="Bound on lmdb chunks queued for promotion into the arena; "
        "beyond it requests are dropped and counted, never waited on.",
    )
    writeback_batch_chunks: int = Field(
        16, ge=1, description="Chunks written per LMDB transaction."
    )
    promote_hold_s: float = Field(
        10.0,
        ge=0.0,
        description="How long a chunk promoted ahead of a load (an engine asked for it, or its "
        "object was fetched) is held in the arena for that load: other promotions cannot evict "
        "it until a lease takes it or this passes. 0: not held.",
    )
    promote_hold_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Most of an arena pool's slots held that way at once; promotions past it "
        "are not held, so stores always find room.",
    )
    clean_reserve: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="Share of the slots each arena pool can reach (free extents it may still "
        "take included) kept free or already in lmdb, so stores find a victim without waiting. "
        "Beside a busy engine kvtierd writes only what keeps this share; with none busy, "
        "everything.",
    )
    draft_grace_s: float = Field(
        3600.0,
        ge=0.0,
        description="After a draft swap, how long the old revision's chunks are kept (evicted "
        "first, and a fill source for the new revision) before they are deleted from lmdb and "
        "the object store.",
    )
    integrity_window_s: float = Field(
        300.0,
        gt=0.0,
        description="The window over which chunks failing verification are counted per tier, "
        "for integrity_unhealthy_failures.",
    )
    integrity_unhealthy_failures: int = Field(
        20,
        ge=1,
        description="A tier with this many chunks failing verification (kvtierd's own checks "
        "and engines' reports it confirmed) within integrity_window_s is unhealthy: in `kvtier "
        "health` and kvtier_tier_healthy, and (lmdb, the object store) neither read nor written, "
        "until the window holds fewer.",
    )
    background_nice: int = Field(
        DEFAULT_NICE,
        ge=0,
        le=19,
        description="The nice value (Linux, per thread) of the tiers' background threads: "
        "write-back, uploads, downloads, promotion ahead of a load and maintenance sweeps. "
        "They share the cores with the engine's scheduler, API server and detokenizer and with "
        "the threads answering lookups, leases and loads, which keep the process's priority; "
        "under contention those get the CPU first. 0 (the default): no lower; try 10 where "
        "the tiers' uploads and write-back visibly slow the engine's own CPU work.",
    )


class Admission(StrEnum):
    ALL = "all"
    HITS = "hits"


# Words in a config key that would hold a static secret; such a key (not one of the section's
# own) is refused with a pointer to workload identity.
_STATIC_CREDENTIAL_HINTS = (
    "key",
    "secret",
    "token",
    "credential",
    "password",
    "passwd",
    "private",
    "auth",
    "signature",
)


class ObjectStoreConfig(ConfigSection):
    url: str | None = Field(
        None,
        description="s3://bucket/prefix, gs://bucket/prefix or file:///path; unset: no object "
        "tier. Credentials come from the SDK's default chain (IRSA, pod identity, GKE Workload "
        "Identity, workload identity federation), never from this file.",
    )
    index_path: Path = Field(
        default_factory=lambda: default_state_dir() / "objindex",
        description="LMDB environment indexing the chunks known to be in the store.",
    )
    index_map_bytes: ByteSize = Field(
        ByteSize(1 << 30), description="Largest size the index environment may grow to."
    )
    pack_target_bytes: ByteSize = Field(
        ByteSize(8 * MiB),
        description="Consecutive chunks of one prefix are packed into objects of about this size "
        "(requests cost milliseconds each; 8 MiB objects are much cheaper per byte). 0: one "
        "object per chunk.",
    )
    pack_linger_ms: float = Field(
        50.0, ge=0, description="How long a part-filled pack waits for more chunks before upload."
    )
    upload_queue_chunks: int = Field(
        1024, ge=1, description="Bound on chunks waiting for upload; beyond it work is dropped."
    )
    upload_concurrency: int = Field(8, ge=1, le=256, description="Uploads in flight at once.")
    reupload_max_chunks: int = Field(
        100_000,
        ge=0,
        description="Chunks lmdb held at start and the index lacks (uploads queued or failed "
        "when the daemon stopped) offered for upload again, at most; 0: none.",
    )
    reupload_chunks_per_s: float = Field(
        200.0, gt=0, description="Rate at which those chunks are offered again."
    )
    download_concurrency: int = Field(
        8, ge=1, le=256, description="Downloads (promotions and probes) in flight at once."
    )
    codec: Codec = Field(
        Codec.NONE,
        description=CODEC_DESCRIPTION.format(verb="uploaded")
        + " A chunk lmdb holds in another codec is stored again for the store on upload.",
    )
    admission: Admission = Field(
        Admission.ALL,
        description="all: upload every chunk written back to lmdb; hits: only chunks hit at "
        "least admission_min_hits times.",
    )
    admission_min_hits: int = Field(2, ge=1, description="Hits needed with admission: hits.")
    request_timeout_s: float = Field(10.0, gt=0, description="Timeout of one request.")
    retries: int = Field(3, ge=0, description="Retries of a failed request.")
    backoff_s: float = Field(
        0.1, gt=0, description="First retry delay; doubled each time, with full jitter."
    )
    breaker_failures: int = Field(
        5, ge=1, description="Consecutive failures that open the circuit breaker."
    )
    breaker_reset_s: float = Field(
        5.0, gt=0, description="How long the open breaker refuses requests before one trial."
    )
    lookup_budget_ms: float = Field(
        20.0,
        ge=0,
        description="Longest a lookup waits for probes of chunks other nodes uploaded; past it "
        "the caller is told to ask again. The engine's step never waits on it: the connector's "
        "lookups from inside it leave the probe running and ask again later.",
    )
    probe_chunks: int = Field(
        4, ge=0, description="Chunks past the known prefix probed in the store per lookup."
    )
    budget_bytes: ByteSize | None = Field(
        None,
        description="Bytes this node keeps in the store, least recently used dropped first; "
        "unset: unbounded (use bucket lifecycle rules and `kvtier gc`).",
    )
    retention_s: float = Field(
        7 * 86400.0, gt=0, description="`kvtier gc` deletes objects older than this."
    )
    allow_static_keys: bool = Field(
        False,
        description="Let the SDK's default chain use long-lived keys (a service-account key "
        "file, AWS_ACCESS_KEY_ID, a shared credentials file): logged as a warning. Off: "
        "kvtierd refuses to start with them.",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_static_credentials(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for key in data:
                if key in cls.model_fields:
                    continue
                if any(hint in str(key).lower() for hint in _STATIC_CREDENTIAL_HINTS):
                    raise ValueError(
                        f"static credentials ({key}) are refused: kvtier reaches the object "
                        "store through workload identity only. On EKS use IRSA or EKS Pod "
                        "Identity (AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE); on GKE use "
                        "Workload Identity, or workload identity federation with an "
                        "external_account file in GOOGLE_APPLICATION_CREDENTIALS"
                    )
        return data
