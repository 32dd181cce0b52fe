"""Token-exact workloads: who sends which prompt, in which order.

A workload is a list of sessions. A session is one simulated user: a context, then rounds sent
strictly in order, each adding a question and the server's answer to the history the next round
repeats. Concurrency is the number of sessions in flight.

- ``multi-round``: each user has a private document of ``doc_tokens`` and ``rounds`` questions
  of ``question_tokens``; round r's prompt is the document, the earlier questions and answers,
  and question r.
- ``shared-prefix``: one system prompt of ``system_tokens`` shared by every request, plus a
  private suffix of ``suffix_tokens``; one round per session.
- ``no-reuse``: one round per session and every prompt unique (``doc_tokens`` +
  ``question_tokens`` tokens), so a cache can only miss.
- ``multimodal``: users of a vision-language model asking, in conversations of their own, about
  images from one shared set of ``images``: each round is the user's history, a question and
  one image of the set (``image_side`` pixels a side), sent to ``/v1/chat/completions``. The
  text before the image is the user's own, so no KV covers the image: only an encoder cache
  spares its encoder. Chat prompts are text, so this workload counts words, not token ids.

Ids are drawn uniformly from ``[min_token_id, vocab_size)``, which skips the special tokens most
tokenizers put first. Sessions come from a seeded generator keyed by the phase (warm-up or the
index of the level), so the same seed gives the same prompts and no two phases share a context.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

WorkloadKind = Literal["multi-round", "shared-prefix", "no-reuse", "multimodal"]
WORKLOADS: tuple[WorkloadKind, ...] = ("multi-round", "shared-prefix", "no-reuse", "multimodal")
WORDS = (
    "red", "blue", "green", "square", "corner", "left", "right", "above", "below", "bright",
    "dark", "colour", "block", "edge", "middle", "pattern", "shade", "tile", "row", "column",
)  # fmt: skip


@dataclass(frozen=True)
class WorkloadSpec:
    kind: WorkloadKind = "multi-round"
    doc_tokens: int = 1024
    """multi-round: the private context; no-reuse: the body of each prompt."""
    question_tokens: int = 32
    answer_tokens: int = 64
    """``max_tokens`` of every request, sent with ``ignore_eos``."""
    rounds: int = 4
    """multi-round only; other workloads send one request per session."""
    system_tokens: int = 1024
    suffix_tokens: int = 64
    vocab_size: int = 2000
    min_token_id: int = 3
    images: int = 8
    """multimodal: the shared set of images users ask about."""
    image_side: int = 448
    image_tokens: int = 256
    """multimodal: the model's placeholder tokens of one image (only to check the fit)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r} (choose from {', '.join(WORKLOADS)})")
        for name in ("doc_tokens", "question_tokens", "system_tokens", "suffix_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0")
        if self.answer_tokens < 1 or self.rounds < 1 or self.images < 1:
            raise ValueError("answer-tokens and rounds must be >= 1")
        if not 0 <= self.min_token_id < self.vocab_size:
            raise ValueError(
                f"token ids need 0 <= min-token-id < vocab-size, got "
                f"{self.min_token_id} and {self.vocab_size}"
            )
        if self.prompt_tokens(0) < 1:
            raise ValueError(f"a {self.kind} prompt would be empty")

    @property
    def rounds_per_session(self) -> int:
        return self.rounds if self.kind in ("multi-round", "multimodal") else 1

    def prompt_tokens(self, round_index: int) -> int:
        """Prompt length of a session's round ``round_index`` (0-based)."""
        if self.kind in ("multi-round", "multimodal"):
            turn = self.question_tokens + self.answer_tokens
            image = self.image_tokens if self.kind == "multimodal" else 0
            return self.doc_tokens + round_index * turn + self.question_tokens + image
        if self.kind == "shared-prefix":
            return self.system_tokens + self.suffix_tokens
        return self.doc_tokens + self.question_tokens

    def longest_request(self) -> int:
        """Prompt plus answer of the longest request: what must fit ``max_model_len``."""
        return self.prompt_tokens(self.rounds_per_session - 1) + self.answer_tokens

    def describe_longest(self) -> str:
        if self.kind in ("multi-round", "multimodal"):
            image = f" + image {self.image_tokens}" if self.kind == "multimodal" else ""
            return (
                f"doc {self.doc_tokens} + {self.rounds} rounds x (question "
                f"{self.question_tokens} + answer {self.answer_tokens}){image}"
            )
        if self.kind == "shared-prefix":
            return (
                f"system {self.system_tokens} + suffix {self.suffix_tokens} + answer "
                f"{self.answer_tokens}"
            )
        return f"doc {self.doc_tokens} + question {self.question_tokens} + answer " + str(
            self.answer_tokens
        )

    def sessions(self, requests: int, phase: str) -> list[Session]:
        """Sessions holding ``requests`` requests in all, for one phase of a run.

        multi-round gives ``ceil(requests / rounds)`` users; the last one has fewer rounds when
        ``rounds`` does not divide ``requests``.
        """
        if requests < 0:
            raise ValueError("requests must be >= 0")
        rng = random.Random(f"{self.seed}/{self.kind}/{phase}")
        per = self.rounds_per_session
        out = []
        for i in range(math.ceil(requests / per)):
            n_rounds = min(per, requests - i * per)
            out.append(self._session(rng, f"{phase}/{i}", n_rounds))
        return out

    def shared_system_prompt(self) -> list[int]:
        """Shared by every phase: warming it up is the point of the shared-prefix workload."""
        return self.tokens(random.Random(f"{self.seed}/system"), self.system_tokens)

    def words(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.min_token_id, self.vocab_size) for _ in range(n)]

    def _session(self, rng: random.Random, name: str, n_rounds: int) -> Session:
        if self.kind == "multimodal":
            return ChatSession(
                name,
                [],
                [],
                [],
                text=self.words(rng, self.doc_tokens),
                asked=[self.words(rng, self.question_tokens) for _ in range(n_rounds)],
                images=[rng.randrange(self.images) for _ in range(n_rounds)],
                stand_in_text=[self.words(rng, self.answer_tokens) for _ in range(n_rounds)],
            )
        if self.kind == "multi-round":
            context = self.tokens(rng, self.doc_tokens)
            questions = [self.tokens(rng, self.question_tokens) for _ in range(n_rounds)]
        elif self.kind == "shared-prefix":
            context = self.shared_system_prompt()
            questions = [self.tokens(rng, self.suffix_tokens)]
        else:
            context = self.tokens(rng, self.doc_tokens)
            questions = [self.tokens(rng, self.question_tokens)]
        # stand-in answers, used only when the server returns no token ids or a round fails
        stand_ins = [self.tokens(rng, self.answer_tokens) for _ in questions]
        return Session(name, context, questions, stand_ins)


