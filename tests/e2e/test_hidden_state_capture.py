"""Hidden states captured for draft training (vLLM's speculative method ``extract_hidden_states``)
stored as kvtier's hidden pool, against vLLM's reference connector writing them to files.

The reference is `ExampleHiddenStatesConnector` with its device copy made synchronous for the
CPU (`tests.fixtures.hidden_reference`); both run as multiprocess engines, as in serving.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from kvtier_vllm.hidden_capture.tensors import as_tensor, load
from kvtier_vllm.layout.fp8 import decode, encode
from safetensors.torch import load_file

from kvtier.client import InProcessClient
from kvtier.core.config import load_config
from kvtier.core.keys import Pool
from kvtier.hidden.export import file_name
from kvtier.hidden.reader import REF_FIELD, HiddenStatesReader, HiddenStatesRef
from kvtier.rpc import GrpcTierClient
from kvtier.tiering.manager import TierManager
from tests.e2e.conftest import set_engine_env
from tests.e2e.models import (
    ModelSet,
    capture_config,
    counter,
    reset_env_caches,
    running_llm,
    shared_prefix_prompts,
    untimed_transfers,
    vocab_size_of,
)
from tests.e2e.test_connector import EXTERNAL_HITS, TRANSFER_BYTES, embedded_yaml, kvtier_config
from tests.e2e.test_connector_objstore import node_yaml
from tests.e2e.test_connector_tp import engine as tp_engine
from tests.integration.daemon_harness import DaemonFiles, Processes, RunningDaemon
from tests.objstore.fixtures import AwsIrsa

pytestmark = pytest.mark.slow

CAPTURE = capture_config([0, 1])
OUTPUT_TOKENS = 6
SHARED = 512
REFERENCE = {
    "kv_connector": "CpuHiddenStatesConnector",
    "kv_connector_module_path": "tests.fixtures.hidden_reference",
    "kv_role": "kv_producer",
}


@pytest.fixture(scope="module")
def shared_prompts(tiny_models: ModelSet) -> list[list[int]]:
    """Ten prompts sharing a 512-token prefix, each ending part way through a block."""
    vocab = vocab_size_of(tiny_models.target)
    return shared_prefix_prompts(10, vocab_size=vocab, prefix_len=SHARED, suffix_len=70, seed=3)


def generate(
    llm: Any, prompts: Sequence[Sequence[int]], params: dict[str, Any] | None = None
) -> list[Any]:
    from vllm import SamplingParams

    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=OUTPUT_TOKENS,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params} if params else None,
    )
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)


def capturing(model: Path, connector: dict[str, Any], multiprocess: bool = True) -> Any:
    """An engine capturing hidden states through ``connector``; multiprocess, as in serving
    (the engine core steps once more after the last request, which stores its tail)."""
    return running_llm(
        model, kv_transfer_config=connector, speculative_config=CAPTURE, multiprocess=multiprocess
    )


def kvtierd_value(daemon: RunningDaemon, name: str, **labels: str) -> float:
    """One of kvtierd's series, summed over the label sets that include ``labels``."""
    found = [v for n, got, v in daemon.metrics() if n == name and labels.items() <= got.items()]
    assert found, (name, labels)
    return sum(found)


@contextmanager
def reader(config: Path) -> Iterator[HiddenStatesReader]:
    """Reads references from what the tiers at ``config`` hold, once the engine is gone."""
    manager = TierManager(load_config(config))
    found = HiddenStatesReader(InProcessClient(manager), timeout_s=5)
    try:
        yield found
    finally:
        found.close()
        manager.close()


@dataclass
class Reference:
    states: list[dict[str, torch.Tensor]]
    """Per prompt, the file the reference connector wrote (prompt and outputs but the last)."""
    tokens: list[list[int]]


