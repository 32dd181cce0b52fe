"""The workload generator: prompt sizes, seeds, sharing and uniqueness."""

from __future__ import annotations

import pytest

from kvtier.bench.workloads import WorkloadSpec


def multi_round(**kw: int) -> WorkloadSpec:
    sizes = {"doc_tokens": 64, "question_tokens": 8, "answer_tokens": 4, "rounds": 3, **kw}
    return WorkloadSpec(kind="multi-round", **sizes)


def test_multi_round_prompts_repeat_the_history() -> None:
    spec = multi_round()
    (session,) = spec.sessions(3, "level/0")
    answers = [[100 + r] * 4 for r in range(3)]
    prompts = []
    for r in range(3):
        prompts.append(session.prompt(r))
        session.record(r, answers[r])
    assert [len(p) for p in prompts] == [72, 84, 96]
    assert [spec.prompt_tokens(r) for r in range(3)] == [72, 84, 96]
    # round r starts with round r-1's prompt, then the answer the server gave
    for r in (1, 2):
        assert prompts[r][: len(prompts[r - 1])] == prompts[r - 1]
        assert prompts[r][len(prompts[r - 1]) : len(prompts[r - 1]) + 4] == answers[r - 1]
    assert spec.longest_request() == 96 + 4


def test_a_failed_round_gets_the_stand_in_answer() -> None:
    spec = multi_round()
    one, two = spec.sessions(6, "level/0"), spec.sessions(6, "level/0")
    one[0].record(0, None)
    two[0].record(0, None)
    assert one[0].prompt(1) == two[0].prompt(1)
    assert len(one[0].prompt(1)) == spec.prompt_tokens(1)


def test_requests_split_into_users_with_the_rest_last() -> None:
    sessions = multi_round().sessions(7, "level/0")
    assert [len(s.questions) for s in sessions] == [3, 3, 1]


def test_same_seed_same_prompts_other_seed_or_phase_other_prompts() -> None:
    first = [s.context for s in multi_round().sessions(6, "level/0")]
    assert first == [s.context for s in multi_round().sessions(6, "level/0")]
    other_seed = WorkloadSpec(kind="multi-round", doc_tokens=64, seed=1).sessions(6, "level/0")
    assert {tuple(s.context) for s in other_seed}.isdisjoint(tuple(c) for c in first)
    warm = multi_round().sessions(6, "warmup/0")
    assert {tuple(s.context) for s in warm}.isdisjoint(tuple(c) for c in first)


def test_token_ids_stay_in_range() -> None:
    spec = WorkloadSpec(kind="no-reuse", doc_tokens=500, vocab_size=50, min_token_id=3)
    ids = {t for s in spec.sessions(20, "x") for t in s.prompt(0)}
    assert min(ids) >= 3
    assert max(ids) < 50


def test_no_reuse_prompts_are_unique_from_the_first_token_block() -> None:
    spec = WorkloadSpec(kind="no-reuse", doc_tokens=64, question_tokens=8)
    prompts = [tuple(s.prompt(0)) for p in ("warmup/0", "level/0", "level/1")
               for s in spec.sessions(50, p)]  # fmt: skip
    assert len(prompts) == 150
    assert all(len(p) == 72 for p in prompts)
    # distinct first 32 tokens: no two prompts share even one KV block
    assert len({p[:32] for p in prompts}) == len(prompts)


def test_shared_prefix_shares_the_system_prompt_only() -> None:
    spec = WorkloadSpec(kind="shared-prefix", system_tokens=64, suffix_tokens=16)
    sessions = spec.sessions(10, "level/0") + spec.sessions(3, "warmup/0")
    prompts = [s.prompt(0) for s in sessions]
    assert all(len(p) == 80 for p in prompts)
    assert {tuple(p[:64]) for p in prompts} == {tuple(spec.shared_system_prompt())}
    assert len({tuple(p[64:]) for p in prompts}) == len(prompts)
    assert all(len(s.questions) == 1 for s in sessions)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kind": "chat"}, "unknown workload"),
        ({"answer_tokens": 0}, "answer-tokens"),
        ({"doc_tokens": -1}, "doc-tokens"),
        ({"vocab_size": 3, "min_token_id": 3}, "min-token-id"),
        ({"kind": "no-reuse", "doc_tokens": 0, "question_tokens": 0}, "empty"),
    ],
)
def test_bad_sizes_are_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**kw)  # type: ignore[arg-type]
