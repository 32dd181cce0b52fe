"""The ``events`` section: what kvtierd tells routers about the tier every node shares."""

from __future__ import annotations

from pathlib import Path

from pydantic import ByteSize, Field

from kvtier.core.config_sections import ConfigSection


class EventsConfig(ConfigSection):
    endpoint: str | None = Field(
        None,
        description="ZMQ PUB address where kvtierd publishes the object tier's KV events in "
        "vLLM's encoding (`tcp://*:5560` binds; `tcp://host:port` connects). Unset: no events. "
        "Needs the object tier.",
    )
    replay_endpoint: str | None = Field(
        None,
        description="ZMQ ROUTER address answering replay requests: an 8-byte big-endian "
        "sequence number, answered with every kept batch from it on and an end marker, as vLLM's "
        "publisher does.",
    )
    topic: str = Field(
        "kv@kvtier-object@{model}",
        description="Each batch's topic; `{model}` is replaced by the model of the namespace "
        "whose chunks it names.",
    )
    medium: str = Field(
        "OBJECT",
        description="The `medium` of the object tier's events: the tier name a router's "
        "weights apply to.",
    )
    int_block_hashes: bool = Field(
        True,
        description="Publish block hashes as integers (the low 64 bits, big-endian), as vLLM "
        "does unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; set it as the engines have it.",
    )
    log_bytes: ByteSize = Field(
        ByteSize(256 << 20),
        gt=0,
        description="Bytes of batches kept for replay, on disk (the oldest go first): the "
        "sequence carries on across restarts.",
    )
    log_path: Path | None = Field(
        None,
        description="Directory of the kept batches (an lmdb environment). Unset: `events` "
        "beside lmdb.path.",
    )
    lineage_chunks: int = Field(
        1 << 18,
        gt=0,
        description="Committed chunks whose lineage (block hashes and tokens) is kept in "
        "memory until it is uploaded; the oldest go first, and are then uploaded unannounced "
        "(counted).",
    )
