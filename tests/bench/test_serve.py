"""`kvtier bench serve` and `kvtier bench plot` against a real vLLM server: what they report is
what the workload defines, and the server's own counters agree."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import BenchConfig, WorkloadSpec, run_sweep
from kvtier.bench.plot import build_figure, load_curves
from tests.bench.servers import BLOCK_SIZE, MAX_MODEL_LEN, FaultProxy, counters, free_port

pytestmark = pytest.mark.timeout(240)

D, Q, A, R = 64, 8, 4, 3
USERS = 2
WARMUP = 2
LEVELS = (1, 2)


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def serve_json(url: str, *args: str) -> dict[str, Any]:
    done = bench("serve", "--url", url, "--json", *args)
    assert done.returncode == 0, done.stderr
    document: dict[str, Any] = json.loads(done.stdout)  # stdout holds the document only
    return document


def multi_round_args() -> list[str]:
    return [
        "--workload", "multi-round",
        "--doc-tokens", str(D),
        "--question-tokens", str(Q),
        "--answer-tokens", str(A),
        "--rounds", str(R),
        "--requests", str(USERS * R),
        "--warmup", str(WARMUP),
        "--concurrency", ",".join(map(str, LEVELS)),
        "--seed", "3",
    ]  # fmt: skip


def prompt_len(r: int) -> int:
    return D + r * (Q + A) + Q


def expected_hits(r: int) -> int:
    """vLLM's prefix cache keeps full blocks: round r finds what round r-1 computed (its
    prompt and all but the last answer token), in whole blocks, short of its own last token."""
    if r == 0:
        return 0
    computed = min(prompt_len(r - 1) + A - 1, prompt_len(r) - 1)
    return computed // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def multi_round(server_url: str) -> tuple[dict[str, Any], dict[str, float]]:
    """One multi-round sweep, and the server's counter deltas over it."""
    before = counters(server_url)
    document = serve_json(server_url, *multi_round_args())
    after = counters(server_url)
    return document, {k: after[k] - before.get(k, 0.0) for k in after}


def test_multi_round_counts_match_the_workload(
    multi_round: tuple[dict[str, Any], dict[str, float]],
) -> None:
    document, server = multi_round
    per_user = sum(prompt_len(r) for r in range(R))
    warm = sum(prompt_len(r) for r in range(WARMUP))  # one warm-up user, WARMUP rounds
    levels = document["levels"]
    assert [lv["concurrency"] for lv in levels] == list(LEVELS)
    for level in levels:
        assert (level["requests"], level["ok"], level["errors"]) == (USERS * R, USERS * R, 0)
        records = level["records"]
        assert sorted(r["prompt_len"] for r in records) == sorted(
            prompt_len(r) for _ in range(USERS) for r in range(R)
        )
        assert all(r["prompt_tokens"] == r["prompt_len"] for r in records)
        assert all(r["output_tokens"] == A for r in records)
        assert all(r["cached_tokens"] == expected_hits(r["round"]) for r in records)
        # the level's own scrape excludes its warm-up
        counted = level["server"]
        assert counted["prompt_tokens"] == USERS * per_user
        assert counted["generation_tokens"] == USERS * R * A
        assert counted["requests_succeeded"] == USERS * R
        hits = USERS * sum(expected_hits(r) for r in range(R))
        assert level["hit_ratio"] == pytest.approx(hits / (USERS * per_user))
        assert level["hit_ratio_by_source"]["device"] == pytest.approx(level["hit_ratio"])
        assert level["output_tokens"] == USERS * R * A
        assert level["ttft_s"]["p50"] > 0
        assert level["ttft_s"]["p50"] <= level["ttft_s"]["p99"] <= level["latency_s"]["p99"]
        assert level["output_tps"] > 0
        assert level["output_tps_per_user"] > 0
        assert level["itl_s"]["p50"] > 0
        # where each first token's time went, from vLLM's histograms: no connector, no load wait
        parts = level["ttft_parts"]
        assert set(parts) == {"queue", "prefill", "ttft"}
        for part in parts.values():
            assert part["requests"] == USERS * R
            assert part["mean_s"] >= 0
            assert part["p90_s"] >= 0
    # the whole run, from the server's counters: measured and warm-up requests, nothing else
    n = len(LEVELS)
    assert server["vllm:request_success_total"] == n * (USERS * R + WARMUP)
    assert server["vllm:prompt_tokens_total"] == n * (USERS * per_user + warm)
    assert server["vllm:generation_tokens_total"] == n * (USERS * R + WARMUP) * A
    assert document["config"]["workload"]["kind"] == "multi-round"
    assert document["server"]["max_model_len"] == MAX_MODEL_LEN


def test_shared_prefix_hits_the_system_prompt(server_url: str) -> None:
    document = serve_json(
        server_url,
        "--workload", "shared-prefix",
        "--system-tokens", "64",
        "--suffix-tokens", "16",
        "--answer-tokens", "2",
        "--requests", "4",
        "--warmup", "1",
        "--concurrency", "2",
        "--seed", "4",
    )  # fmt: skip
    (level,) = document["levels"]
    assert level["server"]["prompt_tokens"] == 4 * 80
    assert all(r["cached_tokens"] == 64 for r in level["records"])
    assert level["hit_ratio"] == pytest.approx(64 / 80)


