"""The admin API's secrets at the config level: the token kvtierd writes where none exists, token
file modes, tokens without TLS off the loopback, and the arena file's mode."""

from __future__ import annotations

import logging
import re
import stat
from pathlib import Path

import pytest

from kvtier.core.admin_token import token_path, write_new_token
from kvtier.core.config import ServerConfig, from_mapping, load_config
from kvtier.core.errors import ConfigError
from kvtier.server.daemon import admin_credentials


def _server(tmp_path: Path, mode: int = 0o600, **keys: object) -> ServerConfig:
    token = tmp_path / "admin.token"
    token.write_text("admin-secret\n")
    token.chmod(mode)
    return from_mapping({"server": {"admin_token_file": str(token), **keys}}).server


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_token_only_its_owner_reads_is_accepted(tmp_path: Path, mode: int) -> None:
    assert admin_credentials(_server(tmp_path, mode)) == ("admin-secret", None)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o660, 0o604, 0o610, 0o601])
def test_a_token_open_to_group_or_others_is_refused(tmp_path: Path, mode: int) -> None:
    cfg = _server(tmp_path, mode)
    with pytest.raises(ConfigError, match=f"mode {mode:04o}") as refused:
        admin_credentials(cfg)
    assert refused.value.key == "server.admin_token_file"
    assert str(refused.value).endswith(f"chmod 600 {cfg.admin_token_file}")


def test_the_mode_checked_is_the_token_file_behind_a_symlink(tmp_path: Path) -> None:
    # a Kubernetes secret is a symlink (0777) to its file
    cfg = _server(tmp_path, 0o600)
    assert cfg.admin_token_file is not None
    link = tmp_path / "token"
    link.symlink_to(cfg.admin_token_file)
    assert admin_credentials(cfg.model_copy(update={"admin_token_file": link}))[0]
    cfg.admin_token_file.chmod(0o644)
    with pytest.raises(ConfigError, match=re.escape(f"chmod 600 {link}")):
        admin_credentials(cfg.model_copy(update={"admin_token_file": link}))


@pytest.mark.parametrize("address", ["0.0.0.0:7461", "[::]:7461", "192.0.2.1:7461"])
def test_a_token_off_the_loopback_needs_tls(tmp_path: Path, address: str) -> None:
    with pytest.raises(ConfigError, match="would cross the network in clear") as refused:
        admin_credentials(_server(tmp_path, admin_address=address))
    assert "configure TLS (server.tls_cert_file and server.tls_key_file" in str(refused.value)
    assert "server.allow_insecure_token" in str(refused.value)


def test_a_token_over_tls_or_on_the_loopback_is_accepted(tmp_path: Path) -> None:
    cfg = _server(
        tmp_path,
        admin_address="0.0.0.0:7461",
        tls_cert_file=str(tmp_path / "c.pem"),
        tls_key_file=str(tmp_path / "k.pem"),
    )
    assert admin_credentials(cfg)[0]
    assert admin_credentials(_server(tmp_path, admin_address="127.0.0.1:7461"))[0]


def test_allow_insecure_token_accepts_it_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _server(tmp_path, admin_address="0.0.0.0:7461", allow_insecure_token=True)
    with caplog.at_level(logging.WARNING, logger="kvtier.server.daemon"):
        assert admin_credentials(cfg) == ("admin-secret", None)
    assert any("in clear" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_the_arena_file_mode_reads_as_octal_and_is_never_open_to_others(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text("arena:\n  file_mode: 0600\nserver:\n  group: engines\n")
    cfg = load_config(path, env={})
    assert (cfg.arena.file_mode, cfg.server.group) == (0o600, "engines")
    assert load_config(None, env={}).arena.file_mode == 0o660
    for mode in (0o664, 0o666, 0o770, 0o700):
        with pytest.raises(ConfigError, match=r"^arena: .*file_mode 0o[0-7]+ opens the arena"):
            from_mapping({"arena": {"file_mode": mode}})


def test_without_a_token_file_kvtierd_writes_one_only_its_user_reads_and_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    cfg = from_mapping({}).server
    path = token_path(cfg)
    assert path == tmp_path / "state" / "kvtier" / "admin.token"
    admin, read = admin_credentials(cfg)
    assert (admin, read) == (path.read_text().strip(), None)
    assert len(admin) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["admin.token"]  # no draft left behind
    assert admin_credentials(cfg)[0] == admin  # a restart keeps it
    assert not write_new_token(path)


def test_a_configured_token_file_that_does_not_exist_is_written(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "admin.token"
    cfg = from_mapping({"server": {"admin_token_file": str(path)}}).server
    assert admin_credentials(cfg)[0] == path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_under_mtls_without_a_token_file_there_is_no_token(tmp_path: Path) -> None:
    tls = {k: str(tmp_path / k) for k in ("tls_cert_file", "tls_key_file", "tls_client_ca_file")}
    assert token_path(from_mapping({"server": tls}).server) is None
    configured = {**tls, "admin_token_file": str(tmp_path / "t")}
    assert token_path(from_mapping({"server": configured}).server) == tmp_path / "t"
