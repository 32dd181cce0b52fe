"""The encoder-cache connector's settings, from ``ec_connector_extra_config``."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvtier.core.keys import REVISION_PATTERN
from kvtier_vllm.shared.settings import TiersConfig, parse_section

MIN_PART_KIB = 4
"""Parts under ``arena.min_slot_bytes`` (64 KiB by default) are refused when registered."""


class EncoderCacheConfig(TiersConfig):
    """``ec_connector_extra_config`` of `KVTierECConnector`; the settings shared with the KV
    connector mean the same here."""

    encoder_revision: str = Field(
        "",
        pattern=f"^{REVISION_PATTERN}$",
        description="Names the encoder's weights (vision tower and projector) in the namespace; "
        "change it whenever they change. Unset: a fingerprint of the encoder's tensors in the "
        "checkpoint vLLM loaded.",
    )
    part_kib: int = Field(
        256,
        ge=MIN_PART_KIB,
        description="KiB of one stored part of an encoder output: an item is cut into parts of "
        "whole rows this size (the last one padded), so that items of every size share one "
        "arena slot class.",
    )
    output_width: int = Field(
        0,
        ge=0,
        description="Width of one encoder output row. 0: what vLLM measured at start (a "
        "producer), else the language model's hidden size. Outputs of another width are not "
        "stored.",
    )


def parse(extra: dict[str, Any] | None) -> EncoderCacheConfig:
    return parse_section(EncoderCacheConfig, extra, "ec_connector_extra_config")