@dataclass
class Session:
    """One user's rounds; ``history`` grows by each question and answer as rounds complete."""

    name: str
    context: list[int]
    questions: list[list[int]]
    stand_in_answers: list[list[int]]
    history: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history = list(self.context)

    @property
    def rounds(self) -> int:
        return len(self.questions)

    def prompt(self, round_index: int) -> list[int]:
        return self.history + self.questions[round_index]

    def record(self, round_index: int, answer: list[int] | None) -> None:
        """Append round ``round_index``'s question and answer (its stand-in when None)."""
        tokens = answer if answer is not None else self.stand_in_answers[round_index]
        self.history += self.questions[round_index] + tokens


@dataclass
class ChatSession(Session):
    """A multimodal user: text, not token ids, and an image of the shared set each round."""

    text: str = ""
    """The history: the context, then each round's question and answer."""
    asked: list[str] = field(default_factory=list)
    images: list[int] = field(default_factory=list)
    """Per round, which image of the shared set."""
    stand_in_text: list[str] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.asked)

    def chat_prompt(self, round_index: int) -> tuple[str, int]:
        """The round's text (history and question) and the image asked about after it."""
        return f"{self.text} {self.asked[round_index]}", self.images[round_index]

    def record_text(self, round_index: int, answer: str | None) -> None:
        said = answer if answer is not None else self.stand_in_text[round_index]
        self.text = f"{self.text} {self.asked[round_index]} {said}"
