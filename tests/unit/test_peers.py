"""Peer tickets and tenant access, on real unix sockets: a ticket carries the credentials the
kernel reports for the process that read it, opens one session, expires, and the tickets kept
are bounded; a tenant is open to the uids and groups `server.tenants` names."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.config import ServerConfig
from kvtier.core.errors import PermissionDeniedError
from kvtier.core.peers import peer_socket_path
from kvtier.rpc.session import read_ticket
from kvtier.server import peers
from kvtier.server.peers import Peer, TenantPolicy, TicketOffice
from tests.support import HandClock


@pytest.fixture
def clock() -> HandClock:
    return HandClock()


@pytest.fixture
def office(tmp_path: Path, clock: HandClock) -> Iterator[TicketOffice]:
    office = TicketOffice(tmp_path / "kvtierd.sock", None, ttl_s=10.0, clock=clock)
    office.start()
    yield office
    office.close()


def _ticket(office: TicketOffice) -> str:
    ticket = read_ticket(office.path, 5.0)
    assert ticket
    return ticket


def test_a_ticket_stands_for_the_reader_as_the_kernel_says_and_opens_once(
    office: TicketOffice,
) -> None:
    assert office.path == peer_socket_path(office.path.with_suffix(""))
    assert office.path.stat().st_mode & 0o777 == 0o660
    ticket = _ticket(office)
    assert office.redeem(ticket) == Peer(
        os.getpid(), os.geteuid(), os.getegid(), frozenset(os.getgroups())
    )
    with pytest.raises(PermissionDeniedError, match="unknown, spent or expired"):
        office.redeem(ticket)
    with pytest.raises(PermissionDeniedError, match="no peer ticket"):
        office.redeem("")


def test_a_ticket_expires_and_the_unredeemed_ones_are_bounded(
    office: TicketOffice, clock: HandClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    late = _ticket(office)
    clock.now += 11.0
    with pytest.raises(PermissionDeniedError, match="within 10 s"):
        office.redeem(late)

    monkeypatch.setattr(peers, "MAX_TICKETS", 2)
    oldest, *kept = (_ticket(office) for _ in range(3))
    with pytest.raises(PermissionDeniedError):
        office.redeem(oldest)
    assert all(office.redeem(ticket).pid == os.getpid() for ticket in kept)


def test_no_ticket_comes_from_a_socket_that_is_not_there(tmp_path: Path) -> None:
    assert read_ticket(tmp_path / "kvtierd.sock.peer", 1.0) == ""


def _peer(uid: int, gid: int, *groups: int) -> Peer:
    return Peer(1, uid, gid, frozenset(groups))


def test_unset_tenants_open_the_default_tenant_to_kvtierd_and_the_sockets_group() -> None:
    policy = TenantPolicy.of(ServerConfig(), socket_gid=4242)
    policy.check(_peer(os.geteuid(), 1), "default")
    policy.check(_peer(5000, 4242), "default")
    policy.check(_peer(5000, 1, 7, 4242), "default")  # a supplementary group
    with pytest.raises(PermissionDeniedError, match="tenant 'default' is not open"):
        policy.check(_peer(5000, 1, 7), "default")
    with pytest.raises(PermissionDeniedError, match="tenant 'other' is not open"):
        policy.check(_peer(os.geteuid(), 4242), "other")


def test_named_tenants_are_open_to_the_uids_and_groups_named_only() -> None:
    tenants = {"a": {"uids": [10]}, "b": {"gids": [20]}}
    policy = TenantPolicy.of(ServerConfig.model_validate({"tenants": tenants}), socket_gid=None)
    policy.check(_peer(10, 1), "a")
    policy.check(_peer(11, 20), "b")
    policy.check(_peer(11, 1, 20), "b")
    for peer, tenant in [(_peer(10, 1), "b"), (_peer(11, 20), "a"), (_peer(0, 0), "default")]:
        with pytest.raises(PermissionDeniedError):
            policy.check(peer, tenant)


def test_a_tenant_name_that_could_never_be_registered_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="tenants must be"):
        ServerConfig.model_validate({"tenants": {"a/b": {"uids": [1]}}})
