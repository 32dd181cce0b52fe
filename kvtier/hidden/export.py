"""Captured hidden states as safetensors files, for training jobs.

Its input is a hidden pool's namespace: the references of its requests are listed from the
manifests the connector stores beside the states (`kvtier.hidden.reader.manifest_spec`); or the
references requests handed back (``kv_transfer_params["kvtier_hidden_states"]``), one JSON
document per line, as a serving stack collects them. It reads them through tiers of its own,
opened from a kvtier config: on a node that has only the object store, the manifests are
downloaded first, and every chunk comes from there, verified. Each request becomes one file,
``<digest>.safetensors`` with ``hidden_states`` [tokens, layers, hidden] in the captured dtype
and ``token_ids``; a file is written under a temporary name and renamed, so a run cut short is
resumed by running it again (files present are kept).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey, namespace_of
from kvtier.hidden.reader import (
    MANIFEST_PART_BYTES,
    HiddenStates,
    HiddenStatesError,
    HiddenStatesReader,
    HiddenStatesRef,
    manifest_spec,
)

if TYPE_CHECKING:  # opened by the command only: the module loads no tier
    from kvtier.tiering.manager import TierManager

_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Write ``{name: (safetensors dtype, array)}`` in the safetensors format (a JSON header
    of each tensor's dtype, shape and byte range, then the bytes), atomically."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, array) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for _, array in tensors.values():
            out.write(np.ascontiguousarray(array).tobytes())
        out.flush()
        os.fsync(out.fileno())
    partial.replace(path)


def file_name(ref: HiddenStatesRef) -> str:
    """One name per reference: its chunks and token count (equal requests share a file)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(ref.namespace + ref.tokens.to_bytes(8, "little") + b"".join(ref.chunks))
    return f"{digest.hexdigest()}.safetensors"


def write_states(path: Path, states: HiddenStates, token_ids: tuple[int, ...]) -> None:
    write_safetensors(
        path,
        {
            "hidden_states": (_SAFETENSORS_DTYPES[states.dtype], states.states),
            "token_ids": ("I64", np.asarray(token_ids, dtype="<i8")),
        },
    )


@dataclass
class ExportCounts:
    written: int = 0
    kept: int = 0
    """Files a run before this one wrote."""
    failed: int = 0
    bytes: int = 0


def read_refs(path: Path, namespace: bytes | None) -> list[HiddenStatesRef]:
    """The references in a JSON-lines file (``namespace``: only that pool's); raises
    `HiddenStatesError` naming the line of one that is malformed."""
    refs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ref = HiddenStatesRef.from_json(json.loads(line))
        except (HiddenStatesError, ValueError) as exc:
            raise HiddenStatesError(f"{path}:{number}: {exc}") from None
        if namespace is None or ref.namespace == namespace:
            refs.append(ref)
    return refs


def from_lmdb(manager: TierManager) -> Callable[[ChunkKey, int], bytes | None]:
    """A reader of chunks straight from ``manager``'s lmdb, verified (None: absent, or corrupt
    and then quarantined), for `HiddenStatesReader.below`."""

    def read(key: ChunkKey, nbytes: int) -> bytes | None:
        if manager.lmdb is None:
            return None
        payload = bytearray(nbytes)
        return bytes(payload) if manager.lmdb.read_into(key, memoryview(payload)) else None

    return read


def listed_refs(
    manager: TierManager, reader: HiddenStatesReader, namespace: bytes, tenant: str
) -> tuple[list[HiddenStatesRef], int]:
    """The references whose manifests the tiers hold for hidden pool ``namespace`` (those of the
    object store downloaded into lmdb first), and how many manifests could not be read."""
    return refs_of_manifests(reader, namespace, manifest_keys(manager, namespace, tenant), tenant)


def manifest_keys(manager: TierManager, namespace: bytes, tenant: str) -> list[ChunkKey]:
    """The keys of hidden pool ``namespace``'s manifest parts in ``manager``'s lmdb, those of
    the object store downloaded there first."""
    spec = manifest_spec(namespace, tenant)
    manifests = spec.digest()
    manager.register_pool(spec, MANIFEST_PART_BYTES)
    if manager.object is not None:  # list the store, download the pool's manifests into lmdb
        deque(manager.warmup(manifests, object_index=True, fetch=True), maxlen=0)
    stored = manager.lmdb.keys() if manager.lmdb is not None else iter(())
    return [k for k in stored if namespace_of(k) == manifests]


def refs_of_manifests(
    reader: HiddenStatesReader, namespace: bytes, keys: list[ChunkKey], tenant: str
) -> tuple[list[HiddenStatesRef], int]:
    """The references whose manifests are among ``keys`` (a listing of hidden pool
    ``namespace``'s manifest chunks), and how many manifests could not be read."""
    refs, failed = [], 0
    for name in reader.manifest_names(namespace, keys, tenant):
        try:
            refs.append(reader.manifest(namespace, name, tenant))
        except KVTierError:
            failed += 1
    return refs, failed


def export(
    reader: HiddenStatesReader, refs: list[HiddenStatesRef], to: Path
) -> Iterator[ExportCounts]:
    """Write each reference's file into ``to``; the counts after each one."""
    to.mkdir(parents=True, exist_ok=True)
    counts = ExportCounts()
    for ref in refs:
        path = to / file_name(ref)
        if path.exists():
            counts.kept += 1
        elif ref.token_ids is None:
            counts.failed += 1  # nothing says which tokens these states are of
        else:
            try:
                states = reader.load(ref)
            except KVTierError:
                counts.failed += 1
            else:
                write_states(path, states, ref.token_ids)
                counts.written += 1
                counts.bytes += states.states.nbytes
        yield counts