def test_no_reuse_never_hits(server_url: str) -> None:
    before = counters(server_url)
    document = serve_json(
        server_url,
        "--workload", "no-reuse",
        "--doc-tokens", "64",
        "--question-tokens", "8",
        "--answer-tokens", "2",
        "--requests", "5",
        "--warmup", "1",
        "--concurrency", "2",
        "--seed", "5",
    )  # fmt: skip
    after = counters(server_url)
    (level,) = document["levels"]
    assert level["hit_ratio"] == 0
    assert level["server"]["prompt_tokens"] == 5 * 72
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 6 * 72
    assert after["vllm:prompt_tokens_cached_total"] == before["vllm:prompt_tokens_cached_total"]


def test_python_api_returns_typed_results(server_url: str) -> None:
    spec = WorkloadSpec(kind="no-reuse", doc_tokens=32, question_tokens=4, answer_tokens=2, seed=6)
    run = run_sweep(BenchConfig(url=server_url, workload=spec, concurrency=(1,), requests=2))
    (level,) = run.levels
    assert (level.requests, level.ok, level.output_tokens) == (2, 2, 4)
    assert level.server.prompt_tokens == 2 * 36
    assert run.server.max_model_len == MAX_MODEL_LEN


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_two_runs(
    multi_round: tuple[dict[str, Any], dict[str, float]], server_url: str, tmp_path: Path
) -> None:
    first = tmp_path / "a.json"
    first.write_text(json.dumps(multi_round[0]))
    png = tmp_path / "b.png"
    # the second run also draws its own plot
    second = bench("serve", "--url", server_url, "--json", "--plot", str(png),
                   *multi_round_args()[:-2], "--seed", "8", "--concurrency", "1")  # fmt: skip
    assert second.returncode == 0, second.stderr
    (tmp_path / "b.json").write_text(second.stdout)
    assert png_size(png) == (1200, 480)

    out = tmp_path / "both.png"
    done = bench("plot", str(first), str(tmp_path / "b.json"), "--out", str(out),
                 "--labels", "run a", "run b")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert png_size(out) == (1200, 480)
    curves = load_curves([first, tmp_path / "b.json"], ["run a", "run b"])
    assert [c.concurrency for c in curves] == [list(LEVELS), [1]]
    figure = build_figure(curves)
    tput, ttft = figure.axes
    assert len(figure.axes) == 2
    assert [line.get_label() for line in tput.get_lines()] == ["run a", "run b"]
    assert len(ttft.get_lines()) == 4  # p50 and p99 per run


def test_plot_refuses_a_file_that_is_not_a_run(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"levels": [{"concurrency": 1}]}')
    done = bench("plot", str(bad), "--out", str(tmp_path / "x.png"))
    assert done.returncode == 1
    assert done.stderr.startswith("kvtier: x: not a `kvtier bench serve --json` document")


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_unreachable_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line_error(bench("serve", "--url", url, "--requests", "2"))
    assert line.startswith(f"kvtier: cannot reach {url}")


def test_errors_mid_run_are_counted_per_level(server_url: str) -> None:
    with FaultProxy(server_url, every=3) as proxy:
        done = bench("serve", "--url", proxy.url, "--workload", "no-reuse", "--doc-tokens", "32",
                     "--question-tokens", "4", "--answer-tokens", "2", "--requests", "6",
                     "--concurrency", "1,2", "--json")  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "kvtier: 4 of 12 measured requests failed"
    document = json.loads(done.stdout)
    assert proxy.completions == 12
    for level in document["levels"]:
        assert (level["requests"], level["ok"], level["errors"]) == (6, 4, 2)
        assert level["server"]["requests_succeeded"] == 4
        assert any("HTTP 500" in m for m in level["error_messages"])
    # and the table says so too
    with FaultProxy(server_url, every=2) as proxy:
        done = bench("serve", "--url", proxy.url, "--workload", "multi-round", "--doc-tokens",
                     "32", "--question-tokens", "4", "--answer-tokens", "2", "--rounds", "2",
                     "--requests", "4", "--concurrency", "1")  # fmt: skip
    assert done.returncode == 1
    assert "concurrency 1: 2 of 4 requests failed" in done.stdout
    assert "HTTP 500" in done.stdout


def test_a_workload_too_long_for_the_server_is_refused_before_sending(server_url: str) -> None:
    with FaultProxy(server_url) as proxy:
        before = counters(server_url)
        done = bench("serve", "--url", proxy.url, "--doc-tokens", "400", "--rounds", "4",
                     "--question-tokens", "16", "--answer-tokens", "16")  # fmt: skip
        after = counters(server_url)
    line = one_line_error(done)
    assert line == (
        f"kvtier: the multi-round workload does not fit max_model_len {MAX_MODEL_LEN} of "
        f"{json.loads(urlopen_models(server_url))['data'][0]['id']}: its longest request needs "
        "528 tokens (doc 400 + 4 rounds x (question 16 + answer 16))"
    )
    assert proxy.completions == 0
    assert after["vllm:request_success_total"] == before["vllm:request_success_total"]


def urlopen_models(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
        return str(r.read().decode())
