"""Namespaces and chunk keys.

A chunk key is ``namespace (16 bytes) || chunk hash``. The chunk hash is the engine's own block hash
of the chunk's last block, so it already commits to the whole token prefix (and cache salt, LoRA,
multimodal inputs). The namespace commits to everything else that decides whether the bytes can be
reused: model and weights, pool, dtype, page layout, shard, hash algorithm and tenant.

The data-parallel replica is deliberately absent: replicas produce identical bytes.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NewType, cast

import numpy as np

NAMESPACE_BYTES = 16
MAX_CHUNK_HASH_BYTES = 32
_ENCODING_TAG = "kvtier.namespace.v1"

# The tenant names a folder of object-store names (prefix/tenant/namespace/...): no '/', and
# never '.' or '..'.
MAX_TENANT_CHARS = 64
TENANT_PATTERN = rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_TENANT_CHARS - 1}}}"
MAX_REVISION_CHARS = 128
REVISION_PATTERN = rf"[A-Za-z0-9._:+/-]{{0,{MAX_REVISION_CHARS}}}"
MAX_MODEL_CHARS = 512
"""Models are often paths or repository ids, so any printable text is allowed."""
MAX_LAYER_NAME_CHARS = 256
MAX_KV_DTYPE_BYTES = 16
"""The chunk header's field for it (`kvtier.core.blockfmt`)."""
_TENANT = re.compile(TENANT_PATTERN)
_REVISION = re.compile(REVISION_PATTERN)


def _shown(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:80] + "...")


def check_tenant(field: str, value: str) -> None:
    if not _TENANT.fullmatch(value):
        raise ValueError(
            f"{field} must be 1..{MAX_TENANT_CHARS} characters of [A-Za-z0-9._-], not starting "
            f"with '.', got {_shown(value)}"
        )


def check_revision(field: str, value: str) -> None:
    if not _REVISION.fullmatch(value):
        raise ValueError(
            f"{field} must be at most {MAX_REVISION_CHARS} characters of [A-Za-z0-9._:+/-], "
            f"got {_shown(value)}"
        )


def check_text(field: str, value: str, limit: int) -> None:
    """Printable text of 1..limit characters: no control characters, NUL included."""
    if not 0 < len(value) <= limit or not value.isprintable():
        raise ValueError(
            f"{field} must be 1..{limit} printable characters (no control characters), "
            f"got {_shown(value)}"
        )


def check_layer_names(field: str, names: Iterable[str]) -> None:
    for i, name in enumerate(names):
        check_text(f"{field}[{i}]", name, MAX_LAYER_NAME_CHARS)


ChunkKey = NewType("ChunkKey", bytes)
"""``namespace || chunk_hash``; plain bytes so that hot-path lookups cost a dict probe."""


class Pool(enum.StrEnum):
    TARGET = "target"
    DRAFT = "draft"
    HIDDEN = "hidden"
    """Hidden states an engine captures for draft training (not attention KV)."""
    ENCODER = "encoder"
    """A multimodal encoder's outputs, per item (`kvtier.core.encoder`)."""
    STATE = "state"
    """State-space or linear-attention layers' state at the end of a chunk (not attention
    KV): one state per chunk, which a hit ending there reads."""


