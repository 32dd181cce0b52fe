"""S3 on this machine for the benchmarks: moto's S3/STS server in a subprocess, and the
environment a pod on EKS reaches S3 with (IRSA: a role and a web identity token, no keys)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

try:
    from benchmarks.common import die_with_parent
except ImportError:  # run as a script from benchmarks/
    from common import die_with_parent  # type: ignore[no-redef]

LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 30.0

# keys botocore would prefer over the web identity flow, or that would point it elsewhere
SCRUBBED_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL_STS",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
)


def jwt_like() -> str:
    def b64(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    now = int(time.time())
    claims = {"sub": "system:serviceaccount:kvtier:kvtierd", "iat": now, "exp": now + 3600}
    return f"{b64({'alg': 'RS256', 'typ': 'JWT'})}.{b64(claims)}.c2lnbmF0dXJl"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


class MotoServer:
    """``moto_server`` in its own process group on a free loopback port."""

    def __init__(self, log_path: Path) -> None:
        exe = Path(sys.executable).parent / "moto_server"
        found = str(exe) if exe.exists() else shutil.which("moto_server")
        if found is None:
            raise RuntimeError("moto_server not found; install moto[server]")
        self.exe = found
        self.log_path = log_path
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> MotoServer:
        for _attempt in range(3):  # the port may be taken between the probe and moto's bind
            self.port = free_port()
            with open(self.log_path, "ab") as out:
                self.proc = subprocess.Popen(
                    [self.exe, "-H", LOOPBACK, "-p", str(self.port)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            if self._wait_ready():
                return self
            self.stop()
        tail = self.log_path.read_bytes()[-2000:].decode(errors="replace")
        raise RuntimeError(f"moto_server did not start; log:\n{tail}")

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        return http_ready(self.url + "/moto-api/", self.proc, READY_TIMEOUT_S)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def http_ready(url: str, proc: subprocess.Popen[Any], timeout_s: float) -> bool:
    """Whether ``url`` answers HTTP (any status) within ``timeout_s``; False at once when
    ``proc``, the server, exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=1.0):
                return True
        except urllib.error.HTTPError as exc:
            exc.close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


@contextlib.contextmanager
def patched_env(values: dict[str, str], drop: Sequence[str] = ()) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (*values, *drop)}
    for key in drop:
        os.environ.pop(key, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def irsa_env(root: Path, endpoint: str) -> dict[str, str]:
    token = root / "web-identity-token"
    token.write_text(jwt_like())
    return {
        "AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/kvtier-bench",
        "AWS_WEB_IDENTITY_TOKEN_FILE": str(token),
        "AWS_ROLE_SESSION_NAME": "kvtier-bench",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(root / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(root / "no-aws-credentials"),
    }
