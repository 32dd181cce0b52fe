"""Who a data-plane client is, as the kernel says, and which tenants that lets it use.

`TicketOffice` serves the peer socket (`kvtier.core.peers`): it reads each connecting process's
credentials and hands it a ticket that stands for them; `RegisterSession` redeems the ticket.
`TenantPolicy` maps those credentials to the tenants of `server.tenants`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.config import ServerConfig
from kvtier.core.config_server import TenantAccess
from kvtier.core.errors import ConfigError, PermissionDeniedError
from kvtier.core.peers import TICKET_TTL_S, peer_socket_path

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
MAX_TICKETS = 4096
"""Tickets not yet redeemed; past it the oldest is dropped (its client asks for another)."""
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+; not named by every Python
_MAX_GROUPS_BYTES = 1024  # the most getsockopt reads from Python: 256 groups
_UCRED = struct.Struct("3i")  # pid, uid, gid
_MAX_UNIX_PATH = 107  # sun_path's 108 bytes, with its NUL
_ACCEPT_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class Peer:
    """A client process's credentials when it connected, as the kernel reported them."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]
    """Its supplementary groups."""

    def __str__(self) -> str:
        return f"uid {self.uid}, gid {self.gid}, pid {self.pid}"


def peer_of(conn: socket.socket) -> Peer:
    pid, uid, gid = _UCRED.unpack(
        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _MAX_GROUPS_BYTES)
        groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError as exc:  # more groups than fit, or an older kernel: its primary group only
        log.warning("cannot read the supplementary groups of pid %d: %s", pid, exc.strerror)
        groups = frozenset()
    return Peer(pid, uid, gid, groups)


class TicketOffice:
    """The peer socket, and the tickets handed out there and not yet redeemed (bounded, each
    for `TICKET_TTL_S`)."""

    def __init__(
        self,
        socket_path: Path,
        gid: int | None,
        ttl_s: float = TICKET_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = peer_socket_path(socket_path)
        if len(os.fsencode(self.path)) > _MAX_UNIX_PATH:
            raise ConfigError(
                "server.socket_path",
                f"{self.path} (the peer socket beside it) is longer than a unix socket's "
                f"{_MAX_UNIX_PATH} bytes: choose a shorter path",
            )
        self._gid = gid
        self._ttl_s = ttl_s
        self._clock = clock
        self._tickets: OrderedDict[str, tuple[Peer, float]] = OrderedDict()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen, mode 0660 and the socket's group from the first moment, and serve."""
        self._remove_stale()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o117)
        try:
            listener.bind(str(self.path))
        except OSError:
            listener.close()
            raise
        finally:
            os.umask(old_umask)
        self._listener = listener
        if self._gid is not None:
            try:
                os.chown(self.path, -1, self._gid)
            except OSError as exc:
                raise ConfigError(
                    "server.group", f"cannot give {self.path} group {self._gid}: {exc.strerror}"
                ) from exc
        listener.settimeout(_ACCEPT_POLL_S)
        listener.listen(128)
        self._thread = threading.Thread(target=self._serve, name="kvtier-peers", daemon=True)
        self._thread.start()

    def _remove_stale(self) -> None:
        """A peer socket left by a dead daemon (the data-plane socket was found stale first)."""
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise ConfigError("server.socket_path", f"{self.path} exists and is not a socket")
        self.path.unlink()

    def _serve(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopped.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopped.is_set():
                    return
                log.exception("accepting on %s failed; accepting again", self.path)
                time.sleep(_ACCEPT_POLL_S)
                continue
            with conn:
                try:
                    conn.settimeout(1.0)
                    conn.sendall(self._issue(peer_of(conn)).encode() + b"\n")
                except OSError as exc:  # the client left: its ticket expires unused
                    log.debug("handing a ticket out failed: %s", exc)

    def _issue(self, peer: Peer) -> str:
        ticket = secrets.token_hex(16)
        with self._lock:
            self._tickets[ticket] = (peer, self._clock() + self._ttl_s)
            while len(self._tickets) > MAX_TICKETS:
                self._tickets.popitem(last=False)
        return ticket

    def redeem(self, ticket: str) -> Peer:
        """The credentials ``ticket`` stands for; it is spent. PermissionDeniedError for a
        ticket missing, unknown, spent or expired."""
        if not ticket:
            raise PermissionDeniedError(
                f"no peer ticket: read one from {self.path} and send it as the "
                "'kvtier-peer-ticket' metadata of RegisterSession"
            )
        with self._lock:
            held = self._tickets.pop(ticket, None)
        if held is None or held[1] < self._clock():
            raise PermissionDeniedError(
                f"the peer ticket is unknown, spent or expired (a ticket opens one session "
                f"within {self._ttl_s:.0f} s): read a new one from {self.path}"
            )
        return held[0]

    def close(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        if self._thread is not None:
            self._thread.join(2 * _ACCEPT_POLL_S)


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """Which credentials may register which tenant's pools."""

    access: Mapping[str, TenantAccess]

    @classmethod
    def of(cls, cfg: ServerConfig, socket_gid: int | None) -> TenantPolicy:
        """`server.tenants`; unset, the default tenant for kvtierd's user and the socket's
        group (kvtierd's own when `server.group` is unset): whoever the socket admits."""
        if cfg.tenants:
            return cls(dict(cfg.tenants))
        group = os.getegid() if socket_gid is None else socket_gid
        own = TenantAccess(uids=[os.geteuid()], gids=[group])
        return cls({DEFAULT_TENANT: own})

    def check(self, peer: Peer, tenant: str) -> None:
        access = self.access.get(tenant)
        if access is not None and (
            peer.uid in access.uids or not peer.groups.union([peer.gid]).isdisjoint(access.gids)
        ):
            return
        log.warning("refused tenant %r to a client of %s", tenant, peer)
        raise PermissionDeniedError(
            f"tenant {tenant!r} is not open to this client ({peer}): kvtierd's "
            "server.tenants names the users and groups of each tenant"
        )
