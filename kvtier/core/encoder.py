"""Encoder outputs as chunks: a multimodal item's ``[rows, width]`` output, cut into parts of a
fixed number of rows.

Every part of one namespace has the same size, so the arena gives the encoder pool one slot
class however the items' sizes vary; the last part is padded with zeros. A part's key is the
namespace, a digest of the item's identifier and row count, and the part's index: an item of
another size under the same identifier (a reused client-provided id) never meets these keys.

The namespace commits to what decides the output besides the item: the model, the encoder's
weights, the output's dtype and width, and the processor settings (`encoder_spec`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from kvtier.core.keys import (
    NAMESPACE_BYTES,
    ChunkKey,
    NamespaceSpec,
    PageLayout,
    Pool,
    check_text,
)

ENCODER_LAYER = "encoder_output"
ROW_ORDER = "rows"
"""The page order of encoder parts: whole rows, one after another."""
ITEM_DIGEST_BYTES = 24
_PROCESSOR_PREFIX = "encoder_output;processor="
MAX_IDENTIFIER_CHARS = 1024

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def encoder_spec(
    *,
    model: str,
    encoder_revision: str,
    dtype: str,
    width: int,
    rows_per_part: int,
    processor: str,
    tenant: str = "default",
) -> NamespaceSpec:
    """The encoder pool's namespace. ``encoder_revision`` names the encoder's weights (tower and
    projector); ``processor`` names the settings that turn an item into the encoder's input."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(
            f"encoder output dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}"
        )
    layout = PageLayout(
        tokens_per_block=rows_per_part,
        blocks_per_chunk=1,
        num_kv_heads=1,
        head_sizes=(width,),
        layer_names=(ENCODER_LAYER,),
        kv_order=ROW_ORDER,
    )
    return NamespaceSpec(
        model=model,
        model_revision=encoder_revision,
        pool=Pool.ENCODER,
        kv_dtype=dtype,
        layout=layout,
        tenant=tenant,
        attention=_PROCESSOR_PREFIX + processor,
    )


@dataclass(frozen=True, slots=True)
class PartLayout:
    """How one encoder namespace cuts items into parts."""

    width: int
    dtype: str
    rows_per_part: int

    @classmethod
    def of(cls, spec: NamespaceSpec) -> PartLayout:
        if spec.pool is not Pool.ENCODER:
            raise ValueError(f"not an encoder namespace: pool {spec.pool}")
        return cls(spec.layout.head_sizes[0], spec.kv_dtype, spec.layout.tokens_per_block)

    @property
    def row_bytes(self) -> int:
        return self.width * DTYPE_BYTES[self.dtype]

    @property
    def part_bytes(self) -> int:
        return self.rows_per_part * self.row_bytes

    def parts(self, rows: int) -> int:
        return math.ceil(rows / self.rows_per_part)

    def rows_of(self, part: int, rows: int) -> int:
        """Rows of the item that part ``part`` holds (the last one may hold fewer)."""
        return min(self.rows_per_part, rows - part * self.rows_per_part)


def rows_per_part(width: int, dtype: str, part_bytes: int) -> int:
    """The most whole rows that fit ``part_bytes`` (at least one)."""
    return max(1, part_bytes // (width * DTYPE_BYTES[dtype]))


def item_keys(namespace: bytes, identifier: str, rows: int, layout: PartLayout) -> list[ChunkKey]:
    """The keys of an item's parts, in order."""
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes")
    if rows <= 0:
        raise ValueError(f"an encoder item has at least one row, got {rows}")
    check_text("identifier", identifier, MAX_IDENTIFIER_CHARS)
    item = hashlib.blake2b(
        f"{identifier}\0{rows}".encode(), digest_size=ITEM_DIGEST_BYTES, person=b"kvtier.ec.v1"
    ).digest()
    head = namespace + item
    return [ChunkKey(head + part.to_bytes(4, "big")) for part in range(layout.parts(rows))]
