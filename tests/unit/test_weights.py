"""The fingerprint of a checkpoint's weights: the same files give the same revision, a change
inside any sampled byte, a config or a quantisation setting gives another, reads stay bounded
for any size, and a checkpoint kvtier cannot read refuses caching unless model_revision names it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from kvtier_vllm.shared import weights
from kvtier_vllm.shared.shapes import UnsupportedGroupError
from safetensors.numpy import save_file

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2}


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {
        "model.embed_tokens.weight": (2048, 256),
        "model.layers.0.mlp.down_proj.weight": (256, 512),
        "model.layers.0.self_attn.q_proj.weight": (256, 256),
        "model.layers.1.mlp.down_proj.weight": (256, 512),
        "model.norm.weight": (256,),
        "lm_head.weight": (2048, 256),
    }
    return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}


def write_checkpoint(path: Path, seed: int = 0, config: dict[str, Any] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or CONFIG, indent=2))
    (path / "tokenizer.json").write_text('{"model": "bpe"}')
    save_file(tensors(seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def redeploy(path: Path, seed: int) -> None:
    """Other weights at ``path``, written beside it and renamed over it, as deploy tools do."""
    staging = write_checkpoint(path.with_name(path.name + ".new"), seed=seed)
    for file in staging.iterdir():
        os.replace(file, path / file.name)
    staging.rmdir()


def fp(path: Path, **settings: Any) -> str:
    return weights.fingerprint(weights.checkpoint_files(path), settings)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x01]))


def data_start(path: Path) -> int:
    with open(path, "rb") as file:
        return 8 + int.from_bytes(file.read(8), "little")


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    begin, end = header[name]["data_offsets"]
    return 8 + length + begin, end - begin


def model_config(path: Path | str, **fields: Any) -> SimpleNamespace:
    base: dict[str, Any] = {
        "model": str(path),
        "revision": None,
        "quantization": None,
        "quantization_config": None,
        "dtype": "torch.float32",
        "hf_config": SimpleNamespace(),
        "hf_overrides": {},
        "model_class_overrides": {},
        "trust_remote_code": False,
        "model_weights": "",
    }
    return SimpleNamespace(**{**base, **fields})


def vllm_config(path: Path | str, load_format: str = "auto", **fields: Any) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=model_config(path, **fields),
        load_config=SimpleNamespace(load_format=load_format, download_dir=None),
        speculative_config=None,
    )


def test_the_same_files_give_the_same_fingerprint_wherever_they_are(tmp_path: Path) -> None:
    first = write_checkpoint(tmp_path / "a")
    copy = tmp_path / "elsewhere" / "b"
    shutil.copytree(first, copy)
    (copy / "tokenizer.json").write_text('{"model": "another"}')  # token ids are in the hash
    assert fp(first) == fp(first) == fp(copy)
    assert fp(first).startswith("fp-")
    assert len(fp(first)) == len("fp-") + 16


def test_other_random_weights_of_the_same_shapes_differ(tmp_path: Path) -> None:
    assert fp(write_checkpoint(tmp_path / "a", seed=0)) != fp(
        write_checkpoint(tmp_path / "b", seed=1)
    )


@pytest.mark.parametrize(
    "where",
    [
        "header",  # the safetensors header, read whole
        "first_64k",
        "last_64k",
        "fixed_window",  # one of the 16 evenly spaced windows
        "tensor_middle",  # the window at the middle of a tensor
    ],
)
def test_one_byte_changed_inside_a_sampled_window_changes_the_fingerprint(
    tmp_path: Path, where: str
) -> None:
    path = write_checkpoint(tmp_path / "m")
    file = path / "model.safetensors"
    size = file.stat().st_size
    assert size > weights.WHOLE_FILE_BYTES  # sampled, not hashed whole
    start, length = tensor_span(file, "model.layers.0.self_attn.q_proj.weight")
    offsets = {
        "header": 40,
        "first_64k": data_start(file) + 1000,
        "last_64k": size - 1000,
        "fixed_window": (size - weights.WINDOW_BYTES) * 8 // 17 + 100,
        "tensor_middle": start + length // 2,
    }
    before = fp(path)
    flip(file, offsets[where])
    assert fp(path) != before


def test_a_small_file_is_hashed_whole(tmp_path: Path) -> None:
    path = tmp_path / "small"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    blob = bytearray(np.random.default_rng(0).bytes(512 << 10))
    (path / "model.bin").write_bytes(blob)
    before = fp(path)
    for offset in range(0, len(blob), 37 << 10):  # any byte at all
        blob[offset] ^= 1
        (path / "model.bin").write_bytes(blob)
        assert fp(path) != before
        blob[offset] ^= 1
    (path / "model.bin").write_bytes(blob)
    assert fp(path) == before


def test_a_torch_archive_is_covered_by_each_records_checksum(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "pt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    state = {k: torch.from_numpy(v) for k, v in tensors().items()}
    torch.save(state, path / "pytorch_model.bin")
    before = fp(path)
    # one element far from every window: only the record's CRC-32 can see it
    state["model.layers.0.mlp.down_proj.weight"][3, 7] += 1.0
    torch.save(state, path / "pytorch_model.bin")
    assert fp(path) != before


def test_a_config_change_changes_the_fingerprint_its_formatting_does_not(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m")
    before = fp(path)
    config = path / "config.json"
    reformatted = {"_name_or_path": "/somewhere/else", "transformers_version": "9.9", **CONFIG}
    config.write_text(json.dumps(dict(reversed(list(reformatted.items())))))
    assert fp(path) == before  # key order, whitespace and bookkeeping keys change no value
    config.write_text(json.dumps({**CONFIG, "rope_theta": 1e6}))
    assert fp(path) != before
    config.write_text(json.dumps(CONFIG))
    (path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    assert fp(path) != before


@pytest.mark.parametrize(
    "change",
    [
        {"quantization": "fp8"},  # online quantisation of the same files
        {"dtype": "torch.bfloat16"},
        {"hf_config": SimpleNamespace(quantization_config={"quant_method": "fp8"})},
        {"quantization_config": {"linear": {"method": "int8"}}},
        {"hf_overrides": {"rope_theta": 1e6}},
    ],
)
def test_what_vllm_does_to_the_weights_changes_the_fingerprint(
    tmp_path: Path, change: dict[str, Any]
) -> None:
    path = write_checkpoint(tmp_path / "m")
    plain = weights.target_revision(vllm_config(path))
    assert weights.target_revision(vllm_config(path, **change)) != plain
    assert weights.target_revision(vllm_config(path)) == plain


def test_settings_hold_no_process_specific_text() -> None:
    class Opaque:
        pass

    config = model_config("/m", hf_overrides=Opaque(), quantization_config=Opaque())
    settings = weights.settings_of(config, SimpleNamespace(load_format="auto"))
    assert " at 0x" not in json.dumps(settings)


def test_a_rewritten_checkpoint_is_read_again_and_the_same_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_checkpoint(tmp_path / "m", seed=0)
    reads: list[Path] = []
    real = weights._fingerprint

    def counted(checkpoint: weights.Checkpoint, settings: Any) -> tuple[str, int]:
        reads.append(checkpoint.root)
        return real(checkpoint, settings)

    monkeypatch.setattr(weights, "_fingerprint", counted)
    config = vllm_config(path)
    first = weights.target_revision(config)
    assert weights.target_revision(config) == first
    assert len(reads) == 1  # the scheduler and each worker of a process: read once
    redeploy(path, seed=1)  # new weights at the same path, same config
    second = weights.target_revision(config)
    assert second != first
    assert len(reads) == 2


def test_reads_are_bounded_whatever_the_size(tmp_path: Path) -> None:
    path = tmp_path / "big"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    # a sparse 58 GiB safetensors file with 20,000 tensors of 3 MiB
    count, each = 20_000, 3 << 20
    header = {
        f"t{i}": {"dtype": "F32", "shape": [each // 4], "data_offsets": [i * each, (i + 1) * each]}
        for i in range(count)
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    file = path / "model.safetensors"
    with open(file, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        out.truncate(8 + len(raw) + count * each)
    checkpoint = weights.checkpoint_files(path)
    _, read = weights._fingerprint(checkpoint, {})
    assert file.stat().st_size > 50 << 30
    most = len(raw) + 2 * weights.EDGE_BYTES + weights.WINDOWS * weights.WINDOW_BYTES
    most += weights.TENSOR_BUDGET * weights.TENSOR_WINDOW_BYTES + (1 << 10)
    assert read <= most, (read, most)


def test_a_checkpoint_in_the_hugging_face_cache_is_found_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    write_checkpoint(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    found = weights.locate("acme/tiny", None)
    assert found == repo / "snapshots" / commit
    assert weights.locate("acme/tiny", commit) == found
    # the same bytes as a local directory: the same revision
    assert weights.target_revision(vllm_config("acme/tiny")) == weights.target_revision(
        vllm_config(found)
    )


@pytest.mark.parametrize(
    ("model", "load_format", "fields"),
    [
        ("/nowhere/model", "auto", {}),  # not a path, not in the cache
        ("acme/not-downloaded", "auto", {}),
        ("{tmp}", "dummy", {}),  # random weights: the files say nothing
        ("{tmp}", "tensorizer", {}),
        ("{tmp}", "auto", {"model_weights": "s3://bucket/model"}),  # streamed from elsewhere
        ("{empty}", "auto", {}),  # a directory without weight files
    ],
)
def test_without_a_readable_checkpoint_kvtier_refuses_unless_model_revision_names_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    load_format: str,
    fields: dict[str, Any],
) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "empty").mkdir()
    write_checkpoint(tmp_path / "m")
    model = model.format(tmp=tmp_path / "m", empty=tmp_path / "empty")
    config = vllm_config(model, load_format, **fields)
    with pytest.raises(
        UnsupportedGroupError, match=r"set kv_connector_extra_config\.model_revision"
    ):
        weights.target_revision(config)
    assert weights.target_revision(config, "deploy-42") == "deploy-42"


def test_a_read_error_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_checkpoint(tmp_path / "m")

    def failing(fd: int, length: int, offset: int) -> bytes:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(weights.os, "pread", failing)
    with pytest.raises(UnsupportedGroupError, match="cannot read"):
        weights.target_revision(vllm_config(path))


def test_two_drafts_of_one_name_get_their_own_revision(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "draft", seed=0)
    config = vllm_config(tmp_path / "target")
    first = weights.draft_revision(config, model_config(path))
    redeploy(path, seed=1)  # another draft at the same path
    second = weights.draft_revision(config, model_config(path))
    assert first.startswith("fp-")
    assert second.startswith("fp-")
    assert first != second
    # unreadable: refused, unless model_revision names the deployment (then vLLM's name)
    gone = model_config(tmp_path / "gone", revision="v3")
    with pytest.raises(UnsupportedGroupError):
        weights.draft_revision(config, gone)
    assert weights.draft_revision(config, gone, "deploy-42") == "v3"
    assert weights.draft_revision(config, model_config(path), "deploy-42") == second


def test_lora_requests_are_left_uncached() -> None:
    from vllm.lora.request import LoRARequest

    assert not weights.adapter_uncached(SimpleNamespace(lora_request=None))
    adapter = LoRARequest("sql", 1, "/adapters/sql")
    assert weights.adapter_uncached(SimpleNamespace(lora_request=adapter))
