"""The engine benchmarks' timed cases: a case's expected hit, its samples (TTFT, cached and
external tokens, first token) and summary, and `EngineBench`, what a case run outside ``ttft.py``
needs of its bench."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.stats import median

# -- cases ------------------------------------------------------------------------------------


def delta(after: dict[str, int], before: dict[str, int], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


# -- cases ------------------------------------------------------------------------------------


@dataclass
class Sample:
    ms: float
    cached: int
    external: int
    token: int


@dataclass
class Case:
    name: str
    expected: int
    """num_cached_tokens a full hit gives (0 for a cold case)."""
    connector: bool = False
    """Whether the hit must come from a connector (vLLM counts it as external)."""
    samples: list[Sample] = field(default_factory=list)
    resident: list[float] = field(default_factory=list)
    """Share of the backing files in the page cache right before each timed prompt."""
    read_in: list[int] = field(default_factory=list)
    """Bytes of the backing files the timed prompt brought into the page cache."""
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return median([s.ms for s in self.samples])

    @property
    def hits_ok(self) -> bool:
        if self.expected == 0:
            return all(s.cached == 0 for s in self.samples)
        external = self.expected if self.connector else 0
        return all(
            s.cached >= self.expected and (s.external >= external if external else not s.external)
            for s in self.samples
        )

    def summary(self, cold_tokens: Sequence[int] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ttft_ms": self.ms,
            "ttft_ms_each": [round(s.ms, 2) for s in self.samples],
            "cached_tokens": [s.cached for s in self.samples],
            "external_hit_tokens": [s.external for s in self.samples],
            "expected_cached_tokens": self.expected,
            "hits_ok": self.hits_ok,
        }
        if cold_tokens:
            n = len(cold_tokens)
            same = sum(s.token == cold_tokens[i % n] for i, s in enumerate(self.samples))
            out["first_token_same_as_cold"] = f"{same}/{len(self.samples)}"
        if self.resident:
            out["resident_before_load"] = [round(r, 4) for r in self.resident]
            out["read_in_bytes"] = self.read_in
        if self.counters:
            out["kvtierd_counters"] = self.counters
        return out


class EngineBench(Protocol):
    """The parts of ``ttft.py``'s bench a case module drives (structural, so neither imports
    the other)."""

    cache_dir: Path
    tokenizer: Path
    root: Path
    block_size: int
    warmup: list[int]
    prompts: list[list[int]]

    def full_hit(self, tokens_per_chunk: int) -> int: ...

    def engine(
        self,
        connector: dict[str, Any] | None = None,
        *,
        model: Path | None = None,
        dtype: str = "bfloat16",
    ) -> AbstractContextManager[Any]: ...

    def first_token(self, llm: Any, prompt: Sequence[int]) -> Sample: ...

    def rounds(self, llm: Any) -> Iterator[int]: ...

    def compute(self, llm: Any, prompts: Sequence[Sequence[int]]) -> None: ...

    def shm(self, name: str) -> Path: ...

    def sidecar(self, daemon: Kvtierd, bpc: int) -> dict[str, Any]: ...
