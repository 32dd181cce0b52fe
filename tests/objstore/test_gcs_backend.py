"""The object-store backend contract on gs:// (gcp-storage-emulator, GKE Workload Identity)."""

from __future__ import annotations

from tests.objstore.backend_contract import BackendContract


class TestGcsBackend(BackendContract):
    scheme = "gs"
