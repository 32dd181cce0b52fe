"""Shared fixtures: small real arenas in /dev/shm."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shm_path() -> Iterator[Path]:
    path = Path("/dev/shm") / f"kvtier-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield path
    path.unlink(missing_ok=True)
