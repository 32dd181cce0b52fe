"""The fault suite: real kvtierd processes, real engines, real signals and real stores.

It shares the engine fixtures of `tests/e2e`: the same tiny models, offline environment and
baselines.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import (  # noqa: F401  (fixtures, found by name)
    baseline,
    daemon_files,
    engine_environment,
    fresh_prompts,
    models_dir,
    prompts,
    tiny_models,
)


@pytest.fixture
def arenas() -> Iterator[list[Path]]:
    """Arena paths a test's daemons use, removed after the test."""
    made: list[Path] = []
    yield made
    for path in made:
        path.unlink(missing_ok=True)
