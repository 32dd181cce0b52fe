"""The names of the object tier's objects: ``tenant/namespace/hash[:2]/hash`` after the first
chunk an object holds, the lineage companion beside one, and the id a node writes as."""

from __future__ import annotations

import socket
import uuid

from kvtier.core.keys import NAMESPACE_BYTES, ChunkKey, namespace_of
from kvtier.core.pools import PoolRegistry

META_NODE = "kvtier-node"
"""The id of the node that uploaded the object."""
COMPANION_SUFFIX = ".lineage"
"""Beside an object: its chunks' lineage, for the announcement of its deletion; a name no listing
mistakes for a chunk's (`key_of`)."""


def new_node_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:12]}"


def object_name(registry: PoolRegistry, key: ChunkKey) -> str:
    """The name of the object whose first chunk is ``key`` (its namespace must be registered)."""
    reg = registry.resolve(key)
    digest = key[NAMESPACE_BYTES:].hex()
    return f"{reg.tenant}/{namespace_of(key).hex()}/{digest[:2]}/{digest}"


def key_of(name: str) -> ChunkKey | None:
    """The first chunk's key from an object name; None for names kvtier did not write."""
    parts = name.split("/")
    if len(parts) < 4:
        return None
    try:
        namespace, digest = bytes.fromhex(parts[-3]), bytes.fromhex(parts[-1])
    except ValueError:
        return None
    if len(namespace) != NAMESPACE_BYTES or not digest:
        return None
    return ChunkKey(namespace + digest)
