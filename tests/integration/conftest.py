"""The daemon tests' files: one small daemon's configuration, arena and lmdb per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.daemon_harness import DaemonFiles, write_config


@pytest.fixture
def files(tmp_path: Path, shm_path: Path) -> DaemonFiles:
    return write_config(tmp_path, shm_path)
