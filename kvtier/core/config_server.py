"""The ``server`` section: kvtierd's data-plane socket, its admin API and metrics, who may use which
tenant, and the bounds on sessions, namespaces, reservations and leases."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, NonNegativeInt, field_validator, model_validator

from kvtier.core.config_sections import ConfigSection, default_state_dir
from kvtier.core.cpus import parse_cpu_list
from kvtier.core.keys import check_tenant


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
        description="host:port of the admin API, which always authenticates (a bearer token, or "
        "mTLS). A non-loopback address needs mTLS, or the token over TLS.",
    )
    metrics_address: str = Field(
        "127.0.0.1:7462", description="host:port of the Prometheus /metrics endpoint; '' disables."
    )
    admin_token_file: Path | None = Field(
        None,
        description="File holding the bearer token for every admin call (mode 0600); where it "
        "does not exist, kvtierd writes a random token there at start and keeps it. Unset: "
        "admin.token in kvtierd's state directory, where `kvtier` commands run as its user find "
        "it; with mTLS, unset means no token: the client certificate alone authenticates.",
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
        4096, ge=1, description="Most namespaces in use at once; more is RESOURCE_EXHAUSTED."
    )
    namespace_idle_s: float = Field(
        3600.0,
        gt=0,
        description="A namespace no call used this long and no open session registered expires: "
        "it no longer counts against max_namespaces (nor its slot class against "
        "arena.max_slot_classes), and a call that uses it again brings it back.",
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
