"""The sections of kvtier's configuration tree (`kvtier.core.config.KVTierConfig`): the arena and
its pools, lmdb, the tier manager, the object store and kvtierd's APIs. Every key has a default
and a description."""

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
    NonNegativeInt,
    field_validator,
    model_validator,
)

from kvtier.core.cpus import parse_cpu_list
from kvtier.core.keys import check_tenant
from kvtier.core.kvcodec import Codec

EvictionPolicyName = Literal["lru", "fifo"]
"""The eviction policies a tier can be configured with."""

MiB = 1 << 20
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


def _default_pools() -> dict[str, PoolConfig]:
    return {
        "target": PoolConfig(),
        "draft": PoolConfig(max_share=0.5),
        "hidden": PoolConfig(max_share=0.25),
        "encoder": PoolConfig(max_share=0.25),
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
    extent_bytes: ByteSize = Field(
        ByteSize(32 * MiB),
        description="Allocation unit handed to a pool; one slot size class per extent.",
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
        "back.",
    )
    eviction_policy: EvictionPolicyName = Field(
        "lru", description="Eviction policy by name (lru, fifo)."
    )
    max_slot_classes: int = Field(
        64,
        ge=1,
        description="Most slot size classes (distinct pool and chunk size pairs); a registration "
        "past it is RESOURCE_EXHAUSTED.",
    )
    pools: dict[str, PoolConfig] = Field(
        default_factory=_default_pools, description="Per-pool budgets, by pool name."
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> ArenaConfig:
        if self.min_slot_bytes <= 0 or self.extent_bytes < self.min_slot_bytes:
            raise ValueError("extent_bytes must be at least min_slot_bytes")
        if self.size_bytes is not None and self.size_bytes < self.extent_bytes:
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
        "the caller is told to ask again.",
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


class TenantAccess(ConfigSection):
    uids: list[NonNegativeInt] = Field(
        [], description="Users whose engines may register this tenant's pools."
    )
    gids: list[NonNegativeInt] = Field(
        [], description="Groups (primary or supplementary) whose members may."
    )


class ServerConfig(ConfigSection):
    socket_path: Path = Field(
        default_factory=lambda: default_state_dir() / "kvtierd.sock",
        description="Unix socket of the data plane (mode 0660); engines on this node connect here.",
    )
    group: str | int | None = Field(
        None,
        description="Group (name or gid) given the socket and the arena: the engines' group, "
        "whose members may call kvtierd and map the arena. Unset: kvtierd's own group.",
    )
    tenants: dict[str, TenantAccess] = Field(
        default_factory=dict,
        description="Who may register each tenant's pools, by the uid and groups the kernel "
        "reports for the client (a tenant named nowhere is refused). Empty: the tenant "
        "`default` alone, open to kvtierd's user and the socket's group.",
    )
    admin_address: str = Field(
        "127.0.0.1:7461",
        description="host:port of the admin API. A non-loopback address needs mTLS, or an "
        "admin token over TLS.",
    )
    metrics_address: str = Field(
        "127.0.0.1:7462", description="host:port of the Prometheus /metrics endpoint; '' disables."
    )
    admin_token_file: Path | None = Field(
        None, description="File holding the bearer token for every admin call."
    )
    read_token_file: Path | None = Field(
        None, description="File holding a bearer token that allows read-only admin calls only."
    )
    tls_cert_file: Path | None = Field(None, description="Admin API server certificate (PEM).")
    tls_key_file: Path | None = Field(None, description="Admin API server key (PEM).")
    tls_client_ca_file: Path | None = Field(
        None, description="CA that signs admin clients; set with the cert and key for mTLS."
    )
    allow_insecure_token: bool = Field(
        False,
        description="Serve a bearer token on a non-loopback admin address without TLS (the "
        "token crosses the network in clear): logged as a warning. Off: kvtierd refuses to "
        "start so.",
    )
    session_timeout_s: float = Field(
        10.0, gt=0, description="A session whose heartbeat lapses this long loses its leases."
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0, description="How often clients are told to send a heartbeat."
    )
    max_batch_keys: int = Field(
        65536, ge=1, description="Most keys or refs one call may carry; more is INVALID_ARGUMENT."
    )
    workers: int = Field(8, ge=1, description="Threads serving gRPC calls, per server.")
    max_sessions: int = Field(
        1024, ge=1, description="Most open data-plane sessions; more is RESOURCE_EXHAUSTED."
    )
    max_namespaces: int = Field(
        4096, ge=1, description="Most registered namespaces (pools); more is RESOURCE_EXHAUSTED."
    )
    reservation_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A reservation neither committed nor aborted this long is aborted by the "
        "daemon, so a lost commit never leaves its key unstorable.",
    )
    lease_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A lease held this long is released by the daemon, so a lost release (or a "
        "lost answer that granted it) never pins its chunk for good.",
    )
    max_session_leases: int = Field(
        1 << 18,
        ge=1,
        description="Most leases one session may hold at once; a call that would take more is "
        "RESOURCE_EXHAUSTED.",
    )
    drain_timeout_s: float = Field(
        60.0, ge=0, description="On SIGTERM, how long writing the arena back to lmdb may take."
    )
    cpus: frozenset[NonNegativeInt] | None = Field(
        None,
        min_length=1,
        description="CPUs kvtierd's threads run on, in Linux's list format ('1', '2-5,8'); "
        "unset: those it was started with. Give it the cores the engine does not bind its "
        "compute threads to (vLLM's CPU backend binds one thread per core), so that the "
        "movers never preempt them. A CPU kvtierd may not use refuses the start.",
    )

    @field_validator("cpus", mode="before")
    @classmethod
    def _parse_cpus(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            return frozenset((value,))
        if isinstance(value, str):
            return parse_cpu_list(value)
        return value

    @model_validator(mode="after")
    def _check_tls(self) -> ServerConfig:
        tls = (self.tls_cert_file, self.tls_key_file)
        if any(tls) and not all(tls):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and not all(tls):
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        if self.heartbeat_interval_s >= self.session_timeout_s:
            raise ValueError("heartbeat_interval_s must be shorter than session_timeout_s")
        for tenant in self.tenants:
            check_tenant("tenants", tenant)
        return self
