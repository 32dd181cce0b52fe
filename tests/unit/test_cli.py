from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_config_lists_every_key_with_its_value() -> None:
    out = run("config")
    assert out.returncode == 0, out.stderr
    assert "arena.size_bytes = None" in out.stdout
    assert "lmdb.high_water = 0.95" in out.stdout


def test_invalid_config_exits_non_zero_naming_the_key(tmp_path: Path) -> None:
    f = tmp_path / "kvtier.yaml"
    f.write_text("lmdb:\n  high_water: 3\n")
    out = run("config", "--check", "--config", str(f))
    assert out.returncode == 2
    assert "lmdb.high_water" in out.stderr
    f.write_text("lmdb:\n  high_water: 0.9\n")
    assert run("config", "--check", "--config", str(f)).returncode == 0
