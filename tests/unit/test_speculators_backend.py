"""kvtier as Speculators' hidden-states backend, over real tiers: states and manifests written
as a capturing engine writes them (the connector's `Manifests`), flushed to lmdb, then read by
`KVTierHiddenStates` opening the node's tiers itself, as a trainer does, and through
Speculators' own `ArrowDataset`. The index and the cache are checked alone as logic."""

from __future__ import annotations

import argparse
import pickle
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("hs_connectors", reason="scripts/test.sh installs Speculators' hs-connectors")

from hs_connectors import HiddenStatesBackend
from kvtier_vllm.hidden_capture.tails import Capture, Manifests
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls
from kvtier_vllm.layout.plans import PoolPlan

from kvtier.client import ArenaAtPath, InProcessClient, shared_embedded
from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey, NamespaceSpec, PageLayout, Pool, make_key
from kvtier.hidden.reader import REF_FIELD, TOKENS_FIRST, HiddenStatesRef
from kvtier.tiering.manager import TierManager
from kvtier_speculators import KVTierHiddenStates
from kvtier_speculators.samples import ChunkCache, SampleIndex, manifest_key
from tests.support import manager_config

BLOCK, BPC, LAYERS, HIDDEN = 16, 1, 4, 512  # 64 KiB bf16 chunks of 16 tokens: the smallest slot
CHUNK = BLOCK * BPC
SPEC = NamespaceSpec(
    model="m",
    model_revision="r",
    pool=Pool.HIDDEN,
    kv_dtype="bfloat16",
    layout=PageLayout(BLOCK, BPC, LAYERS, (HIDDEN,), ("cache_only_layers.4",), TOKENS_FIRST),
    attention="hidden_states=1,2,3,4",
)
PLAN = PoolPlan(Pool.HIDDEN, SPEC.layout.layer_names, BLOCK * LAYERS * HIDDEN * 2, SPEC, BPC)
SHARED = 3 * CHUNK  # the prompts' common prefix: three whole chunks
PROMPTS = [
    [*range(100, 100 + SHARED), *range(7, 7 + 21)],  # a whole chunk of its own and a tail
    [*range(100, 100 + SHARED), *range(900, 900 + 9)],  # a tail only
]


def states_of(token_ids: list[int]) -> torch.Tensor:
    """Each token's states a function of the token and its position, as a causal model's are
    of its prefix: equal prefixes have equal states."""
    rows = torch.arange(LAYERS * HIDDEN, dtype=torch.float32).reshape(LAYERS, HIDDEN)
    ids = torch.tensor(token_ids, dtype=torch.float32)
    pos = torch.arange(len(token_ids), dtype=torch.float32)
    return (ids[:, None, None] * 0.01 + pos[:, None, None] + rows / 1000).to(torch.bfloat16)


