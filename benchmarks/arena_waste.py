"""How much of an arena extent its slots leave unused, for the chunk sizes of real models.

An extent of E bytes holds E // c slots of a class whose chunks are c bytes; the rest of the
extent is never used while that class holds it (internal waste). A chunk larger than E cannot be
stored at all. This prints, for 256-token chunks of published model shapes and for each candidate
`arena.extent_bytes`, the share of each extent left unused, and a summary per candidate.

    python -m benchmarks.arena_waste            # the table and the summary
    python -m benchmarks.arena_waste --summary  # the summary alone
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.harness.sizes import MiB

TOKENS = 256  # tokens per chunk: 16 blocks of 16, or 2 blocks of 128


@dataclass(frozen=True)
class Chunk:
    name: str
    nbytes: int


def kv(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes of a chunk of K and V for one tensor-parallel rank (heads split over ``tp``)."""
    return 2 * layers * max(1, kv_heads // tp) * head_dim * dtype_bytes * TOKENS


def states(hidden: int, layers: int, dtype_bytes: int) -> int:
    """Bytes of a chunk of hidden states captured at ``layers`` layers."""
    return hidden * layers * dtype_bytes * TOKENS


CHUNKS = (
    # the models' published shapes: layers, KV heads, head size (config.json)
    Chunk("Llama-3.1-8B bf16", kv(32, 8, 128, 2)),
    Chunk("Llama-3.1-8B fp8", kv(32, 8, 128, 1)),
    Chunk("Llama-3.1-8B bf16 TP=2", kv(32, 8, 128, 2, tp=2)),
    Chunk("Llama-3.1-8B bf16 TP=4", kv(32, 8, 128, 2, tp=4)),
    Chunk("Llama-3.1-70B bf16 TP=8", kv(80, 8, 128, 2, tp=8)),
    Chunk("Llama-3.1-70B fp8 TP=8", kv(80, 8, 128, 1, tp=8)),
    Chunk("Llama-3.1-70B bf16 TP=4", kv(80, 8, 128, 2, tp=4)),
    Chunk("Llama-3.1-70B bf16 whole (TP-portable)", kv(80, 8, 128, 2)),
    Chunk("Llama-3.2-1B draft bf16", kv(16, 8, 64, 2)),
    Chunk("Llama-3.2-1B draft fp8", kv(16, 8, 64, 1)),
    Chunk("Llama-3.2-3B bf16", kv(28, 8, 128, 2)),
    Chunk("EAGLE head of Llama-3.1-8B bf16", kv(1, 8, 128, 2)),
    Chunk("Qwen2.5-7B bf16", kv(28, 4, 128, 2)),
    Chunk("Qwen2.5-72B bf16 TP=8", kv(80, 8, 128, 2, tp=8)),
    Chunk("Mistral-Small-24B bf16", kv(40, 8, 128, 2)),
    Chunk("Gemma-2-9B bf16", kv(42, 8, 256, 2)),
    Chunk("DeepSeek-V3 MLA latent bf16", 61 * (512 + 64) * 2 * TOKENS),
    Chunk("hidden states 8B, 3 layers bf16 (EAGLE-3)", states(4096, 3, 2)),
    Chunk("hidden states 70B, 1 layer bf16", states(8192, 1, 2)),
    # encoder outputs, one image each: tokens x the language model's width
    Chunk("encoder: LLaVA-1.5 image (576 x 4096 bf16)", 576 * 4096 * 2),
    Chunk("encoder: Qwen2-VL 7B image (1024 x 3584 bf16)", 1024 * 3584 * 2),
)

CANDIDATES = (16 * MiB, 32 * MiB, 64 * MiB, 96 * MiB, 128 * MiB)


def waste(extent: int, chunk: int) -> float | None:
    """Share of an extent its slots leave unused; None when the chunk does not fit."""
    if chunk > extent:
        return None
    return (extent % chunk) / extent


def summary(extent: int) -> tuple[float, float, int]:
    """(mean, worst) waste over the chunks that fit, and how many do not fit."""
    fits = [w for c in CHUNKS if (w := waste(extent, c.nbytes)) is not None]
    return sum(fits) / len(fits), max(fits), len(CHUNKS) - len(fits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", action="store_true", help="the summary alone")
    args = parser.parse_args()
    heads = "".join(f"{e // MiB:>9} MiB" for e in CANDIDATES)
    if not args.summary:
        print(f"{'chunk (256 tokens)':<48}{'MiB':>8}{heads}")
        for c in CHUNKS:
            cells = ""
            for e in CANDIDATES:
                w = waste(e, c.nbytes)
                cells += f"{'too big':>13}" if w is None else f"{w:>12.1%} "
            print(f"{c.name:<48}{c.nbytes / MiB:>8.2f}{cells}")
        print()
    print(f"{'extent':<12}{'mean waste':>12}{'worst':>9}{'too big':>9}")
    for e in CANDIDATES:
        mean, worst, too_big = summary(e)
        print(f"{e // MiB:>4} MiB    {mean:>11.1%} {worst:>8.1%} {too_big:>8}")


if __name__ == "__main__":
    main()
