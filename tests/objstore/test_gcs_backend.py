"""The object-store backend contract on gs:// (gcp-storage-emulator, GKE Workload Identity)."""

from __future__ import annotations

from tests.objstore.backend_contract import BackendContract


class TestGcsBackend(BackendContract):
    scheme = "gs"
    # the backend sends ifGenerationMatch=0; the emulator answers as if it had not
    exclusive_checked_by_server = "gcp-storage-emulator ignores ifGenerationMatch"
