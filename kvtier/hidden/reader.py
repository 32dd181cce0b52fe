"""Captured hidden states: what a finished request's reference names, and reading it back.

An engine capturing hidden states for draft training stores them as the chunks of a pool of
their own (`Pool.HIDDEN`), keyed by the engine's block hashes like KV, so a prefix many requests
share is stored once. A request's states are its whole chunks, then at most one tail chunk for
the tokens past the last whole one, keyed by its content (`tail_hash`). The reference names
those chunks and how to lay their bytes out; it travels as JSON in the request's
``kv_transfer_params``, under `REF_FIELD`.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.core.errors import KVTierError
from kvtier.core.keys import (
    MAX_CHUNK_HASH_BYTES,
    ChunkKey,
    NamespaceSpec,
    PageLayout,
    Pool,
    make_key,
    namespace_of,
)
from kvtier.core.protocol import SlotRef, TierClient
from kvtier.tiers.arena import ArenaAtPath, ArenaMemory

REF_FIELD = "kvtier_hidden_states"
REF_VERSION = 1
HEADS_FIRST = "HNC"
"""A page as [layers, tokens, hidden] (the layout's heads are the captured layers)."""
TOKENS_FIRST = "NHC"
"""A page as [tokens, layers, hidden]."""
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
FP8 = "e4m3"
"""Stored as fp8 e4m3 with a float32 scale per (token, layer) row: ``e4m3:<captured>``."""
_NUMPY = {"float32": np.float32, "float16": np.float16}
"""Dtypes numpy holds; others (bfloat16) are handed out as raw integers of their width."""
_RAW = {2: np.uint16, 4: np.uint32}
_TAIL_TAG = b"kvtier.hidden.reader.tail.v1"
HIDDEN_ATTENTION = "hidden_states"
"""The hidden pool's ``NamespaceSpec.attention``: ``hidden_states=L,..``, the layers captured."""


MANIFEST_PART_BYTES = 64 << 10
"""A manifest (a reference, kept in the tiers so that a pool's requests can be listed) is
stored in parts of this size: one chunk size for every reference, however long (the arena's
default smallest slot)."""
_PART = struct.Struct("<8sIII")  # magic, index, parts, bytes of JSON in this one
_PART_MAGIC = b"KVTHREF1"


class HiddenStatesError(KVTierError):
    """A reference that cannot be read: malformed, or naming chunks the tiers no longer hold."""


def tail_hash(previous: bytes, token_ids: Sequence[int]) -> bytes:
    """The key hash of a tail chunk: the chunk before it (b"" for none) and its tokens, so equal
    requests share it and no other chunk is ever named by it."""
    digest = hashlib.blake2b(_TAIL_TAG, digest_size=32)
    digest.update(len(previous).to_bytes(2, "little") + previous)
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return digest.digest()


@dataclass(frozen=True, slots=True)
class HiddenStatesRef:
    """Where one request's hidden states are: the hidden pool's namespace spec (its digest is
    the namespace, and it says how a chunk's bytes are laid out) and the chunks, in order."""

    spec: NamespaceSpec
    chunks: tuple[bytes, ...]
    """Key hashes, in token order; the last one may be a tail, holding fewer tokens."""
    tokens: int
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.spec.pool is not Pool.HIDDEN:
            raise HiddenStatesError(f"a {self.spec.pool} pool's spec, not the hidden pool's")
        stored = self.spec.kv_dtype
        if self.dtype not in _ITEMSIZE or (stored != self.dtype and not self.fp8):
            raise HiddenStatesError(
                f"dtype {stored!r} is none of {sorted(_ITEMSIZE)}, nor {FP8}:<one of them>"
            )
        if self.order not in (HEADS_FIRST, TOKENS_FIRST):
            raise HiddenStatesError(f"order must be {HEADS_FIRST} or {TOKENS_FIRST}")
        if not self.layers or len(self.layers) != self.spec.layout.num_kv_heads:
            raise HiddenStatesError(f"layers {self.spec.attention!r} do not match the layout")
        if self.tokens < 0 or len(self.chunks) != -(-self.tokens // self.chunk_tokens):
            raise HiddenStatesError(
                f"{len(self.chunks)} chunks cannot hold {self.tokens} tokens of {self.chunk_tokens}"
            )
        if any(not 0 < len(h) <= MAX_CHUNK_HASH_BYTES for h in self.chunks):
            raise HiddenStatesError(f"chunk hashes must be 1..{MAX_CHUNK_HASH_BYTES} bytes")
        if self.token_ids is not None and len(self.token_ids) != self.tokens:
            raise HiddenStatesError(f"{len(self.token_ids)} token ids for {self.tokens} tokens")

    @property
    def namespace(self) -> bytes:
        return self.spec.digest()

    @property
    def dtype(self) -> str:
        """The captured dtype, which reads return."""
        return self.spec.kv_dtype.rpartition(":")[2]

    @property
    def fp8(self) -> bool:
        return self.spec.kv_dtype.startswith(FP8 + ":")

    @property
    def layers(self) -> tuple[int, ...]:
        """The target layers captured, in the order of the states' second dimension."""
        name, _, ids = self.spec.attention.partition("=")
        try:
            return tuple(int(i) for i in ids.split(",")) if name == HIDDEN_ATTENTION else ()
        except ValueError:
            return ()

    @property
    def hidden_size(self) -> int:
        return self.spec.layout.head_sizes[0]

    @property
    def tokens_per_block(self) -> int:
        return self.spec.layout.tokens_per_block

    @property
    def order(self) -> str:
        return self.spec.layout.kv_order

    @property
    def chunk_tokens(self) -> int:
        return self.tokens_per_block * self.spec.layout.blocks_per_chunk

    @property
    def chunk_bytes(self) -> int:
        rows = self.chunk_tokens * len(self.layers)
        if self.fp8:
            return rows * (self.hidden_size + 4)  # a byte per value, a scale per row
        return rows * self.hidden_size * _ITEMSIZE[self.dtype]

    def keys(self) -> list[ChunkKey]:
        namespace = self.namespace
        return [make_key(namespace, h) for h in self.chunks]

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "version": REF_VERSION,
            "namespace": self.namespace.hex(),
            "spec": self.spec.fields(),
            "chunks": [h.hex() for h in self.chunks],
            "tokens": self.tokens,
        }
        if self.token_ids is not None:
            doc["token_ids"] = list(self.token_ids)
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> HiddenStatesRef:
        """Raises `HiddenStatesError`, saying what is wrong, for anything but a reference of a
        version this reader knows, whose namespace is its spec's."""
        if not isinstance(doc, dict) or doc.get("version") != REF_VERSION:
            version = doc.get("version") if isinstance(doc, dict) else None
            raise HiddenStatesError(f"not a version-{REF_VERSION} reference (version {version})")
        try:
            ids = doc.get("token_ids")
            ref = cls(
                spec=NamespaceSpec.from_fields(doc["spec"]),
                chunks=tuple(bytes.fromhex(h) for h in doc["chunks"]),
                tokens=int(doc["tokens"]),
                token_ids=None if ids is None else tuple(int(i) for i in ids),
            )
            named = bytes.fromhex(doc["namespace"])
        except (KeyError, TypeError, ValueError) as exc:
            raise HiddenStatesError(f"malformed reference: {exc!r}") from None
        if named != ref.namespace:
            raise HiddenStatesError(
                f"namespace {named.hex()} is not its spec's ({ref.namespace.hex()})"
            )
        return ref


@dataclass
class HiddenStates:
    """One request's states as [tokens, layers, hidden]; ``states`` has the captured dtype
    where numpy has it, else (bfloat16) the raw bits as unsigned integers of its width
    (`kvtier_vllm.hidden_states.as_tensor` makes a torch tensor of either)."""

    states: np.ndarray
    dtype: str
    layers: tuple[int, ...]
    token_ids: tuple[int, ...] | None = None


def assemble(ref: HiddenStatesRef, payloads: Sequence[bytes | memoryview]) -> HiddenStates:
    """The states from the chunks' bytes, in the reference's order."""
    if len(payloads) != len(ref.chunks):
        raise HiddenStatesError(
            f"{len(payloads)} chunks read, the reference names {len(ref.chunks)}"
        )
    width = _ITEMSIZE[ref.dtype]
    dtype = _NUMPY.get(ref.dtype, _RAW[width])
    layers, hidden, block = len(ref.layers), ref.hidden_size, ref.tokens_per_block
    parts = []
    for payload in payloads:
        if len(payload) != ref.chunk_bytes:
            raise HiddenStatesError(f"a chunk of {len(payload)} bytes, not {ref.chunk_bytes}")
        if ref.fp8:
            pages = _decode_fp8(payload, hidden, ref.dtype)
        else:
            pages = np.frombuffer(payload, dtype)
        if ref.order == HEADS_FIRST:  # [blocks, layers, tokens, hidden]
            pages = pages.reshape(-1, layers, block, hidden).transpose(0, 2, 1, 3)
        parts.append(pages.reshape(-1, layers, hidden))
    states = np.concatenate(parts)[: ref.tokens] if parts else np.empty((0, layers, hidden), dtype)
    return HiddenStates(np.ascontiguousarray(states), ref.dtype, ref.layers, ref.token_ids)


def _fp8_values() -> np.ndarray:
    """Every e4m3 (``float8_e4m3fn``) byte's value: sign, 4 exponent bits (bias 7), 3 mantissa
    bits; no infinities, and S.1111.111 is NaN."""
    code = np.arange(256)
    exponent, mantissa = (code >> 3) & 0xF, (code & 7) / 8.0
    value = np.where(
        exponent == 0, mantissa * 2.0**-6, (1 + mantissa) * 2.0 ** (exponent.astype(float) - 7)
    )
    value = np.where((exponent == 15) & ((code & 7) == 7), np.nan, value)
    return np.where(code & 0x80, -value, value).astype(np.float32)


_FP8_VALUES = _fp8_values()


def _decode_fp8(payload: bytes | memoryview, hidden: int, dtype: str) -> np.ndarray:
    """A chunk's fp8 values times their rows' scales, in ``dtype`` (bfloat16 as raw bits, rounded
    to nearest even as torch casts)."""
    raw = np.frombuffer(payload, dtype=np.uint8)
    rows = len(raw) // (hidden + 4)
    values = _FP8_VALUES[raw[: rows * hidden]].reshape(rows, hidden)
    states = values * np.frombuffer(raw[rows * hidden :], dtype="<f4").reshape(rows, 1)
    if dtype in _NUMPY:
        return np.asarray(states, dtype=_NUMPY[dtype])
    bits = states.view(np.uint32)
    return np.asarray((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, dtype=np.uint16)


@dataclass
class HiddenStatesReader:
    """Reads references through any `TierClient`: the chunks the arena holds at once, the others
    once promoted from lmdb or the object store, whichever holds them. The tiers checked each
    chunk's checksum on its way up; a chunk held by no tier fails the read, never a zero."""

    client: TierClient
    timeout_s: float = 30.0
    """How long a chunk may take to appear: a tail is written after its request ends."""
    poll_s: float = 0.02
    below: Callable[[ChunkKey, int], bytes | None] | None = None
    """Reads a chunk, verified, from the tiers below the arena (an exporter's own lmdb), or
    None: manifests, read once each, are read so and take no arena slot, which a small arena's
    hidden pool needs for the states."""
    _arena: ArenaAtPath | None = field(default=None, init=False)
    _registered: set[bytes] = field(default_factory=set, init=False)

    def load(self, ref: HiddenStatesRef | dict[str, Any]) -> HiddenStates:
        if not isinstance(ref, HiddenStatesRef):
            ref = HiddenStatesRef.from_json(ref)
        self._register(ref.spec, ref.chunk_bytes)
        return assemble(ref, self._read(ref.keys()))

    def read_chunks(self, ref: HiddenStatesRef, hashes: Sequence[bytes]) -> list[bytes]:
        """The payloads of some of ``ref``'s chunks (by key hash), in order: for a caller that
        keeps chunks shared by many references and reads only those it lacks."""
        self._register(ref.spec, ref.chunk_bytes)
        return self._read([make_key(ref.namespace, h) for h in hashes])

    def _read(self, keys: list[ChunkKey]) -> list[bytes]:
        if not keys:
            return []
        refs = self._lease(keys)
        try:
            arena = self._memory()
            return [bytes(arena.view(r.offset, r.nbytes)) for r in refs]
        finally:
            self.client.release(refs)

    def _register(self, spec: NamespaceSpec, chunk_bytes: int) -> None:
        namespace = spec.digest()
        if namespace not in self._registered:  # the tiers serve registered pools only
            self.client.register_pool(spec, chunk_bytes)
            self._registered.add(namespace)

    def manifest(self, namespace: bytes, name: bytes, tenant: str = "default") -> HiddenStatesRef:
        """The reference whose manifest is named ``name`` in hidden pool ``namespace``."""
        spec = manifest_spec(namespace, tenant)
        self._register(spec, MANIFEST_PART_BYTES)
        manifests = spec.digest()
        first = self._read_manifests([make_key(manifests, name)])[0]
        index, parts, piece = _part(first)
        if index != 0:
            raise HiddenStatesError(f"{name.hex()} is part {index} of a manifest, not its first")
        rest = self._read_manifests(
            [make_key(manifests, _part_hash(name, i)) for i in range(1, parts)]
        )
        pieces = [piece] + [_part(payload)[2] for payload in rest]
        try:
            return HiddenStatesRef.from_json(json.loads(b"".join(pieces)))
        except ValueError as exc:
            raise HiddenStatesError(f"manifest {name.hex()} is not JSON: {exc}") from None

    def manifest_names(
        self, namespace: bytes, keys: Sequence[ChunkKey], tenant: str = "default"
    ) -> list[bytes]:
        """Of ``keys`` (a listing of hidden pool ``namespace``'s manifest chunks), the names of
        the manifests: their first parts."""
        self._register(manifest_spec(namespace, tenant), MANIFEST_PART_BYTES)
        names = []
        for key, payload in zip(keys, self._read_manifests(list(keys)), strict=True):
            try:
                index, _, _ = _part(payload)
            except HiddenStatesError:
                continue
            if index == 0:
                names.append(bytes(key[len(namespace_of(key)) :]))
        return names

    def _read_manifests(self, keys: list[ChunkKey]) -> list[bytes]:
        """Manifest parts: from below the arena where the reader can, else through it."""
        found = [self.below(k, MANIFEST_PART_BYTES) if self.below else None for k in keys]
        rest = self._read([k for k, got in zip(keys, found, strict=True) if got is None])
        fill = iter(rest)
        return [got if got is not None else next(fill) for got in found]

    def _lease(self, keys: list[ChunkKey]) -> list[SlotRef]:
        held: dict[ChunkKey, SlotRef] = {}
        deadline = time.monotonic() + self.timeout_s
        while True:
            wanted = [k for k in keys if k not in held]
            for key, got in zip(wanted, self.client.lease(wanted), strict=True):
                if got is not None:
                    held[key] = got
            missing = [k for k in keys if k not in held]
            if not missing:
                return [held[k] for k in keys]
            if time.monotonic() >= deadline:
                self.client.release(list(held.values()))
                raise HiddenStatesError(self._why_missing(missing, len(keys)))
            # a lookup probes the object store for chunks no index knows (a fresh node)
            self.client.lookup(missing, again=True)
            self.client.promote(missing)
            time.sleep(self.poll_s)

    def _why_missing(self, missing: list[ChunkKey], asked: int) -> str:
        """Chunks a lower tier holds but that never reached the arena are told apart from
        chunks no tier holds: they need room in the arena, not a capture."""
        below = [k for k in missing if self.client.lookup([k], again=True).hits]
        if not below:
            return (
                f"{len(missing)} of {asked} chunks are in no tier after {self.timeout_s:g} s "
                f"(evicted, or never stored); first missing: {missing[0].hex()}"
            )
        return (
            f"{len(below)} of {asked} chunks are in lmdb or the object store but were not "
            f"promoted into the arena within {self.timeout_s:g} s: their pool has no free arena "
            "slot of their size (a small arena gives the hidden pool one extent, which another "
            "slot class may hold); read with a larger arena.size_bytes, a smaller "
            f"arena.extent_bytes or a larger pool share; first: {below[0].hex()}"
        )

    def _memory(self) -> ArenaMemory:
        path = self.client.arena_path
        if self._arena is None or self._arena.path != path:
            self.close()
            self._arena = ArenaAtPath(path, populate=False)  # it reads a few slots
        return self._arena.current()

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None


def manifest_spec(namespace: bytes, tenant: str = "default") -> NamespaceSpec:
    """The pool holding the manifests of hidden pool ``namespace``: named by that namespace
    alone, so a node that knows nothing else can list and read them."""
    return NamespaceSpec(
        model="kvtier.hidden.reader-states.manifests",
        model_revision="",
        pool=Pool.HIDDEN,
        kv_dtype="json",
        layout=PageLayout(1, 1, 1, (MANIFEST_PART_BYTES,), ("manifest",)),
        tenant=tenant,
        attention=f"manifests_of={namespace.hex()}",
    )


def manifest_name(ref: HiddenStatesRef) -> bytes:
    """A reference's name: its chunks and tokens (equal requests share it)."""
    digest = hashlib.blake2b(b"kvtier.hidden.reader.manifest.v1", digest_size=32)
    digest.update(ref.namespace + ref.tokens.to_bytes(8, "little") + b"".join(ref.chunks))
    return digest.digest()


def _part_hash(name: bytes, index: int) -> bytes:
    if index == 0:
        return name
    return hashlib.blake2b(name + index.to_bytes(4, "little"), digest_size=32).digest()


def manifest_parts(ref: HiddenStatesRef) -> list[tuple[bytes, bytes]]:
    """(key hash, payload) of each part of the reference's manifest, the first one named by
    `manifest_name`."""
    body = json.dumps(ref.to_json(), separators=(",", ":")).encode()
    room = MANIFEST_PART_BYTES - _PART.size
    pieces = [body[i : i + room] for i in range(0, len(body), room)]
    name = manifest_name(ref)
    return [
        (_part_hash(name, i), _PART.pack(_PART_MAGIC, i, len(pieces), len(piece)) + piece)
        for i, piece in enumerate(pieces)
    ]


def _part(payload: bytes | memoryview) -> tuple[int, int, bytes]:
    """(index, parts, JSON piece) of one manifest part."""
    if len(payload) < _PART.size:
        raise HiddenStatesError("a manifest part shorter than its header")
    magic, index, parts, size = _PART.unpack_from(payload)
    if magic != _PART_MAGIC or index >= parts or size > len(payload) - _PART.size:
        raise HiddenStatesError("not a manifest part")
    return index, parts, bytes(payload[_PART.size : _PART.size + size])
