"""fp8 storage of captured hidden states (``hidden_dtype: fp8``).

A chunk holds its blocks' values as fp8 e4m3, one byte each in the page's own order, then one
float32 scale per (token, layer) row: the row's largest magnitude over e4m3's largest finite
value (448), so every row uses the format's whole range. Rows are a hidden state each, whose
magnitudes differ by orders between layers and tokens; one scale per row keeps each within
e4m3's 3-bit mantissa. `kvtier.hidden.reader` decodes the same layout without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = "e4m3"
_MAX = 448.0


@dataclass(frozen=True, slots=True)
class Fp8Layout:
    blocks: int
    page_shape: tuple[int, ...]
    """A block's page as the cache holds it, hidden size last."""

    @property
    def elements(self) -> int:
        out = 1
        for n in self.page_shape:
            out *= n
        return out

    @property
    def rows(self) -> int:
        return self.elements // self.page_shape[-1]

    @property
    def page_bytes(self) -> int:
        """A block's share of a chunk: its values and its rows' scales."""
        return self.elements + 4 * self.rows

    def split(self, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's bytes as [blocks, elements] fp8 values and [blocks, rows] float32 scales."""
        values = chunk[: self.blocks * self.elements].view(self.blocks, self.elements)
        scales = chunk[self.blocks * self.elements :].view(torch.float32)
        return values, scales.view(self.blocks, self.rows)


def encode(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, ..., hidden] states as ([n, elements] e4m3 bytes, [n, rows] float32 scales)."""
    n = pages.shape[0]
    x = pages.float().reshape(n, -1, pages.shape[-1])
    scale = (x.abs().amax(-1, keepdim=True) / _MAX).clamp(min=torch.finfo(torch.float32).tiny)
    values = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    return values.reshape(n, -1), scale.reshape(n, -1)


def decode(
    values: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of `encode`: [n, *shape] states of ``dtype``."""
    n = values.shape[0]
    x = values.reshape(n, scales.shape[1], -1).view(torch.float8_e4m3fn).float()
    return (x * scales.reshape(n, -1, 1)).to(dtype).reshape(n, *shape)