@pytest.fixture(scope="module")
def reference(
    tiny_models: ModelSet, shared_prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    root = tmp_path_factory.mktemp("hidden-reference")
    files = dict(REFERENCE, kv_connector_extra_config={"shared_storage_path": str(root)})
    with pytest.MonkeyPatch.context() as mp:
        set_engine_env(mp, root)
        with capturing(tiny_models.target, files) as llm:
            outputs = generate(llm, shared_prompts, {"include_output_tokens": True})
            paths = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
            written = [load_hidden_states(path) for path in paths]
    reset_env_caches()
    return Reference(written, [list(o.outputs[0].token_ids) for o in outputs])


def test_states_read_back_equal_the_reference_and_a_shared_prefix_is_stored_once(
    tiny_models: ModelSet,
    shared_prompts: list[list[int]],
    reference: Reference,
    tmp_path: Path,
    shm_path: Path,
) -> None:
    written, expected_tokens = reference.states, reference.tokens
    config = embedded_yaml(tmp_path, shm_path)
    connector = kvtier_config({"kvtier_config": str(config)})
    # in-process: without the outputs' states, every tail is stored in the step that ends it
    with capturing(tiny_models.target, connector, multiprocess=False) as llm:
        outputs = generate(llm, shared_prompts)
        stored = counter(llm, TRANSFER_BYTES, direction="store", pool="hidden")
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected_tokens
    refs = [o.kv_transfer_params[REF_FIELD] for o in outputs]
    with reader(config) as found:
        for prompt, ref, files_states in zip(shared_prompts, refs, written, strict=True):
            states = found.load(ref)
            assert states.token_ids == tuple(prompt)
            assert torch.equal(as_tensor(states), files_states["hidden_states"][: len(prompt)])
    pairs = zip(written, shared_prompts, strict=True)
    per_request = sum(s["hidden_states"][: len(p)].nbytes for s, p in pairs)
    ratio = stored / per_request
    print(f"hidden-state bytes stored: {stored} against {per_request} in per-request files")
    # the prefix once (16 blocks), each request's 70 tokens in 3 blocks: 46 of 190 blocks' worth
    assert stored > 0
    assert ratio < 0.3, ratio

    # a second engine hits the prefixes (hidden states loaded with the KV), and hands its
    # outputs' states too
    with capturing(tiny_models.target, connector) as llm:
        outputs = generate(llm, shared_prompts, {"include_output_tokens": True})
        assert counter(llm, EXTERNAL_HITS) > 0
        assert counter(llm, TRANSFER_BYTES, direction="load", pool="hidden") > 0
        assert not untimed_transfers(llm)  # hidden states' seconds counted with their bytes
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected_tokens
    with reader(config) as found:
        for prompt, out, files_states in zip(shared_prompts, outputs, written, strict=True):
            states = found.load(out.kv_transfer_params[REF_FIELD])
            assert states.token_ids == tuple(prompt + list(out.outputs[0].token_ids)[:-1])
            assert list(states.token_ids) == files_states["token_ids"].tolist()
            assert torch.equal(as_tensor(states), files_states["hidden_states"])


def test_fp8_states_are_the_reference_rounded_to_fp8_in_a_quarter_of_the_bytes(
    tiny_models: ModelSet,
    shared_prompts: list[list[int]],
    reference: Reference,
    tmp_path: Path,
    shm_path: Path,
) -> None:
    config = embedded_yaml(tmp_path, shm_path)
    connector = kvtier_config({"kvtier_config": str(config), "hidden_dtype": "fp8"})
    stored: list[float] = []
    runs = []
    for _ in range(2):  # the second engine's hits load the fp8 chunks back into its cache
        with capturing(tiny_models.target, connector, multiprocess=False) as llm:
            runs.append(generate(llm, shared_prompts))
            stored.append(counter(llm, TRANSFER_BYTES, direction="store", pool="hidden"))
            loaded = counter(llm, TRANSFER_BYTES, direction="load", pool="hidden")
    assert loaded > 0
    errors = []
    with reader(config) as found:
        for outputs in runs:
            expected = zip(shared_prompts, reference.states, reference.tokens, strict=True)
            for (prompt, files, tokens), out in zip(expected, outputs, strict=True):
                assert list(out.outputs[0].token_ids) == tokens
                states = as_tensor(found.load(out.kv_transfer_params[REF_FIELD]))
                exact = files["hidden_states"][: len(prompt)]
                assert states.dtype == exact.dtype
                # bit for bit what fp8 e4m3 with a scale per (token, layer) makes of them
                assert torch.equal(
                    states, decode(*encode(exact), tuple(exact.shape[1:]), exact.dtype)
                )
                errors.append(float((states - exact).norm() / exact.norm()))
    print(f"fp8 hidden states: relative error {min(errors):.4f}..{max(errors):.4f}")
    assert max(errors) < 0.05
    # a float32 value per byte, a float32 scale per 128 values: 132 of 512 bytes
    full = sum(
        files["hidden_states"][: len(p)].nbytes
        for files, p in zip(reference.states, shared_prompts, strict=True)
    )
    assert stored[0] > 0
    assert stored[0] / full < 0.3 * 132 / 512 + 0.01


def test_an_engine_without_capture_is_unaffected_and_its_kv_never_stands_for_states(
    tiny_models: ModelSet, prompts: list[list[int]], tmp_path: Path, shm_path: Path
) -> None:
    config = embedded_yaml(tmp_path, shm_path)
    connector = kvtier_config({"kvtier_config": str(config)})
    with running_llm(tiny_models.target, kv_transfer_config=connector) as llm:
        plain = generate(llm, prompts)
        assert counter(llm, TRANSFER_BYTES, direction="store", pool="target") > 0
        assert counter(llm, TRANSFER_BYTES, direction="store", pool="hidden") == 0
    assert all(REF_FIELD not in (o.kv_transfer_params or {}) for o in plain)

    # the target's chunks are there, the hidden states' are not: no hit, they are computed
    with capturing(tiny_models.target, connector, multiprocess=False) as llm:
        captured = generate(llm, prompts)
        assert counter(llm, EXTERNAL_HITS) == 0
        assert counter(llm, TRANSFER_BYTES, direction="store", pool="hidden") > 0
    assert [o.outputs[0].token_ids for o in captured] == [o.outputs[0].token_ids for o in plain]
    with reader(config) as found:
        for prompt, out in zip(prompts, captured, strict=True):
            ref = HiddenStatesRef.from_json(out.kv_transfer_params[REF_FIELD])
            states = found.load(ref)
            assert states.states.shape == (len(prompt), 2, ref.hidden_size)
            # registered by the read as a pool of its own, never the target's
            spec = found.client.manager.registry.spec_of(ref.namespace)  # type: ignore[attr-defined]
            assert spec is not None
            assert spec.pool is Pool.HIDDEN


def test_export_on_a_node_with_only_the_object_store_writes_the_same_states(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    tmp_path: Path,
    shm_path: Path,
    s3_store: str,
    aws_irsa: AwsIrsa,
) -> None:
    serving = node_yaml(tmp_path / "serving", shm_path, s3_store)
    connector = kvtier_config({"kvtier_config": str(serving)})
    with capturing(tiny_models.target, connector) as llm:
        outputs = generate(llm, prompts, {"include_output_tokens": True})
    refs = [o.kv_transfer_params[REF_FIELD] for o in outputs]
    with reader(serving) as found:
        expected = [as_tensor(found.load(ref)) for ref in refs]
    # the engine's exit wrote its chunks to the store; the training node has none of its disks
    shutil.rmtree(tmp_path / "serving")
    listed = tmp_path / "refs.jsonl"
    listed.write_text("".join(json.dumps(ref) + "\n" for ref in refs))
    training = node_yaml(tmp_path / "training", tmp_path / "training-arena", s3_store)
    out = tmp_path / "states"
    command = [sys.executable, "-m", "kvtier.cli", "hidden", "export", "--config", str(training)]
    command += ["--to", str(out)]
    # the pool's requests, listed from the manifests in the store: nothing else is given
    namespace = {ref["namespace"] for ref in refs}.pop()
    done = subprocess.run(
        [*command, "--namespace", namespace], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert f"{len(refs)} written" in done.stdout, done.stdout
    for ref, states, output in zip(refs, expected, outputs, strict=True):
        tensors = load_file(out / file_name(HiddenStatesRef.from_json(ref)))
        assert torch.equal(tensors["hidden_states"], states)
        tokens = output.prompt_token_ids + list(output.outputs[0].token_ids)[:-1]
        assert tensors["token_ids"].tolist() == tokens

    # again, from the references the requests handed back: every file is kept, and one the
    # store does not hold fails, and says so
    missing = dict(refs[0], chunks=[bytes(32).hex()] * len(refs[0]["chunks"]))
    listed.write_text(listed.read_text() + json.dumps(missing) + "\n")
    command += ["--refs", str(listed), "--timeout", "1"]
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1, again.stdout + again.stderr
    assert f"0 written (0.0 MiB of states), {len(refs)} kept" in again.stdout
    assert "1 failed" in again.stdout


def test_a_tp2_engine_captures_the_states_a_tp1_engine_reads(
    tiny_models: ModelSet,
    shared_prompts: list[list[int]],
    reference: Reference,
    tmp_path: Path,
    shm_path: Path,
) -> None:
    """Every rank holds the whole hidden-state cache; rank 0 alone writes its chunks, and both
    ranks load them on a hit."""
    config = embedded_yaml(tmp_path, shm_path)
    connector = kvtier_config({"kvtier_config": str(config)})
    prompts = shared_prompts[:4]
    for _ in range(2):  # the second TP=2 engine hits what the first stored
        with tp_engine(tiny_models.target, 2, connector, speculative_config=CAPTURE) as llm:
            outputs = generate(llm, prompts)
            hits = counter(llm, EXTERNAL_HITS)
            loaded = counter(llm, TRANSFER_BYTES, direction="load", pool="hidden")
    assert hits > 0
    assert loaded > 0
    with reader(config) as found:
        for prompt, out, files in zip(prompts, outputs, reference.states, strict=False):
            states = as_tensor(found.load(out.kv_transfer_params[REF_FIELD]))
            # two ranks' partial sums are reduced in another order than one rank's
            torch.testing.assert_close(states, files["hidden_states"][: len(prompt)])


def test_a_sidecar_engine_captures_and_a_trainer_reads_while_kvtierd_serves(
    tiny_models: ModelSet,
    shared_prompts: list[list[int]],
    reference: Reference,
    procs: Processes,
    daemon_files: DaemonFiles,
) -> None:
    daemon = procs.start_daemon(daemon_files)
    connector = kvtier_config({"mode": "sidecar", "socket_path": str(daemon_files.socket)})
    prompts = shared_prompts[:4]
    with capturing(tiny_models.target, connector, multiprocess=False) as llm:
        outputs = generate(llm, prompts)
    assert kvtierd_value(daemon, "kvtier_tier_chunks", tier="cpu", pool="hidden") > 0
    client = GrpcTierClient(daemon_files.socket, "trainer")
    try:
        for prompt, out, files in zip(prompts, outputs, reference.states, strict=False):
            states, ids = load(out.kv_transfer_params[REF_FIELD], client)
            assert ids == prompt
            assert torch.equal(states, files["hidden_states"][: len(prompt)])
    finally:
        client.close()


def test_export_by_namespace_from_a_256_mib_arena_writes_every_request(
    tiny_models: ModelSet, prompts: list[list[int]], tmp_path: Path, shm_path: Path
) -> None:
    serving = embedded_yaml(tmp_path, shm_path)
    with capturing(tiny_models.target, kvtier_config({"kvtier_config": str(serving)})) as llm:
        outputs = generate(llm, prompts, {"include_output_tokens": True})
    refs = [o.kv_transfer_params[REF_FIELD] for o in outputs]
    # the training node's arena: 7 extents of 32 MiB, so the hidden pool's share is one extent,
    # which a slot class keeps once it takes it
    training = tmp_path / "training.yaml"
    arena = {
        "path": f"{shm_path}-training",
        "size_bytes": "256MiB",
        "extent_bytes": "32MiB",
        "min_slot_bytes": "4KiB",
    }
    training.write_text(
        yaml.safe_dump({"arena": arena, "lmdb": load_config(serving).lmdb.model_dump(mode="json")})
    )
    out = tmp_path / "states"
    command = [sys.executable, "-m", "kvtier.cli", "hidden", "export", "--config", str(training)]
    command += ["--namespace", {ref["namespace"] for ref in refs}.pop(), "--to", str(out)]
    try:
        done = subprocess.run(
            [*command, "--timeout", "5"], capture_output=True, text=True, timeout=300, check=False
        )
    finally:
        Path(arena["path"]).unlink(missing_ok=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(refs)} written" in done.stdout, done.stdout
    assert len(list(out.glob("*.safetensors"))) == len(refs)
