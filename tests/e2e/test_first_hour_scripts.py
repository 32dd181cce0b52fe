"""The scripts a new user runs first, run as they are: the demonstration, and the GPU check's
end-to-end part on vLLM's CPU build (the same script a GPU node runs on CUDA)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cpu_patches import skip_without_fp8_kv

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["TMPDIR"] = str(tmp_path)
    return env


def _run(argv: list[str], tmp_path: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_the_demo_prints_a_hit_and_where_it_came_from(tmp_path: Path) -> None:
    proc = _run(
        [
            sys.executable,
            "-m",
            "benchmarks.demo",
            "--cache-dir",
            str(tmp_path / "c"),
            "--tokens",
            "1200",
        ],
        tmp_path,
        240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = dict(
        re.findall(r"^(cold TTFT|hit TTFT|served from|same first token)\s+(.*)$", proc.stdout, re.M)
    )
    assert "(0 tokens not computed)" in lines["cold TTFT"]
    # the fresh engine computed only the last block: 1200 tokens less a partial 32-token block
    assert "(1184 tokens loaded from kvtier)" in lines["hit TTFT"]
    assert re.fullmatch(
        r"(the arena \(host memory\)|lmdb \(local disk\)): 1184 tokens", lines["served from"]
    ), lines["served from"]
    assert lines["same first token"] == "True"


def test_the_gpu_checks_end_to_end_part_passes_on_the_cpu_build(tmp_path: Path) -> None:
    skip_without_fp8_kv()  # its draft pool keeps fp8 KV
    proc = _run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_e2e",
            "--out",
            str(tmp_path / "e2e.json"),
            "--cache-dir",
            str(tmp_path / "c"),
        ],
        tmp_path,
        400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert result["device"] == "cpu"
    assert result["ok"] is True
    assert len(result["checks"]) == 17
    assert all(result["checks"].values()), result["checks"]
    assert result["draft_vs_target_bytes_per_chunk"] < 0.35


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_the_gpu_check_says_there_is_no_gpu_and_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh")],
        env={**_env(tmp_path), "OUT": str(tmp_path / "out")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert json.loads(proc.stdout) == {
        "gpu": False,
        "ok": False,
        "reason": "no NVIDIA GPU: nvidia-smi -L failed",
    }
