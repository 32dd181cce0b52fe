"""`kvtier top` renders a frame from a live daemon's /metrics."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.operability.stack import ROOT, Stack
from tests.operability.test_prometheus import _wait_for_load


def test_top_renders_tiers_hit_ratios_bandwidth_and_evictions(stack: Stack) -> None:
    _wait_for_load(stack)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "top",
            "--once",
            "--interval",
            "2",
            "--metrics-url",
            stack.metrics_url,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    frame = out.stdout
    assert "\x1b[" not in frame  # no screen control when not on a terminal
    lines = frame.splitlines()
    assert lines[0].startswith(f"kvtier top  {stack.metrics_url}")
    assert "sessions 2" in lines[1]
    assert "object store healthy (breaker closed)" in lines[1]
    header = next(i for i, line in enumerate(lines) if line.startswith("TIER"))
    rows = {line.split()[0]: line for line in lines[header + 1 : header + 5]}
    assert set(rows) == {"cpu", "lmdb", "object", "all"}
    assert re.search(r"\d+\.\d%", rows["all"]), rows["all"]  # hit ratios, now and in total
    assert re.search(r"looked up [1-9][\d.]* chunks/s", frame), frame
    pools = next(i for i, line in enumerate(lines) if line.startswith("POOL"))
    assert lines[pools].split() == ["POOL", "CPU", "LMDB", "OBJECT", "CHUNKS"]
    target = next(line for line in lines[pools + 1 :] if line.startswith("target "))
    assert re.search(r"[1-9][\d.]* (KiB|MiB)", target), target  # what each pool holds, per tier
    store = next(line for line in lines if line.startswith("store "))
    assert re.search(r"[1-9][\d.]* (KiB|MiB)/s", store), store
    assert "queues  writeback" in frame
    evictions = frame.split("RECENT EVICTIONS\n", 1)[1]
    # the load empties the arena every few rounds, well within two seconds
    assert re.search(r"\d\d:\d\d:\d\d\s+cpu\s+admin\s+\+\d+", evictions), frame
