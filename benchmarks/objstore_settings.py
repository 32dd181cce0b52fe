"""The object benchmark's settings: the bucket, chunk and request sizes, the slow store's delay,
the ratios it reports and their targets, and its modes."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.harness.sizes import KiB, MiB
from benchmarks.harness.targets import Target

BUCKET = "kvtier-bench"
CHUNK = 1 * MiB
LOOKUP_CHUNK = 4 * KiB
LOOKUP_KEYS = 8
EXTENT = 32 * MiB
STORE_DELAY_MS = 200.0
REQUEST_TIMEOUT_S = 10.0

TARGETS: dict[str, Target] = {
    "upload_vs_raw_boto3": (">=", 0.8),
    "download_vs_raw_boto3": (">=", 0.8),
}
GET_PASSES = 3
RATIOS = (
    ("upload_vs_raw_boto3", "raw_put", "tier_put"),
    ("uploader_vs_raw_boto3", "raw_put", "uploader_put"),
    ("download_vs_raw_boto3", "raw_get", "tier_fetch"),
    ("read_into_vs_raw_range", "raw_range_get", "tier_read_into"),
)
"""Ratio name, boto3 figure, tier figure: tier throughput over boto3 throughput."""
LOOKUP_SLACK_MS = 10.0
"""lookup_budget_p99_ms is held to the configured budget plus this much."""


@dataclass(frozen=True)
class Mode:
    name: str
    objects: int
    reps: int
    lookups: int


QUICK = Mode("quick", 16, 3, 60)
FULL = Mode("full", 32, 7, 300)
