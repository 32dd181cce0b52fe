"""References to captured hidden states, their chunks' layouts, fp8 decoding and the export's
files: the logic, against torch and the safetensors library as the references."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from kvtier_vllm.hidden_capture.tensors import as_tensor
from kvtier_vllm.layout.fp8 import Fp8Layout, decode, encode
from safetensors.torch import load_file

from kvtier.core.keys import NamespaceSpec, PageLayout, Pool
from kvtier.hidden.export import file_name, read_refs, write_states
from kvtier.hidden.reader import (
    HEADS_FIRST,
    TOKENS_FIRST,
    HiddenStatesError,
    HiddenStatesRef,
    assemble,
    tail_hash,
)

BLOCK, LAYERS, HIDDEN = 4, 3, 8


def spec(dtype: str = "float32", order: str = HEADS_FIRST, bpc: int = 2) -> NamespaceSpec:
    return NamespaceSpec(
        model="m",
        model_revision="r",
        pool=Pool.HIDDEN,
        kv_dtype=dtype,
        layout=PageLayout(BLOCK, bpc, LAYERS, (HIDDEN,), ("cache_only_layers.2",), order),
        attention="hidden_states=0,2,5",
    )


def ref_of(tokens: int, **kwargs: str | int) -> HiddenStatesRef:
    s = spec(**kwargs)  # type: ignore[arg-type]
    chunk_tokens = BLOCK * s.layout.blocks_per_chunk
    chunks = tuple((i + 1).to_bytes(2, "little") * 16 for i in range(-(-tokens // chunk_tokens)))
    return HiddenStatesRef(s, chunks, tokens, tuple(range(tokens)))


def chunk_bytes(states: torch.Tensor, order: str, bpc: int = 2) -> bytes:
    """One chunk as the cache holds it: bpc pages of [tokens, layers, hidden] (NHC) or
    [layers, tokens, hidden] (HNC)."""
    pages = states.reshape(bpc, BLOCK, LAYERS, HIDDEN)
    if order == HEADS_FIRST:
        pages = pages.transpose(1, 2)
    return pages.contiguous().numpy().tobytes()


@pytest.mark.parametrize("order", [HEADS_FIRST, TOKENS_FIRST])
def test_chunks_assemble_into_tokens_layers_hidden_in_either_page_order(order: str) -> None:
    states = torch.randn(2 * 2 * BLOCK, LAYERS, HIDDEN)  # two chunks of two blocks
    ref = ref_of(13, order=order)  # the second chunk holds 5 of its 8 tokens
    payloads = [chunk_bytes(states[:8], order), chunk_bytes(states[8:], order)]
    got = assemble(ref, payloads)
    assert got.states.shape == (13, LAYERS, HIDDEN)
    assert torch.equal(as_tensor(got), states[:13])


def test_bfloat16_states_keep_their_bits() -> None:
    states = torch.randn(8, LAYERS, HIDDEN).to(torch.bfloat16)
    pages = states.reshape(2, BLOCK, LAYERS, HIDDEN).transpose(1, 2).contiguous()
    payload = pages.view(torch.uint16).numpy().tobytes()
    got = assemble(ref_of(7, dtype="bfloat16"), [payload])
    assert got.states.dtype == np.uint16
    assert torch.equal(as_tensor(got), states[:7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_chunks_decode_as_the_workers_codec_does(dtype: torch.dtype) -> None:
    # magnitudes apart by orders between rows: each row has its own scale
    states = (torch.randn(8, LAYERS, HIDDEN) * torch.logspace(-3, 3, LAYERS)[None, :, None]).to(
        dtype
    )
    codec = Fp8Layout(2, (LAYERS, BLOCK, HIDDEN))
    pages = states.reshape(2, BLOCK, LAYERS, HIDDEN).transpose(1, 2)
    chunk = torch.zeros(2 * codec.page_bytes, dtype=torch.uint8)
    values, scales = codec.split(chunk)
    values[:], scales[:] = encode(pages)
    name = str(dtype).removeprefix("torch.")
    got = as_tensor(assemble(ref_of(8, dtype=f"e4m3:{name}"), [chunk.numpy().tobytes()]))
    back = decode(values, scales, codec.page_shape, dtype).transpose(1, 2).reshape(8, LAYERS, -1)
    assert torch.equal(got, back)
    error = (got.float() - states.float()).norm(dim=-1) / states.float().norm(dim=-1)
    assert float(error.max()) < 0.06  # e4m3: 3 mantissa bits


def test_every_fp8_byte_decodes_as_torch_reads_it() -> None:
    from kvtier.hidden.reader import _FP8_VALUES

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(_FP8_VALUES, expected, equal_nan=True)


def test_a_reference_survives_json_and_refuses_what_does_not_add_up() -> None:
    ref = ref_of(13)
    again = HiddenStatesRef.from_json(json.loads(json.dumps(ref.to_json())))
    assert again == ref
    assert again.layers == (0, 2, 5)
    assert again.chunk_bytes == 2 * BLOCK * LAYERS * HIDDEN * 4
    doc = ref.to_json()
    with pytest.raises(HiddenStatesError, match="not its spec's"):
        HiddenStatesRef.from_json(dict(doc, namespace="00" * 16))
    with pytest.raises(HiddenStatesError, match="version"):
        HiddenStatesRef.from_json(dict(doc, version=99))
    with pytest.raises(HiddenStatesError, match="malformed"):
        HiddenStatesRef.from_json(dict(doc, chunks=["zz"]))
    with pytest.raises(HiddenStatesError, match="cannot hold"):
        replace(ref, tokens=40)
    with pytest.raises(HiddenStatesError, match="token ids"):
        replace(ref, token_ids=(1, 2))
    with pytest.raises(HiddenStatesError, match="hidden pool"):
        HiddenStatesRef(replace(spec(), pool=Pool.TARGET), ref.chunks, 13)
    with pytest.raises(HiddenStatesError, match="dtype"):
        HiddenStatesRef(spec(dtype="int8"), ref.chunks, 13)


def test_a_chunk_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(HiddenStatesError, match="bytes"):
        assemble(ref_of(8), [b"\0" * 10])


def test_tail_names_differ_by_what_came_before_and_by_their_tokens() -> None:
    assert tail_hash(b"a", [1, 2]) == tail_hash(b"a", [1, 2])
    assert len({tail_hash(b"a", [1, 2]), tail_hash(b"b", [1, 2]), tail_hash(b"a", [1, 3])}) == 3
    assert tail_hash(b"", [1]) != tail_hash(b"\0", [1])


def test_an_exported_file_is_read_by_safetensors(tmp_path: Path) -> None:
    states = torch.randn(8, LAYERS, HIDDEN).to(torch.bfloat16)
    pages = states.reshape(2, BLOCK, LAYERS, HIDDEN).transpose(1, 2).contiguous()
    ref = ref_of(7, dtype="bfloat16")
    got = assemble(ref, [pages.view(torch.uint16).numpy().tobytes()])
    path = tmp_path / file_name(ref)
    write_states(path, got, tuple(range(7)))
    tensors = load_file(path)
    assert torch.equal(tensors["hidden_states"], states[:7])
    assert tensors["token_ids"].tolist() == list(range(7))
    assert not list(tmp_path.glob("*.partial"))


def test_a_refs_file_names_its_bad_line_and_filters_by_namespace(tmp_path: Path) -> None:
    one, other = ref_of(8), ref_of(8, bpc=1)
    listed = tmp_path / "refs.jsonl"
    listed.write_text(f"{json.dumps(one.to_json())}\n\n{json.dumps(other.to_json())}\n")
    assert read_refs(listed, None) == [one, other]
    assert read_refs(listed, other.namespace) == [other]
    listed.write_text(listed.read_text() + "{}\n")
    with pytest.raises(HiddenStatesError, match=r"refs\.jsonl:4"):
        read_refs(listed, None)


def test_a_kv_dtype_the_chunk_header_cannot_hold_is_refused_at_registration() -> None:
    # found writing fp8 states back to lmdb: the name must fit the header's 16 bytes
    assert spec(dtype="e4m3:bfloat16").kv_dtype == "e4m3:bfloat16"
    with pytest.raises(ValueError, match="16 bytes"):
        spec(dtype="fp8_e4m3:bfloat16")


def test_a_long_reference_is_a_manifest_of_several_parts_of_one_size() -> None:
    from kvtier.hidden.reader import MANIFEST_PART_BYTES, _part, manifest_name, manifest_parts

    ref = ref_of(24000, bpc=1)  # 6,000 chunks and 24,000 token ids: over 64 KiB of JSON
    parts = manifest_parts(ref)
    assert len(parts) > 1
    assert parts[0][0] == manifest_name(ref)
    assert len({name for name, _ in parts}) == len(parts)
    assert all(len(payload) <= MANIFEST_PART_BYTES for _, payload in parts)
    pieces = [_part(payload) for _, payload in parts]
    assert [(i, n) for i, n, _ in pieces] == [(i, len(parts)) for i in range(len(parts))]
    body = b"".join(piece for _, _, piece in pieces)
    assert HiddenStatesRef.from_json(json.loads(body)) == ref
    with pytest.raises(HiddenStatesError, match="manifest part"):
        _part(b"x" * 64)