def block_hashes(token_ids: list[int]) -> list[bytes]:
    """Blocks named by their prefix, as an engine's hashes are."""
    return [
        hash(tuple(token_ids[: (i + 1) * BLOCK])).to_bytes(8, "big", signed=True) * 4
        for i in range(len(token_ids) // BLOCK)
    ]


def capture(client: InProcessClient, token_ids: list[int]) -> dict[str, object]:
    """Store a request's states chunk by chunk and its manifest, as the connector does; its
    ``kv_transfer_params``."""
    request = SimpleNamespace(
        request_id=str(len(token_ids)),
        prompt_token_ids=token_ids,
        all_token_ids=[*token_ids, 0],
        block_hashes=block_hashes(token_ids),
        kv_transfer_params=None,
    )
    calls = TierCalls(client)
    manifests = Manifests(calls)
    ref, params = manifests.reference(Capture(PLAN), request)
    calls.hand_back(force=True)
    manifests.close()
    states = states_of(token_ids).view(torch.int16).numpy()
    arena = ArenaAtPath(client.arena_path, populate=False)
    try:
        for i, key in enumerate(ref.keys()):
            page = np.zeros((CHUNK, LAYERS, HIDDEN), np.int16)
            part = states[i * CHUNK : (i + 1) * CHUNK]
            page[: len(part)] = part
            slot = client.reserve([key])[0]
            if slot is None:
                continue  # a shared chunk the arena holds already
            arena.current().view(slot.offset, page.nbytes)[:] = page.tobytes()
            assert client.commit([slot]) == 1
    finally:
        arena.close()
    return params


@pytest.fixture
def served(shm_path: Path, tmp_path: Path) -> tuple[KVTierConfig, list[dict[str, object]]]:
    """A node's tiers after serving ``PROMPTS``: everything written back to lmdb."""
    config = manager_config(shm_path, tmp_path)
    client = InProcessClient(TierManager(config), "engine")
    try:
        client.register_pool(SPEC, PLAN.chunk_bytes)
        params = [capture(client, p) for p in PROMPTS]
        assert client.flush()
    finally:
        client.close()
    return config, params


@pytest.fixture
def transfer(
    served: tuple[KVTierConfig, list[dict[str, object]]],
) -> Iterator[KVTierHiddenStates]:
    config, params = served
    namespace = HiddenStatesRef.from_json(params[0][REF_FIELD]).namespace
    found = KVTierHiddenStates(
        config, namespace.hex(), token_ids=PROMPTS.__getitem__, through_daemon=False
    )
    yield found
    found.close()


def test_kvtier_is_registered_by_name_and_builds_from_train_args(tmp_path: Path) -> None:
    backend = HiddenStatesBackend.registry["kvtier"]
    parser = argparse.ArgumentParser()
    backend.add_train_args(parser)
    missing = parser.parse_args(["--kvtier-config", str(tmp_path / "none.yaml")])
    with pytest.raises(ConfigError):  # the config is read at once, not at the first sample
        backend.from_train_args(missing, "/data")
    (tmp_path / "kvtier.yaml").write_text("{}")
    args = parser.parse_args(["--kvtier-config", str(tmp_path / "kvtier.yaml")])
    built = backend.from_train_args(args, "/data")
    assert isinstance(built, KVTierHiddenStates)
    assert built.through_daemon
    assert built.data_path == "/data"
    assert built.namespace is None
    assert backend.build_kv_transfer_config(args)["kv_connector"] == "KVTierConnector"


def test_a_request_hands_back_the_handle_speculators_names_it_by(
    served: tuple[KVTierConfig, list[dict[str, object]]],
) -> None:
    _, params = served
    handles = {p["handle"] for p in params}
    assert len(handles) == len(PROMPTS)
    assert all(isinstance(h, str) for h in handles)


def test_samples_are_found_by_their_token_ids_and_shared_chunks_are_read_once(
    transfer: KVTierHiddenStates,
) -> None:
    for i, prompt in enumerate(PROMPTS):
        sample = transfer.get_cached(i)
        assert sample is not None
        assert sample["token_ids"].tolist() == prompt
        assert sample["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(sample["hidden_states"], states_of(prompt))
    assert transfer._samples is not None
    # three shared chunks, the first prompt's own chunk and tail, the second's tail
    assert transfer._samples.chunks_read == 6


def test_a_sample_no_engine_captured_is_missing_not_zeros(transfer: KVTierHiddenStates) -> None:
    transfer.token_ids = lambda i: [*PROMPTS[0][:SHARED], 1, 2, 3]
    assert transfer.get_cached(0) is None


def test_a_generated_sample_is_read_from_its_reference_and_delete_forgets_only_the_cache(
    served: tuple[KVTierConfig, list[dict[str, object]]],
) -> None:
    config, params = served
    transfer = KVTierHiddenStates(config, token_ids=PROMPTS.__getitem__, through_daemon=False)
    try:
        assert transfer.get_cached(0) is None  # no pool known before a generated sample
        sample = transfer.get_generated(params[1])
        assert sample is not None
        assert torch.equal(sample["hidden_states"], states_of(PROMPTS[1]))
        assert transfer._samples is not None
        assert len(transfer._samples.cache) == 4
        transfer.delete(str(params[1]["handle"]))
        assert len(transfer._samples.cache) == 0
        again = transfer.get_cached(1)  # the tiers keep the states: found by its tokens now
        assert again is not None
        assert torch.equal(again["hidden_states"], sample["hidden_states"])
    finally:
        transfer.close()


def test_a_trainer_and_an_engine_in_one_process_share_the_arena_it_has_one_owner_of(
    transfer: KVTierHiddenStates,
) -> None:
    assert transfer.get_cached(0) is not None  # the trainer opened the tiers
    engine = shared_embedded(transfer.config, "engine")  # as the connector opens them
    try:
        assert transfer._session is not None
        trainer = transfer._session.client
        assert isinstance(trainer, InProcessClient)
        assert engine.manager is trainer.manager
    finally:
        engine.close()
    again = transfer.get_cached(1)  # the engine's leaving closed nothing of the trainer's
    assert again is not None
    assert torch.equal(again["hidden_states"], states_of(PROMPTS[1]))


def test_speculators_arrow_dataset_reads_its_samples_from_kvtier(
    transfer: KVTierHiddenStates, tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    from datasets.table import InMemoryTable
    from speculators.train.data import ArrowDataset

    rows = {
        "input_ids": PROMPTS,
        "loss_mask": [[1] * len(p) for p in PROMPTS],
        "seq_len": [len(p) for p in PROMPTS],
    }
    # named here: datasets would otherwise name it by pickling its table with dill, which fails
    # on pyarrow's newer types
    data = datasets.Dataset(InMemoryTable(pa.table(rows)), fingerprint="kvtier-prompts")
    data.set_format("torch")
    data.save_to_disk(str(tmp_path / "data"))
    transfer.token_ids = None  # read from the dataset, as from_train_args builds it
    transfer.data_path = tmp_path / "data"
    dataset = ArrowDataset(256, tmp_path / "data", transfer=transfer, on_missing="raise")
    for i, prompt in enumerate(PROMPTS):
        item = dataset[i]
        assert isinstance(item, dict)
        expected = states_of(prompt)
        assert torch.equal(item["hidden_states"], expected[:, :-1].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], expected[:, -1])
        assert item["input_ids"].tolist() == prompt
    # dataloader workers get a copy: nothing open, nor the dataset's column, is pickled
    copy = pickle.loads(pickle.dumps(transfer))
    assert copy._session is None
    assert copy._tokens is None


def test_the_chunk_cache_keeps_its_bound_dropping_the_least_recently_used() -> None:
    cache = ChunkCache(max_bytes=30)
    keys = [make_key(b"n" * 16, bytes([i]) * 32) for i in range(4)]
    for key in keys[:3]:
        cache.put(key, b"x" * 10)
    assert cache.get(keys[0]) is not None  # now the most recent
    cache.put(keys[3], b"y" * 10)
    assert cache.get(keys[1]) is None
    assert cache.get(keys[0]) is not None
    assert cache.nbytes == 30
    cache.put(keys[1], b"z" * 31)  # larger than the bound: not kept, nothing pushed out
    assert cache.get(keys[1]) is None
    assert len(cache) == 3


def test_the_index_lists_again_only_past_its_interval_and_reads_each_manifest_once() -> None:
    now = [0.0]
    listed: list[ChunkKey] = []
    read: list[list[ChunkKey]] = []
    refs: dict[ChunkKey, HiddenStatesRef] = {}

    def ref_of(ids: tuple[int, ...]) -> HiddenStatesRef:
        return HiddenStatesRef(SPEC, (b"c" * 32,), len(ids), ids)

    def read_refs(keys: object) -> list[HiddenStatesRef]:
        assert isinstance(keys, list)
        read.append(keys)
        return [refs[k] for k in keys]

    index = SampleIndex(lambda: list(listed), read_refs, refresh_s=5.0, clock=lambda: now[0])
    first = make_key(b"m" * 16, b"1" * 32)
    listed.append(first)
    refs[first] = ref_of((1, 2))
    assert index.find([1, 2]) == refs[first]
    second = make_key(b"m" * 16, b"2" * 32)
    listed.append(second)
    refs[second] = ref_of((3,))
    assert index.find([3]) is None  # listed a moment ago: not again yet
    now[0] = 5.0
    assert index.find([3]) == refs[second]
    assert read == [[first], [second]]


def test_the_index_keeps_its_bound_and_reads_a_dropped_sample_again() -> None:
    read: list[list[ChunkKey]] = []
    refs = [HiddenStatesRef(SPEC, (bytes([i]) * 32,), 1, (i,)) for i in range(3)]
    manifests = {manifest_key(r): r for r in refs}

    def read_refs(keys: object) -> list[HiddenStatesRef]:
        assert isinstance(keys, list)
        read.append(keys)
        return [manifests[k] for k in keys]

    # the clock stands still: only a dropped sample lists the manifests again
    index = SampleIndex(lambda: list(manifests), read_refs, max_samples=2, clock=lambda: 0.0)
    assert index.find([0]) == refs[0]
    assert len(index) == 2
    assert index.find([1]) == refs[1]  # dropped for 0, the most recently found: read again
    assert len(index) == 2
    assert index.find([0]) == refs[0]  # held: nothing read
    keys = list(manifests)
    assert read == [keys, [keys[1]]]
    with pytest.raises(ValueError, match="max_samples"):
        SampleIndex(lambda: [], read_refs, max_samples=0)


def test_a_backend_bounded_to_one_sample_still_reads_each_sample_it_is_asked_for(
    served: tuple[KVTierConfig, list[dict[str, object]]],
) -> None:
    config, params = served
    namespace = HiddenStatesRef.from_json(params[0][REF_FIELD]).namespace
    transfer = KVTierHiddenStates(
        config,
        namespace.hex(),
        token_ids=PROMPTS.__getitem__,
        through_daemon=False,
        max_samples=1,
    )
    try:
        for i in (0, 1, 0):
            sample = transfer.get_cached(i)
            assert sample is not None
            assert torch.equal(sample["hidden_states"], states_of(PROMPTS[i]))
        assert transfer._index is not None
        assert len(transfer._index) == 1
    finally:
        transfer.close()


def test_the_index_bound_is_a_train_argument(tmp_path: Path) -> None:
    backend = HiddenStatesBackend.registry["kvtier"]
    parser = argparse.ArgumentParser()
    backend.add_train_args(parser)
    (tmp_path / "kvtier.yaml").write_text("{}")
    config = ["--kvtier-config", str(tmp_path / "kvtier.yaml")]
    built = backend.from_train_args(parser.parse_args([*config, "--kvtier-max-samples", "8"]), "/d")
    assert isinstance(built, KVTierHiddenStates)
    assert built.max_samples == 8
