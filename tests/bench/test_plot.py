"""The figure itself, and the message when matplotlib is missing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvtier.bench.errors import BenchError
from kvtier.bench.plot import Curve, build_figure, require_matplotlib, save_plot


def curve(label: str, scale: float) -> Curve:
    return Curve(
        label,
        [1, 2, 4],
        [100 * scale, 180 * scale, 300 * scale],
        [100.0, 90.0, 75.0],
        [0.01, 0.02, 0.05],
        [0.02, 0.04, 0.09],
    )


def test_two_panels_one_curve_per_run(tmp_path: Path) -> None:
    figure = build_figure([curve("a", 1.0), curve("b", 1.5)])
    tput, ttft = figure.axes
    assert [line.get_label() for line in tput.get_lines()] == ["a", "b"]
    assert list(tput.get_lines()[1].get_ydata()) == [150.0, 270.0, 450.0]
    assert [line.get_label() for line in ttft.get_lines()] == ["a p50", "a p99", "b p50", "b p99"]
    assert list(ttft.get_lines()[1].get_ydata()) == pytest.approx([20.0, 40.0, 90.0])  # ms
    assert "throughput" in tput.get_ylabel()
    assert ttft.get_xlabel() == "concurrency"
    out = save_plot([curve("a", 1.0)], tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_message_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    with pytest.raises(BenchError, match=r"pip install 'kvtier\[bench\]'"):
        require_matplotlib()
