"""Registered namespaces: which pool a key belongs to, and what its chunks look like."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtier.core.blockfmt import ChunkDescriptor
from kvtier.core.errors import CapacityError, PoolLayoutError, UnknownPoolError
from kvtier.core.keys import NamespaceSpec, namespace_of
from kvtier.core.kvcodec import Codec, error_bound

_DORMANT = 4096
"""Expired namespaces remembered, so one used again comes back without a new registration."""


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

    A namespace no call used for ``idle_s`` and that nothing holds (`keep_while`: a live
    session's) expires: it no longer counts against the bound, and is kept dormant, so a call
    that uses it again brings it back through the same checks. `resolve` finds a dormant
    namespace too (the movers still write its chunks) without bringing it back.
    """

    def __init__(self, max_namespaces: int | None = None, idle_s: float = math.inf) -> None:
        self._by_namespace: dict[bytes, Registration] = {}
        self._specs: dict[bytes, NamespaceSpec] = {}
        self._used: dict[bytes, float] = {}
        self._dormant: OrderedDict[bytes, tuple[Registration, NamespaceSpec]] = OrderedDict()
        self._checks: list[Callable[[Registration], None]] = []
        self._held: Callable[[], set[bytes]] = set
        self._sessions_hold = False
        self._max_namespaces = max_namespaces
        self._idle_s = idle_s
        self._lock = threading.RLock()
        self.live_classes: frozenset[tuple[str, int]] = frozenset()
        """(pool, chunk bytes) of the live registrations; replaced whole, read without a lock."""

    def admit_with(self, check: Callable[[Registration], None]) -> None:
        """Run ``check`` on every new registration before it is recorded; it raises to refuse."""
        self._checks.append(check)

    def limit_namespaces(self, limit: int | None) -> None:
        """Refuse new namespaces past ``limit`` (`server.max_namespaces`)."""
        self._max_namespaces = limit

    def keep_while(self, held: Callable[[], set[bytes]]) -> None:
        """Never expire the namespaces ``held()`` names (those of live sessions)."""
        self._held = held
        self._sessions_hold = True

    def held_classes(self) -> frozenset[tuple[str, int]] | None:
        """(pool, chunk bytes) of the namespaces an open session holds; None where no
        sessions are kept (an embedded manager), so nothing can be known unheld."""
        if not self._sessions_hold:
            return None
        held = self._held()
        with self._lock:
            regs = [self.get(ns) for ns in held]
        return frozenset((r.pool, r.chunk_bytes) for r in regs if r is not None)

    def register(self, spec: NamespaceSpec, chunk_bytes: int) -> Registration:
        if chunk_bytes <= 0:
            raise PoolLayoutError(f"chunk_bytes must be positive, got {chunk_bytes}")
        namespace = spec.digest()
        reg = Registration(
            namespace, str(spec.pool), chunk_bytes, ChunkDescriptor.from_spec(spec), spec.tenant
        )
        self.expire_idle()  # registrations are rare: the bound then counts namespaces in use
        with self._lock:
            known = self._by_namespace.get(namespace)
            if known is None and namespace in self._dormant:
                known = self._dormant[namespace][0]
            if known is not None:
                if known != reg:
                    raise PoolLayoutError(
                        f"namespace {namespace.hex()} already registered with "
                        f"{known.chunk_bytes} bytes per chunk, not {chunk_bytes}"
                    )
                if namespace in self._dormant:
                    self._admit(namespace, *self._dormant[namespace])
                self._used[namespace] = time.monotonic()
                return known
            self._admit(namespace, reg, spec)
        return reg

    def _admit(self, namespace: bytes, reg: Registration, spec: NamespaceSpec) -> None:
        limit = self._max_namespaces
        if limit is not None and len(self._by_namespace) >= limit:
            self.expire_idle()
        if limit is not None and len(self._by_namespace) >= limit:
            raise CapacityError(
                f"{len(self._by_namespace)} namespaces are in use, the most "
                f"server.max_namespaces allows ({limit}); raise it to register more, or wait "
                "for idle ones to expire (server.namespace_idle_s)"
            )
        for check in self._checks:
            check(reg)
        self._dormant.pop(namespace, None)
        self._by_namespace[namespace] = reg
        self._specs[namespace] = spec
        self._used[namespace] = time.monotonic()
        self._publish()

    def _publish(self) -> None:
        self.live_classes = frozenset((r.pool, r.chunk_bytes) for r in self._by_namespace.values())

    def expire_idle(self) -> int:
        """Make namespaces idle past ``idle_s`` and held by nothing dormant; returns how many."""
        held = self._held()
        now = time.monotonic()
        with self._lock:
            idle = [
                ns
                for ns, used in list(self._used.items())  # `resolve` stamps without the lock
                if now - used >= self._idle_s and ns not in held
            ]
            for namespace in idle:
                del self._used[namespace]
                if namespace not in self._by_namespace:
                    continue  # stamped by a call that raced its expiry
                spec = self._specs.pop(namespace)
                self._dormant[namespace] = (self._by_namespace.pop(namespace), spec)
                while len(self._dormant) > _DORMANT:
                    self._dormant.popitem(last=False)
            if idle:
                self._publish()
        return len(idle)

    def live_count(self) -> int:
        return len(self._by_namespace)

    def spec_of(self, namespace: bytes) -> NamespaceSpec | None:
        """The spec a namespace was registered with, dormant or not (a draft swap derives the
        next one)."""
        spec = self._specs.get(namespace)
        if spec is None and (dormant := self._dormant.get(namespace)) is not None:
            return dormant[1]
        return spec

    def resolve(self, key: bytes, use: bool = False) -> Registration:
        """The registration of ``key``'s namespace; ``use`` (a store or a lookup) marks it used
        and brings a dormant one back."""
        namespace = namespace_of(key)
        reg = self._by_namespace.get(namespace)
        if reg is not None:
            if use:
                self._used[namespace] = time.monotonic()
            return reg
        with self._lock:
            reg = self._by_namespace.get(namespace)
            if reg is not None:  # brought back meanwhile
                return reg
            dormant = self._dormant.get(namespace)
            if dormant is None:
                raise UnknownPoolError(
                    f"key namespace {namespace.hex()} is not registered; "
                    "register the pool before storing or loading"
                )
            if use and namespace not in self._by_namespace:
                self._admit(namespace, *dormant)
            return dormant[0]

    def get(self, namespace: bytes) -> Registration | None:
        """The registration of a namespace, dormant or not."""
        reg = self._by_namespace.get(namespace)
        if reg is None and (dormant := self._dormant.get(namespace)) is not None:
            return dormant[0]
        return reg

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
