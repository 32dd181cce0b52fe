"""The strings of a namespace spec: what registration accepts, in-process and in kvtierd, and
the namespaces of a packed key batch that the data plane checks a session against."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest
from kvtier_vllm.shared.settings import parse

from kvtier.api.v1 import tier_pb2
from kvtier.core.codec import spec_from, spec_to
from kvtier.core.errors import ConfigError, InvalidRequestError
from kvtier.core.keys import (
    MAX_MODEL_CHARS,
    MAX_TENANT_CHARS,
    PageLayout,
    check_revision,
    make_key,
)
from kvtier.server.validate import batch_namespaces, unpack_keys
from tests.support import draft_spec, keys_for, layout, target_spec

GOOD_TENANTS = ["default", "acme", "team.a-1_b", "-x", "A" * MAX_TENANT_CHARS, "0"]
BAD_TENANTS = [
    "",
    ".",
    "..",
    ".hidden",
    "../x",
    "a/b",
    "a\\b",
    "a b",
    "A" * (MAX_TENANT_CHARS + 1),
    "x" * 200,
    "\x00",
    "acme\x00",
    "acme\n",
    "caf\u00e9",
]
GOOD_MODELS = [
    "tiny-llama",
    "meta-llama/Llama-3.1-8B-Instruct",
    "/models/llama 3/weights",
    "hf://org/model@main",
    "org/model:v1+fp8",
    "\u6a21\u578b",
    "m" * MAX_MODEL_CHARS,
]
BAD_MODELS = ["m\x00", "m\n", "\t", "m\x7f", "\x1b[31m", "m" * (MAX_MODEL_CHARS + 1)]
GOOD_REVISIONS = ["", "r1", "main", "refs/pr/1", "v1.0+fp-0123456789ab", "sha256:ab", "x" * 128]
BAD_REVISIONS = ["r 1", "x" * 129, "\x00", "r1\n", "r@1", "caf\u00e9", "r%2F"]


@pytest.mark.parametrize("tenant", GOOD_TENANTS)
def test_tenants_that_name_one_object_store_folder_are_accepted(tenant: str) -> None:
    assert target_spec(tenant=tenant).tenant == tenant


@pytest.mark.parametrize("tenant", BAD_TENANTS)
def test_a_tenant_that_could_break_an_object_name_is_refused(tenant: str) -> None:
    with pytest.raises(ValueError, match=r"^tenant must be 1\.\.64 characters"):
        target_spec(tenant=tenant)


@pytest.mark.parametrize("model", GOOD_MODELS)
def test_models_may_be_paths_and_repository_ids(model: str) -> None:
    assert target_spec(model=model).model == model
    assert draft_spec(draft_model=model).draft_model == model


@pytest.mark.parametrize("model", BAD_MODELS)
def test_a_model_with_control_characters_or_too_long_is_refused(model: str) -> None:
    with pytest.raises(ValueError, match=r"^model must be 1\.\.512 printable"):
        target_spec(model=model)
    with pytest.raises(ValueError, match=r"^draft_model must be 1\.\.512 printable"):
        draft_spec(draft_model=model)


@pytest.mark.parametrize("revision", GOOD_REVISIONS)
def test_revisions_of_hubs_git_and_fingerprints_are_accepted(revision: str) -> None:
    assert target_spec(model_revision=revision).model_revision == revision
    assert draft_spec(draft_revision=revision).draft_revision == revision


@pytest.mark.parametrize("revision", BAD_REVISIONS)
def test_a_revision_outside_its_characters_is_refused(revision: str) -> None:
    with pytest.raises(ValueError, match=r"^model_revision must be at most 128"):
        target_spec(model_revision=revision)
    with pytest.raises(ValueError, match=r"^draft_revision must be at most 128"):
        draft_spec(draft_revision=revision)
    with pytest.raises(ValueError, match=r"^revision must be at most 128"):
        check_revision("revision", revision)


def test_a_draft_swap_to_a_bad_revision_is_refused_by_the_spec_too() -> None:
    with pytest.raises(ValueError, match=r"^draft_revision "):
        draft_spec().with_draft_revision("d2 beta")
    assert draft_spec().with_draft_revision("d2+fp-0a1b").draft_revision == "d2+fp-0a1b"


@pytest.mark.parametrize("name", ["", "layer\x00", "layer\n1", "l" * 257])
def test_a_bad_layer_name_is_refused_naming_its_position(name: str) -> None:
    good = layout().layer_names
    with pytest.raises(ValueError, match=r"^layout\.layer_names\[1\] must be 1\.\.256 printable"):
        PageLayout(16, 4, 2, (32, 32), (good[0], name))


def test_a_refused_string_is_shown_escaped_and_cut_short() -> None:
    with pytest.raises(ValueError, match=r"^tenant ") as refused:
        target_spec(tenant="\x00" + "x" * 500)
    message = str(refused.value)
    assert "\\x00" in message
    assert "\x00" not in message
    assert len(message) < 200


def test_the_daemon_conversion_refuses_with_the_field_named() -> None:
    pb = spec_to(target_spec())
    pb.tenant = "../x"
    with pytest.raises(InvalidRequestError, match=r"invalid namespace spec: tenant must"):
        spec_from(pb)
    pb = spec_to(target_spec())
    pb.layout.layer_names[0] = "a\x00"
    with pytest.raises(InvalidRequestError, match=r"layout\.layer_names\[0\]"):
        spec_from(pb)
    pb = spec_to(target_spec())
    pb.tenant = ""  # unset: the default tenant
    assert spec_from(pb).tenant == "default"


# -- the connector's settings -----------------------------------------------------------------


@pytest.mark.parametrize("tenant", GOOD_TENANTS + BAD_TENANTS)
def test_the_connector_accepts_exactly_the_tenants_a_spec_accepts(tenant: str) -> None:
    try:
        target_spec(tenant=tenant)
    except ValueError:
        with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.tenant"):
            parse({"tenant": tenant})
    else:
        assert parse({"tenant": tenant}).tenant == tenant


@pytest.mark.parametrize("revision", GOOD_REVISIONS + BAD_REVISIONS)
def test_the_connector_accepts_exactly_the_revisions_a_spec_accepts(revision: str) -> None:
    try:
        target_spec(model_revision=revision)
    except ValueError:
        with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.model_revision"):
            parse({"model_revision": revision})
    else:
        assert parse({"model_revision": revision}).model_revision == revision


@pytest.mark.parametrize("tenant", ["default", "a" * MAX_TENANT_CHARS])
def test_a_process_local_tenant_stays_valid_and_distinct(
    monkeypatch: pytest.MonkeyPatch, tenant: str
) -> None:
    from kvtier_vllm.kv.scheduler_side.prompt_keys import stable_tenant

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo="xxhash"))
    cfg = parse({"tenant": tenant})
    local = {stable_tenant(cfg, vllm_config).tenant for _ in range(3)}
    assert len(local) == 3
    for name in local:
        assert target_spec(tenant=name).tenant == name
        assert name.startswith(tenant[:39] + "-process-")


# -- namespaces of a packed batch -------------------------------------------------------------


def _batch(keys: Sequence[bytes]) -> tier_pb2.KeyBatch:
    return tier_pb2.KeyBatch(key_bytes=len(keys[0]) if keys else 0, packed=b"".join(keys))


def test_the_namespaces_of_a_batch_are_each_pools_once() -> None:
    a, b = target_spec().digest(), target_spec(tenant="other").digest()
    assert batch_namespaces(_batch([])) == set()
    one = _batch(keys_for(a, 300))
    assert batch_namespaces(one) == {a}
    mixed = keys_for(a, 5) + keys_for(b, 1) + keys_for(a, 5, start=9)
    assert batch_namespaces(_batch(mixed)) == {a, b}
    # the same keys unpack_keys hands the servicer
    assert {k[:16] for k in unpack_keys(_batch(mixed), 100)} == {a, b}
    # a namespace differing in its last byte only is still told apart
    c = a[:-1] + bytes([a[-1] ^ 1])
    assert batch_namespaces(_batch(keys_for(a, 3) + keys_for(c, 1))) == {a, c}
    # keys whose length is no multiple of 8 (a 9-byte chunk hash) take the general path
    odd = [make_key(a, i.to_bytes(9, "big")) for i in range(40)]
    assert batch_namespaces(_batch(odd)) == {a}
    assert batch_namespaces(_batch([*odd, make_key(c, bytes(9))])) == {a, c}
