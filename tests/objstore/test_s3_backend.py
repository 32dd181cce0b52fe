"""The object-store backend contract on s3:// (moto, through IRSA)."""

from __future__ import annotations

from tests.objstore.backend_contract import BackendContract


class TestS3Backend(BackendContract):
    scheme = "s3"
