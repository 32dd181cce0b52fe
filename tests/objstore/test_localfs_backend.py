"""The object-store backend contract on file:// (a local directory)."""

from __future__ import annotations

from tests.objstore.backend_contract import BackendContract


class TestLocalFsBackend(BackendContract):
    scheme = "file"