@dataclass(frozen=True, slots=True)
class PageLayout:
    """How one pool's KV pages are laid out, as far as byte identity is concerned."""

    tokens_per_block: int
    blocks_per_chunk: int
    num_kv_heads: int
    head_sizes: tuple[int, ...]
    """Per-tensor head sizes, e.g. ``(k, v)``; MLA has a single latent size."""
    layer_names: tuple[str, ...]
    """Layers of the pool, in payload order."""
    kv_order: str = "default"
    """Element order of one page (backends differ); part of identity so bytes never mix."""

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "blocks_per_chunk", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PageLayout.{name} must be positive")
        if not self.head_sizes or any(h <= 0 for h in self.head_sizes):
            raise ValueError("PageLayout.head_sizes must be non-empty and positive")
        if not self.layer_names:
            raise ValueError("PageLayout.layer_names must not be empty")
        check_layer_names("layout.layer_names", self.layer_names)


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """Everything that decides whether stored KV bytes may be reused."""

    model: str
    model_revision: str
    pool: Pool
    kv_dtype: str
    layout: PageLayout
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    hash_algo: str = "sha256"
    tenant: str = "default"
    draft_model: str | None = None
    """Draft pool only."""
    draft_revision: str | None = None
    """Draft pool only; a draft swap changes it and nothing else."""
    attention: str = "full"
    """What the pool's layers attend to: "full", or "sliding_window=N" for a KV-cache group
    that reads only the last N tokens (its chunks are stored only where a hit needs them); for
    the hidden pool, "hidden_states=L,..": the target layers whose hidden states it holds."""

    def __post_init__(self) -> None:
        if self.pool not in tuple(Pool):
            raise ValueError(f"pool must be one of {[str(p) for p in Pool]}, got {self.pool!r}")
        object.__setattr__(self, "pool", Pool(self.pool))
        if self.pool is Pool.DRAFT:
            if not self.draft_model or self.draft_revision is None:
                raise ValueError("a draft namespace needs draft_model and draft_revision")
        elif self.draft_model is not None or self.draft_revision is not None:
            raise ValueError("draft_model/draft_revision belong to the draft pool only")
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError("shard rank out of range")
        if not self.model or not self.kv_dtype or not self.hash_algo:
            raise ValueError("model, kv_dtype and hash_algo must be set")
        check_tenant("tenant", self.tenant)
        check_text("model", self.model, MAX_MODEL_CHARS)
        check_text("attention", self.attention, MAX_LAYER_NAME_CHARS)
        if len(self.kv_dtype.encode()) > MAX_KV_DTYPE_BYTES:
            raise ValueError(
                f"kv_dtype {self.kv_dtype!r} is longer than the chunk header's "
                f"{MAX_KV_DTYPE_BYTES} bytes"
            )
        check_revision("model_revision", self.model_revision)
        if self.draft_model is not None:
            check_text("draft_model", self.draft_model, MAX_MODEL_CHARS)
        if self.draft_revision is not None:
            check_revision("draft_revision", self.draft_revision)

    def fields(self) -> dict[str, Any]:
        """The spec as plain JSON values (`from_fields` reads them back)."""
        fields = asdict(self)
        fields["pool"] = str(self.pool)
        if self.attention == "full":
            del fields["attention"]  # at its default: namespaces of earlier versions stay valid
        return fields

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> NamespaceSpec:
        """Raises ValueError or TypeError for fields that are not a valid spec's."""
        doc = dict(fields)
        layout = dict(doc.pop("layout"))
        layout["head_sizes"] = tuple(layout["head_sizes"])
        layout["layer_names"] = tuple(layout["layer_names"])
        return cls(layout=PageLayout(**layout), **doc)

    def canonical(self) -> bytes:
        """A stable byte encoding: sorted-key JSON tagged with its own version."""
        doc = {"tag": _ENCODING_TAG, "fields": self.fields()}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        return hashlib.blake2b(self.canonical(), digest_size=NAMESPACE_BYTES).digest()

    def with_draft_revision(self, revision: str) -> NamespaceSpec:
        """The same draft pool at another revision: what a draft swap changes."""
        if self.pool is not Pool.DRAFT:
            raise ValueError("only a draft namespace has a draft revision")
        return replace(self, draft_revision=revision)

    def draft_lineage(self) -> bytes:
        """The draft pool's identity without its revision: every revision of one draft pool
        shares it, so a swap can find the namespaces it retires."""
        if self.pool is not Pool.DRAFT:
            raise ValueError("only a draft namespace has a lineage")
        return replace(self, draft_revision="").digest()


def chunk_hash_bytes(block_hash: bytes | int) -> bytes:
    """Normalise an engine block hash to bytes (ints are 8-byte big-endian, two's complement)."""
    if isinstance(block_hash, int):
        return block_hash.to_bytes(8, "big", signed=block_hash < 0)
    if not 0 < len(block_hash) <= MAX_CHUNK_HASH_BYTES:
        raise ValueError(f"chunk hash must be 1..{MAX_CHUNK_HASH_BYTES} bytes")
    return bytes(block_hash)


