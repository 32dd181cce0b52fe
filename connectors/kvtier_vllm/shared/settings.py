"""The connectors' own settings, from ``kv_connector_extra_config`` and
``ec_connector_extra_config``, validated once."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.core.errors import ConfigError
from kvtier.core.keys import REVISION_PATTERN, TENANT_PATTERN
from kvtier.rpc import Deadlines

Settings = TypeVar("Settings", bound="TiersConfig")


class Mode(StrEnum):
    EMBEDDED = "embedded"
    SIDECAR = "sidecar"


class LoadMode(StrEnum):
    """How a request's hit is loaded into vLLM's blocks."""

    AUTO = "auto"
    ASYNC = "async"
    SYNC = "sync"


class FillPolicy(StrEnum):
    """How the draft pages of a target hit are set where the current draft revision has no
    chunk for them."""

    PREVIOUS = "previous"
    ZEROS = "zeros"


class LoadPolicy(StrEnum):
    """Which part of a hit is loaded: every chunk, or the prefix measured to beat
    recomputing it."""

    ALWAYS = "always"
    MEASURED = "measured"


class TiersConfig(BaseModel):
    """What every kvtier connector of vLLM (KV and encoder cache) sets the same way: how it
    reaches the tiers, names its tenant and replica, verifies its hits and waits for them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode = Field(
        Mode.EMBEDDED,
        description="embedded: the tiers run inside vLLM's scheduler process; "
        "sidecar: kvtierd serves them over its unix socket.",
    )
    kvtier_config: Path | None = Field(
        None, description="Embedded mode: kvtier YAML file (KVTIER_ variables apply as well)."
    )
    write_through: bool = Field(
        False,
        description="Embedded mode: write each stored chunk to lmdb right away. Otherwise "
        "chunks reach lmdb while the engine is idle, past writeback_backlog_mib, and when the "
        "connector shuts down (the arena ends with the engine process): writing next to a "
        "forward costs the engine's own CPU time.",
    )
    writeback_idle_ms: int = Field(
        100,
        ge=1,
        description="Embedded mode without write_through: the engine counts as idle, and "
        "chunks are written to lmdb, once it has had no request for this long.",
    )
    writeback_backlog_mib: int = Field(
        256,
        ge=0,
        description="Embedded mode without write_through: most MiB of chunks held only in the "
        "arena while the engine is busy; past it they are written anyway, so that a shutdown "
        "(vLLM gives an engine process 5 s) writes the rest in time and a crash loses little.",
    )
    socket_path: Path | None = Field(
        None, description="Sidecar mode: kvtierd's socket (default: server.socket_path)."
    )
    tenant: str = Field(
        "default",
        pattern=f"^{TENANT_PATTERN}$",
        description="Tenant in the namespace (and a folder of object-store names): 1-64 of "
        "[A-Za-z0-9._-], not starting with '.'.",
    )
    replica_id: str = Field(
        "", description="Replica id (default: dp<data_parallel_index>), for budgets and metrics."
    )
    promote_wait_ms: int = Field(
        1000,
        ge=0,
        description="How long a request may wait (asked again each step, never blocking) for "
        "its chunks to be promoted into the arena before it loads only what the arena holds.",
    )
    recompute_wait_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="A request may wait longer than promote_wait_ms for its hit (promotions, "
        "a probe of the object store): up to this share of the time the engine would take to "
        "recompute the hit, as it measures its prefill; what comes from the object store waits "
        "only this share once measured. A slow store then costs at most that much more than "
        "recomputing, and a hit is not given up for far less than it saves.",
    )
    lmdb_loads: bool = Field(
        True,
        description="Load hits held in lmdb (KV chunks, encoder outputs) straight from lmdb's "
        "map in vLLM's processes, verified and decoded there, with no arena slot; they are "
        "promoted into the arena first otherwise. Sidecar mode needs lmdb's directory "
        "(lmdb.path) mounted here as kvtierd sees it, readable and its lock file writable; "
        "where it cannot be opened, the connector logs why at start and promotes instead.",
    )
    verify_sample_rate: float = Field(
        0.001,
        ge=0,
        le=1,
        description="Share of requests with a hit that are served as a miss instead: vLLM "
        "computes the prefix, and the chunks the hit would have loaded are compared with it. A "
        "chunk off by more than verify_max_error quarantines its namespace (no more hits from "
        "it). At most one request per step is sampled, except at 1.0, which checks every hit.",
    )
    verify_max_error: float = Field(
        0.05,
        gt=0,
        description="The largest relative error (norm of the difference over the norm of the "
        "recomputed KV, per layer; a state chunk's per tensor) of a chunk that still matches.",
    )
    verify_seed: int | None = Field(
        None, description="Seeds the choice of sampled requests (unset: a random seed)."
    )

    lookup_deadline_ms: float = Field(
        50,
        gt=0,
        description="Sidecar mode: the longest a lookup's calls to kvtierd (lookup, leases, "
        "promotion) may take. A call that takes longer is a miss (a lookup finds nothing, a "
        "store is skipped); breaker_misses of them in a row, or a daemon gone, open a breaker: "
        "the engine serves without kvtier (lookups miss at once, stores are skipped) until a "
        "heartbeat every probe_interval_ms is answered again.",
    )
    lookup_wait_ms: float = Field(
        0,
        ge=0,
        description="Sidecar mode: how long the scheduler may wait, at each ask, for kvtierd to "
        "answer a new request's lookup, when the arena does not hold the request's first chunk "
        "(most likely a miss). Unanswered, the request is asked again next step and the running "
        "ones go on: with 0 they never wait for it, and a miss's first token comes a step later. "
        "A step that schedules nothing waits for every such answer (up to lookup_deadline_ms).",
    )
    store_deadline_ms: float = Field(
        100,
        gt=0,
        description="Sidecar mode: the longest a reservation, commit, abort, release or "
        "chunk-events call may take (as lookup_deadline_ms).",
    )
    register_deadline_ms: float = Field(
        2000,
        gt=0,
        description="Sidecar mode: the longest registering with kvtierd may take: at start, "
        "then only off the engine's steps (a new session after a restart, a reconnect).",
    )
    probe_deadline_ms: float = Field(
        100, gt=0, description="Sidecar mode: the heartbeat that closes an open breaker."
    )
    breaker_misses: int = Field(
        3,
        ge=1,
        description="Sidecar mode: calls in a row that miss their deadline before the breaker "
        "opens (a daemon gone or a lost session opens it at once).",
    )
    probe_interval_ms: float = Field(
        500,
        gt=0,
        description="Sidecar mode: how often kvtierd is heartbeated (at most), and probed while "
        "the breaker is open.",
    )

    def deadlines(self) -> Deadlines:
        """The sidecar client's deadlines, in seconds."""
        return Deadlines(
            lookup_s=self.lookup_deadline_ms / 1000,
            store_s=self.store_deadline_ms / 1000,
            register_s=self.register_deadline_ms / 1000,
            probe_s=self.probe_deadline_ms / 1000,
            probe_every_s=self.probe_interval_ms / 1000,
            misses_to_open=self.breaker_misses,
        )


