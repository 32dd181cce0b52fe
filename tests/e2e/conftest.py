"""Fixtures for tests that drive a real vLLM engine on the CPU.

vLLM is imported only inside fixtures and tests, after the environment is set: it reads its
variables lazily, and a module-level import would run at collection time.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.models import (
    EagleModels,
    ModelSet,
    build_eagle_pair,
    build_gemma3_hybrid,
    build_llama,
    build_models,
    build_tokenizer,
    engine_env,
    generate_tokens,
    reset_env_caches,
    running_llm,
    shared_prefix_prompts,
    vocab_size_of,
)
from tests.fixtures.vision_models import build_idefics3
from tests.integration import daemon_harness
from tests.integration.daemon_harness import DaemonFiles, write_config

MAX_TOKENS = 12


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Root holding the tokenizer, the 2-layer target and the 1-layer draft, built once."""
    root = tmp_path_factory.mktemp("models")
    build_models(root)
    return root


@pytest.fixture(scope="session")
def tiny_models(models_dir: Path) -> ModelSet:
    return build_models(models_dir)


@pytest.fixture(scope="session")
def two_builds(tiny_models: ModelSet, models_dir: Path) -> tuple[Path, Path]:
    """Two checkpoints of one config, with different random weights."""
    builds = [
        build_llama(models_dir, seed=seed, tokenizer_dir=tiny_models.tokenizer) for seed in (0, 1)
    ]
    assert (builds[0] / "config.json").read_text() == (builds[1] / "config.json").read_text()
    return builds[0], builds[1]


def deploy(build: Path, served: Path) -> None:
    """Put ``build``'s files at ``served``, as a redeploy under the same path does. copy2 keeps
    the build's mtimes, as `cp -p` and `rsync -t` do."""
    served.mkdir(exist_ok=True)
    for file in build.iterdir():
        if file.is_file():
            shutil.copy2(file, served / file.name)


_caches: list[Path] = []
"""The run's one cache directory for every engine (set by `engine_caches`)."""


def use_engine_caches(path: Path) -> None:
    _caches[:] = [path]


def set_engine_env(mp: pytest.MonkeyPatch, tmp: Path, *, multiprocess: bool = False) -> None:
    caches = _caches[0] if _caches else None
    for name, value in engine_env(tmp, multiprocess=multiprocess, caches=caches).items():
        mp.setenv(name, value)
    # The KV size is given as kv_cache_memory_bytes; this variable would silently override it.
    mp.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    reset_env_caches()


ENGINE_SESSION_S = 20.0
"""kvtierd's session timeout for engines: one in the test's own process can miss heartbeats for
seconds on a loaded machine, and a session that lapses loses the stores it had reserved."""


@pytest.fixture(autouse=True)
def engine_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every e2e test runs offline with vLLM's caches, sockets and temp files in its tmp_path,
    against daemons (`write_config`) whose sessions outlive a loaded machine's pauses."""
    set_engine_env(monkeypatch, tmp_path)
    monkeypatch.setattr(daemon_harness, "SESSION_TIMEOUT_S", ENGINE_SESSION_S)
    yield tmp_path
    monkeypatch.undo()
    reset_env_caches()


@pytest.fixture
def daemon_files(tmp_path: Path, shm_path: Path) -> DaemonFiles:
    """A kvtierd configuration with a 64 MiB arena, for `procs.start_daemon`."""
    return write_config(
        tmp_path, shm_path, {"arena": {"size_bytes": 64 << 20, "min_slot_bytes": 16 << 10}}
    )


@pytest.fixture
def kv_events(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every KV event the connector hands vLLM during the test (in-process engines)."""
    from kvtier_vllm.kv.scheduler_side.scheduler import KVTierScheduler

    events: list[Any] = []
    take_events = KVTierScheduler.take_events

    def recording(self: KVTierScheduler) -> list[object]:
        taken = take_events(self)
        events.extend(taken)
        return taken

    monkeypatch.setattr(KVTierScheduler, "take_events", recording)
    return events


@pytest.fixture(scope="session")
def eagle_models(models_dir: Path) -> EagleModels:
    """A 2-layer target and an EAGLE head that reproduces its first layer, built once."""
    return build_eagle_pair(models_dir, tokenizer_dir=build_tokenizer(models_dir))


# Prompts sharing prefixes, and their greedy tokens with no connector; a module may override
# `fresh_prompts`.


@pytest.fixture(scope="session")
def hybrid_model(models_dir: Path, tiny_models: ModelSet) -> Path:
    """Gemma3-text, layers sliding, full, sliding, full (window 200): two KV-cache groups."""
    return build_gemma3_hybrid(models_dir, tokenizer_dir=tiny_models.tokenizer)


@pytest.fixture(scope="session")
def hybrid_five_to_one(models_dir: Path, tiny_models: ModelSet) -> Path:
    """Five sliding layers to one full: six one-layer KV-cache groups."""
    kinds = ("S",) * 5 + ("F",)
    return build_gemma3_hybrid(models_dir, layer_types=kinds, tokenizer_dir=tiny_models.tokenizer)


@pytest.fixture(scope="session")
def vlm(models_dir: Path) -> Path:
    """A tiny Idefics3 (`tests.fixtures.vision_models`)."""
    return build_idefics3(models_dir)


@pytest.fixture(scope="session")
def vlm_other_build(vlm: Path, models_dir: Path) -> Path:
    """The same config with other random weights (another encoder)."""
    return build_idefics3(models_dir, seed=1)


@pytest.fixture(scope="module")
def prompts(tiny_models: ModelSet) -> list[list[int]]:
    return shared_prefix_prompts(
        4,
        vocab_size=vocab_size_of(tiny_models.target),
        prefix_len=640,
        suffix_len=48,
        num_prefixes=4,
    )


@pytest.fixture(scope="module")
def fresh_prompts(tiny_models: ModelSet) -> list[list[int]]:
    return shared_prefix_prompts(
        2, vocab_size=vocab_size_of(tiny_models.target), prefix_len=320, seed=7
    )


_baselines: dict[tuple[str, tuple[tuple[int, ...], ...]], list[list[int]]] = {}
"""`baseline`'s tokens by model and prompts. Greedy decoding with no connector gives the same
tokens each time, so the modules of one process that ask for the same prompts share one engine."""


@pytest.fixture(scope="module")
def baseline(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    fresh_prompts: list[list[int]],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[list[int]]:
    """Greedy tokens with no connector: `prompts`, then `fresh_prompts`."""
    asked = prompts + fresh_prompts
    key = (str(tiny_models.target), tuple(tuple(p) for p in asked))
    if key not in _baselines:
        with pytest.MonkeyPatch.context() as mp:
            set_engine_env(mp, tmp_path_factory.mktemp("baseline"))
            with running_llm(tiny_models.target) as llm:
                _baselines[key], _ = generate_tokens(llm, asked, max_tokens=MAX_TOKENS)
    return [list(tokens) for tokens in _baselines[key]]  # a module's own copy
