"""How a data-plane client proves who it is: a peer ticket.

gRPC's Python server does not show a call's socket, so kvtierd cannot read the caller's
credentials on the data-plane socket itself. Beside it, kvtierd listens on a second unix socket,
the peer socket; each connection there is answered with a ticket, one line of hex, and closed.
kvtierd records the connecting process's uid, gid and groups as the kernel reports them
(``SO_PEERCRED``, ``SO_PEERGROUPS``) against the ticket. A client opens a session by sending the
ticket with `RegisterSession` (metadata `TICKET_METADATA`); the session then belongs to those
credentials, which decide the tenants its pools may name. A ticket opens one session, within
`TICKET_TTL_S`.
"""

from __future__ import annotations

from pathlib import Path

TICKET_METADATA = "kvtier-peer-ticket"
TICKET_TTL_S = 60.0
PEER_SOCKET_SUFFIX = ".peer"


def peer_socket_path(socket_path: Path) -> Path:
    """The peer socket beside the data-plane socket at ``socket_path``."""
    return socket_path.with_name(socket_path.name + PEER_SOCKET_SUFFIX)