def make_key(namespace: bytes, block_hash: bytes | int) -> ChunkKey:
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes")
    return ChunkKey(namespace + chunk_hash_bytes(block_hash))


def namespace_of(key: ChunkKey | bytes) -> bytes:
    return key[:NAMESPACE_BYTES]


_BLANK_MARK = b"\xffkvtier-blank\xff"
"""A blank key's chunk hash begins so; a real one does with odds of 2**-112."""
MIN_BLANK_HASH_BYTES = len(_BLANK_MARK) + 2
BLANK_HOLD_S = 60.0
"""kvtierd aborts a slot reserved blank this long after it was reserved, or after
``server.reservation_timeout_s`` where that is longer; a client writes one only well before."""


def blank_key(namespace: bytes, serial: int, hash_bytes: int) -> ChunkKey:
    """A stand-in key of ``namespace`` for a slot reserved before its chunk is known: the
    store that fills the slot names the chunk when it commits it. ``hash_bytes``: the length
    of the namespace's chunk hashes (one call's keys share one length), at least
    `MIN_BLANK_HASH_BYTES`; ``serial`` tells one blank from another."""
    tail = hash_bytes - len(_BLANK_MARK)
    return ChunkKey(namespace + _BLANK_MARK + (serial % 256**tail).to_bytes(tail, "big"))


def is_blank(key: ChunkKey | bytes) -> bool:
    return key[NAMESPACE_BYTES : NAMESPACE_BYTES + len(_BLANK_MARK)] == _BLANK_MARK


def may_name(held: ChunkKey | None, key: ChunkKey) -> bool:
    """Whether a slot reserved under ``held`` is one a store of ``key`` commits or aborts:
    reserved for ``key``, or blank in ``key``'s namespace."""
    if held == key:
        return True
    return held is not None and is_blank(held) and namespace_of(held) == namespace_of(key)


def packed_namespaces(packed: bytes, key_bytes: int) -> set[bytes]:
    """The namespaces of keys packed end to end, ``key_bytes`` each, without a Python step per
    key (about 10 us for 8192 keys of one pool)."""
    if not packed:
        return set()
    if key_bytes % 8 == 0:  # the usual batch, one pool: two word compares per key
        words = np.frombuffer(packed, dtype=np.uint64).reshape(-1, key_bytes // 8)
        if (words[:, 0] == words[0, 0]).all() and (words[:, 1] == words[0, 1]).all():
            return {packed[:NAMESPACE_BYTES]}
    fields = [("namespace", f"V{NAMESPACE_BYTES}"), ("hash", f"V{key_bytes - NAMESPACE_BYTES}")]
    heads = np.frombuffer(packed, dtype=np.dtype(fields))["namespace"]
    return set(cast(list[bytes], heads.tolist()))


def namespaces_of(keys: Sequence[ChunkKey | bytes]) -> set[bytes]:
    """The namespaces of a batch of keys; a join and `packed_namespaces` when the keys are of
    one length (six times quicker than slicing each key for 8192 keys)."""
    if not keys:
        return set()
    packed = b"".join(keys)
    if len(packed) == len(keys[0]) * len(keys):
        return packed_namespaces(packed, len(keys[0]))
    return {key[:NAMESPACE_BYTES] for key in keys}


def chunk_hash_of(key: ChunkKey | bytes) -> bytes:
    return key[NAMESPACE_BYTES:]


def validate_key(key: bytes) -> ChunkKey:
    if not NAMESPACE_BYTES < len(key) <= NAMESPACE_BYTES + MAX_CHUNK_HASH_BYTES:
        raise ValueError(f"malformed chunk key of {len(key)} bytes")
    return ChunkKey(key)


def cut_at_namespaces(keys: Sequence[ChunkKey], held: frozenset[bytes]) -> Sequence[ChunkKey]:
    """The keys before the first one of a namespace in ``held``: a prefix lookup stops there."""
    if not held:
        return keys
    for i, key in enumerate(keys):
        if namespace_of(key) in held:
            return keys[:i]
    return keys
