"""Registered namespaces: which pool a key belongs to, and what its chunks look like."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtier.core.blockfmt import ChunkDescriptor
from kvtier.core.errors import CapacityError, PoolLayoutError, UnknownPoolError
from kvtier.core.keys import NamespaceSpec, namespace_of
from kvtier.core.kvcodec import Codec, error_bound


@dataclass(frozen=True, slots=True)
class Registration:
    namespace: bytes
    pool: str
    chunk_bytes: int
    descriptor: ChunkDescriptor
    tenant: str = "default"


class PoolRegistry:
    """Maps a namespace (the first 16 bytes of every key) to its pool and chunk size.

    Thread-safe; shared by every tier of one TierManager. A registration is all or nothing:
    every check (each tier's, added by `admit_with`, and the namespace bound) passes before
    anything is recorded.
    """

    def __init__(self, max_namespaces: int | None = None) -> None:
        self._by_namespace: dict[bytes, Registration] = {}
        self._specs: dict[bytes, NamespaceSpec] = {}
        self._checks: list[Callable[[Registration], None]] = []
        self._max_namespaces = max_namespaces
        self._lock = threading.Lock()

    def admit_with(self, check: Callable[[Registration], None]) -> None:
        """Run ``check`` on every new registration before it is recorded; it raises to refuse."""
        self._checks.append(check)

    def limit_namespaces(self, limit: int | None) -> None:
        """Refuse new namespaces past ``limit`` (`server.max_namespaces`)."""
        self._max_namespaces = limit

    def register(self, spec: NamespaceSpec, chunk_bytes: int) -> Registration:
        if chunk_bytes <= 0:
            raise PoolLayoutError(f"chunk_bytes must be positive, got {chunk_bytes}")
        namespace = spec.digest()
        reg = Registration(
            namespace, str(spec.pool), chunk_bytes, ChunkDescriptor.from_spec(spec), spec.tenant
        )
        with self._lock:
            known = self._by_namespace.get(namespace)
            if known is not None:
                if known != reg:
                    raise PoolLayoutError(
                        f"namespace {namespace.hex()} already registered with "
                        f"{known.chunk_bytes} bytes per chunk, not {chunk_bytes}"
                    )
                return known
            limit = self._max_namespaces
            if limit is not None and len(self._by_namespace) >= limit:
                raise CapacityError(
                    f"{len(self._by_namespace)} namespaces are registered, the most "
                    f"server.max_namespaces allows ({limit}); raise it to register more"
                )
            for check in self._checks:
                check(reg)
            self._by_namespace[namespace] = reg
            self._specs[namespace] = spec
        return reg

    def spec_of(self, namespace: bytes) -> NamespaceSpec | None:
        """The spec a namespace was registered with (a draft swap derives the next one)."""
        return self._specs.get(namespace)

    def resolve(self, key: bytes) -> Registration:
        reg = self._by_namespace.get(namespace_of(key))
        if reg is None:
            raise UnknownPoolError(
                f"key namespace {namespace_of(key).hex()} is not registered; "
                "register the pool before storing or loading"
            )
        return reg

    def get(self, namespace: bytes) -> Registration | None:
        return self._by_namespace.get(namespace)

    def coded(self, codecs: Iterable[Codec]) -> dict[bytes, float]:
        """The registered namespaces that tiers with ``codecs`` store coded, each with the
        largest error its codecs can make (`kvtier.core.kvcodec.error_bound`)."""
        out: dict[bytes, float] = {}
        for reg in self.registrations():
            for codec in set(codecs):
                stored = reg.descriptor.codec_for(reg.chunk_bytes, codec)
                if stored is not Codec.NONE:
                    bound = error_bound(codec, reg.descriptor.head_size)
                    out[reg.namespace] = max(bound, out.get(reg.namespace, 0.0))
        return out

    def registrations(self) -> list[Registration]:
        with self._lock:
            return list(self._by_namespace.values())
