"""One real vLLM server, with a tiny locally built model, for every bench test that needs one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bench.servers import vllm_server
from tests.fixtures.models import build_llama, build_tokenizer


@pytest.fixture(scope="session")
def bench_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bench-models")
    return build_llama(root, tokenizer_dir=build_tokenizer(root))


@pytest.fixture(scope="module")  # stopped once its module is done: later tests get the cores
def server_url(bench_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with vllm_server(bench_model, tmp_path_factory.mktemp("vllm-server")) as url:
        yield url