class ConnectorConfig(TiersConfig):
    """``kv_connector_extra_config`` of `KVTierConnector`."""

    blocks_per_chunk: int = Field(1, ge=1, description="vLLM blocks per stored chunk.")
    load_mode: LoadMode = Field(
        LoadMode.AUTO,
        description="async: a request with a hit waits for its load while the running "
        "requests go on; the workers copy it in the background and vLLM schedules it once it "
        "landed (a failed chunk is recomputed from there), a step later at least. sync: the "
        "load runs inside the step that first schedules the request, and every running request "
        "waits for it. auto: per request, sync where the load's expected time (kvtier's "
        "measured cost per tier) times the requests it would hold up, itself included, is "
        "shorter than the step an async load waits through (this engine's steps, measured); "
        "async otherwise, with nothing running, and until both are measured. Models with "
        "several KV-cache groups always load asynchronously.",
    )
    hidden_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="Captured hidden states (extract_hidden_states): stored in the dtype "
        "captured (auto), or as fp8 e4m3 with a float32 scale per token and layer (fp8: about "
        "half the bytes of bf16, a quarter of float32). Read back in the captured dtype.",
    )
    model_revision: str = Field(
        "",
        pattern=f"^{REVISION_PATTERN}$",
        description="Names the weights (target and draft) in the namespace; change it whenever "
        "they change. Unset: a fingerprint of the checkpoints vLLM loaded.",
    )
    draft_fill: FillPolicy = Field(
        FillPolicy.PREVIOUS,
        description="Draft pages of a target hit that the current draft revision has no chunk "
        "for: previous (the last revision's chunk, zeros where it has none) or zeros.",
    )
    draft_check_steps: int = Field(
        16,
        ge=0,
        description="Fingerprint the draft weights every this many steps, to notice a draft "
        "swap made without kvtier (0: only at start, after reset_cache() and before draft "
        "transfers).",
    )
    draft_check_transfers: bool = Field(
        True,
        description="Fingerprint the draft weights before every step that loads or stores "
        "draft chunks, so that none is used under the wrong draft revision.",
    )
    load_policy: LoadPolicy = Field(
        LoadPolicy.MEASURED,
        description="measured: load only the prefix of a hit whose load is expected to take "
        "less than recomputing it, from the costs kvtier measures (each tier's load time, a "
        "fixed part per load included, and the engine's prefill), after the asynchronous loads "
        "already out and, for a load in the background, the step its request then waits "
        "(shared over the step's requests, as a recompute holds them all up); the whole hit "
        "while a cost is not measured yet. always: load every hit.",
    )
    window_checkpoint_tokens: int = Field(
        0,
        ge=0,
        description="Hybrid models: also store the sliding window before every multiple of "
        "this many tokens (rounded down to whole chunks), so that a prompt sharing only a "
        "prefix of a stored one (a system prompt) hits at the last such boundary. Each "
        "boundary costs one window of sliding-window chunks; 0: only the window before the "
        "end of each prompt's hit.",
    )


def parse_section(model: type[Settings], extra: dict[str, Any] | None, section: str) -> Settings:
    """``extra`` validated as ``model``; a `ConfigError` names ``section``'s first bad key."""
    try:
        return model.model_validate(extra or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise ConfigError(f"{section}.{key}", first["msg"]) from exc


def parse(extra: dict[str, Any] | None) -> ConnectorConfig:
    return parse_section(ConnectorConfig, extra, "kv_connector_extra_config")
