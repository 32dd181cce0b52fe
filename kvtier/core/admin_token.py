"""The admin API's bearer token in a file: where it lies, how kvtierd writes one at its first
start, and how it is read.

The file is ``server.admin_token_file``, by default ``admin.token`` in kvtierd's state directory.
Where it does not exist, kvtierd writes a random token there (mode 0600) and keeps it across
restarts, so a `kvtier` command run as the daemon's user finds it with no flag; delete the file
and restart to change it. Under mTLS without a token file, the client certificate alone
authenticates and there is no token.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

from kvtier.core.config_sections import default_state_dir
from kvtier.core.config_server import ServerConfig
from kvtier.core.errors import ConfigError

TOKEN_KEY = "server.admin_token_file"
DEFAULT_TOKEN_NAME = "admin.token"


def token_path(cfg: ServerConfig) -> Path | None:
    """The file of the admin token in effect; None where mTLS alone authenticates."""
    if cfg.admin_token_file is not None:
        return cfg.admin_token_file
    if cfg.tls_client_ca_file is not None:
        return None
    return default_state_dir() / DEFAULT_TOKEN_NAME


def write_new_token(path: Path) -> bool:
    """Write a fresh random token to ``path``, mode 0600, unless the file exists; whether it did.

    The token is written to a file of its own and linked into place, so that a reader (or a
    second daemon starting at the same time) finds the whole token or no file, never part of one.
    """
    if path.exists() or path.is_symlink():
        return False
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, draft = tempfile.mkstemp(dir=path.parent, prefix=".admin-token-")  # born 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(draft, path)
            except FileExistsError:
                return False  # another daemon wrote it first: that one is the token
        finally:
            os.unlink(draft)
    except OSError as exc:
        raise ConfigError(
            TOKEN_KEY, f"cannot write a new admin token to {path}: {exc.strerror}"
        ) from exc
    return True


def read_token(path: Path, key: str) -> str:
    """The token in ``path``; refuses a file that its group or others may open."""
    try:
        with path.open() as f:
            mode = os.fstat(f.fileno()).st_mode  # of the file read, through any symlink
            token = f.read().strip()
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from exc
    if mode & 0o077:
        raise ConfigError(
            key,
            f"{path} is open to its group or others (mode {mode & 0o777:04o}) and holds a "
            f"secret: chmod 600 {path}",
        )
    if not token:
        raise ConfigError(key, f"{path} is empty")
    return token
