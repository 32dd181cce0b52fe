"""The client of kvtierd's admin API."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from kvtier.api.v1 import admin_pb2, admin_pb2_grpc
from kvtier.core.errors import TierUnavailableError
from kvtier.core.status import error_from
from kvtier.rpc.calls import CHANNEL_OPTIONS, call

R = TypeVar("R")


@dataclass(frozen=True)
class ClientTLS:
    """How a client reaches an admin API served over TLS."""

    ca: bytes | None = None
    """The CA that signed the server's certificate (PEM); None trusts the system's CAs."""
    client: tuple[bytes, bytes] | None = None
    """The client's (key, certificate) (PEM), for mTLS."""
    server_name: str | None = None
    """The name the server's certificate must carry, where it is not the host dialled."""


def open_channel(address: str, tls: ClientTLS | None = None) -> grpc.Channel:
    """A channel to the admin API (or its health service): plaintext, or TLS as ``tls`` says."""
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    key, cert = tls.client if tls.client is not None else (None, None)
    creds = grpc.ssl_channel_credentials(tls.ca, key, cert)
    options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, creds, options=options)


def bearer(token: str | None) -> list[tuple[str, str]]:
    """The call metadata that carries ``token``; none without one."""
    return [("authorization", f"Bearer {token}")] if token else []


class AdminClient:
    """The admin API, with a bearer token and, optionally, TLS."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        tls: ClientTLS | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.target = address
        self._channel = open_channel(address, tls)
        self._tls = tls is not None
        self._stub = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._metadata = bearer(token)
        self._timeout = timeout_s

    def _rpc(self, method: Callable[..., R], request: Any) -> R:
        try:
            return call(
                self.target, method, request, timeout=self._timeout, metadata=self._metadata
            )
        except TierUnavailableError as exc:
            if not self._tls:
                raise
            raise TierUnavailableError(
                f"{exc}; over TLS a refused handshake looks the same: check the CA, and the "
                "client certificate and key where kvtierd asks for one"
            ) from None

    def stats(self) -> admin_pb2.StatsResponse:
        return self._rpc(self._stub.Stats, admin_pb2.StatsRequest())

    def evict(self, **filters: Any) -> dict[str, int]:
        return dict(self._rpc(self._stub.Evict, admin_pb2.EvictRequest(**filters)).evicted)

    def pin(self, keys: Sequence[bytes]) -> int:
        return self._rpc(self._stub.Pin, admin_pb2.PinRequest(keys=keys)).keys

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self._rpc(self._stub.Unpin, admin_pb2.PinRequest(keys=keys)).keys

    def set_quota(self, replica: str, pool: str, nbytes: int) -> None:
        request = admin_pb2.SetQuotaRequest(replica=replica, pool=pool, bytes=nbytes)
        self._rpc(self._stub.SetQuota, request)

    def drain(self, timeout_s: float = 60.0) -> admin_pb2.DrainResponse:
        return self._rpc(self._stub.Drain, admin_pb2.DrainRequest(timeout_s=timeout_s))

    def verify(self, tier: str = "") -> Iterator[admin_pb2.VerifyProgress]:
        return self._stream(self._stub.Verify, admin_pb2.VerifyRequest(tier=tier))

    def warmup(
        self,
        namespace: bytes = b"",
        max_chunks: int = 0,
        *,
        object_index: bool = False,
        fetch: bool = False,
    ) -> Iterator[admin_pb2.WarmupProgress]:
        request = admin_pb2.WarmupRequest(
            namespace=namespace, max_chunks=max_chunks, object_index=object_index, fetch=fetch
        )
        return self._stream(self._stub.Warmup, request)

    def gc(
        self, retention_s: float | None = None, dry_run: bool = False
    ) -> Iterator[admin_pb2.GcProgress]:
        """Delete old objects from the object store; None keeps the daemon's retention."""
        request = admin_pb2.GcRequest(retention_s=retention_s, dry_run=dry_run)
        return self._stream(self._stub.Gc, request)

    def draft_swap_begin(
        self, revision: str, draft_model: str = ""
    ) -> admin_pb2.DraftSwapBeginResponse:
        request = admin_pb2.DraftSwapBeginRequest(revision=revision, draft_model=draft_model)
        return self._rpc(self._stub.DraftSwapBegin, request)

    def draft_swap_commit(self, swap_id: str) -> admin_pb2.DraftSwapCommitResponse:
        request = admin_pb2.DraftSwapCommitRequest(swap_id=swap_id)
        return self._rpc(self._stub.DraftSwapCommit, request)

    def locate(
        self, model: str, block_hashes: Sequence[bytes], tenant: str = ""
    ) -> admin_pb2.LocateResponse:
        request = admin_pb2.LocateRequest(model=model, block_hashes=block_hashes, tenant=tenant)
        return self._rpc(self._stub.Locate, request)

    def quarantines(self) -> list[admin_pb2.QuarantinedNamespace]:
        response = self._rpc(self._stub.ListQuarantines, admin_pb2.ListQuarantinesRequest())
        return list(response.quarantined)

    def lift_quarantine(self, namespace: bytes) -> bool:
        request = admin_pb2.LiftQuarantineRequest(namespace=namespace)
        return bool(self._rpc(self._stub.LiftQuarantine, request).lifted)

    def _stream(self, method: Callable[..., Iterator[R]], request: Any) -> Iterator[R]:
        stream = call(self.target, method, request, timeout=None, metadata=self._metadata)
        try:
            yield from stream
        except grpc.RpcError as exc:
            raise error_from(exc.code(), exc.details() or "") from None

    def close(self) -> None:
        self._channel.close()
