"""Speculators' hidden-states backend over a real kvtierd and a real engine capturing hidden
states (the tiny Llama, sidecar): samples found by their token ids, and those a request's
reference names, equal what kvtier's reader gives for the same requests, bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hs_connectors", reason="scripts/test.sh installs Speculators' hs-connectors")

from kvtier.hidden.reader import REF_FIELD, HiddenStatesReader, HiddenStatesRef
from kvtier.rpc import GrpcTierClient
from kvtier_speculators import KVTierHiddenStates
from kvtier_speculators.transfer import as_sample
from tests.e2e.models import ModelSet, shared_prefix_prompts, vocab_size_of
from tests.e2e.test_connector import kvtier_config
from tests.e2e.test_hidden_state_capture import capturing, generate
from tests.integration.daemon_harness import DaemonFiles, Processes, wait_for

pytestmark = pytest.mark.slow


def test_samples_captured_by_an_engine_are_read_through_kvtierd_as_the_reader_reads_them(
    tiny_models: ModelSet, procs: Processes, daemon_files: DaemonFiles
) -> None:
    procs.start_daemon(daemon_files)
    vocab = vocab_size_of(tiny_models.target)
    prompts = shared_prefix_prompts(3, vocab_size=vocab, prefix_len=256, suffix_len=40, seed=5)
    connector = kvtier_config({"mode": "sidecar", "socket_path": str(daemon_files.socket)})
    with capturing(tiny_models.target, connector, multiprocess=False) as llm:
        outputs = generate(llm, prompts)
    params = [o.kv_transfer_params for o in outputs]
    refs = [HiddenStatesRef.from_json(p[REF_FIELD]) for p in params]
    client = GrpcTierClient(daemon_files.socket, "reader")
    reader = HiddenStatesReader(client)
    transfer = KVTierHiddenStates(
        daemon_files.config, refs[0].namespace.hex(), token_ids=prompts.__getitem__, refresh_s=0.2
    )
    try:
        expected = [as_sample(reader.load(ref)) for ref in refs]
        # listed from kvtierd's lmdb: the manifests are there once written back
        wait_for(lambda: transfer.get_cached(len(prompts) - 1) is not None, 60, "manifests")
        for i, prompt in enumerate(prompts):
            sample = transfer.get_cached(i)
            assert sample is not None
            assert sample["token_ids"].tolist() == prompt
            assert sample["hidden_states"].dtype == expected[i]["hidden_states"].dtype
            assert torch.equal(sample["hidden_states"], expected[i]["hidden_states"])
        generated = transfer.get_generated(params[1])
        assert generated is not None
        assert torch.equal(generated["hidden_states"], expected[1]["hidden_states"])
        transfer.delete(params[1]["handle"])
    finally:
        transfer.close()
        reader.close()
        client.close()
