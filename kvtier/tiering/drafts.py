"""Draft revisions: every revision of each draft pool, which one is current, and swaps.

A new revision (an admin swap, or an engine registering one) becomes current; the old revision's
chunks are evicted first and, after ``manager.draft_grace_s``, deleted from every tier. Target
chunks are never touched.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.core.counters import Counters
from kvtier.core.errors import InvalidRequestError, UnknownPoolError
from kvtier.core.keys import NamespaceSpec
from kvtier.core.pools import PoolRegistry
from kvtier.core.protocol import DraftRevision, DraftState
from kvtier.tiers.base import Tier
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.lmdb_tier import LmdbTier

_GC_EVERY_S = 1.0


@dataclass
class _Lineage:
    """Every revision of one draft pool (same model, layout, dtype, shard, tenant)."""

    model: str
    draft_model: str
    current: str
    namespaces: dict[str, bytes]
    retired_at: dict[str, float] = field(default_factory=dict)
    """Revision -> when it stopped being current (monotonic); deleted after the grace."""
    swap_id: str = ""
    swap_revision: str = ""
    epoch: int = 0


class DraftRevisions:
    """The draft lineages of one manager, keyed by `NamespaceSpec.draft_lineage`."""

    def __init__(
        self,
        registry: PoolRegistry,
        cpu: CpuTier,
        lmdb: LmdbTier | None,
        tiers: Sequence[Tier],
        counters: Counters,
        grace_s: float,
    ) -> None:
        self._registry = registry
        self._cpu = cpu
        self._lmdb = lmdb
        self._tiers = tiers
        self._counters = counters
        self._grace_s = grace_s
        self._lineages: dict[bytes, _Lineage] = {}
        self._lock = threading.Lock()
        self._next_gc = 0.0

    def registered(self, spec: NamespaceSpec, namespace: bytes) -> None:
        """The last revision registered is current: an engine that swapped its draft by
        itself registers the new one."""
        assert spec.draft_model is not None
        lineage = spec.draft_lineage()
        revision = spec.draft_revision or ""
        with self._lock:
            known = self._lineages.get(lineage)
            if known is None:
                self._lineages[lineage] = _Lineage(
                    spec.model, spec.draft_model, revision, {revision: namespace}
                )
                return
            known.namespaces.setdefault(revision, namespace)
            if revision != known.current:
                self._switch(known, revision)

    def _switch(self, lineage: _Lineage, revision: str) -> None:
        old = lineage.current
        lineage.retired_at[old] = time.monotonic()
        lineage.retired_at.pop(revision, None)
        lineage.current = revision
        lineage.epoch += 1
        self._counters.add("draft_swaps", 1)
        retiring: list[LmdbTier | CpuTier] = (
            [self._cpu] if self._lmdb is None else [self._cpu, self._lmdb]
        )
        for tier in retiring:
            if old in lineage.namespaces:
                tier.retire(lineage.namespaces[old])
            tier.reinstate(lineage.namespaces[revision])

    def begin_swap(self, revision: str, draft_model: str = "") -> tuple[str, str]:
        """Start switching the draft pools (of ``draft_model``, or all) to ``revision``; until
        `commit_swap`, engines neither load nor store draft chunks. Returns the swap id and
        the revision in use before."""
        if not revision:
            raise InvalidRequestError("a draft swap needs a revision")
        with self._lock:
            lineages = [
                lin
                for lin in self._lineages.values()
                if not draft_model or lin.draft_model == draft_model
            ]
            if not lineages:
                raise UnknownPoolError(
                    "no engine has registered a draft pool"
                    + (f" of {draft_model!r}" if draft_model else "")
                    + " with this daemon; start one with speculative decoding first"
                )
            swap_id = uuid.uuid4().hex
            for lin in lineages:  # a begin never committed is superseded, not stuck
                lin.swap_id, lin.swap_revision = swap_id, revision
                lin.epoch += 1
            previous = sorted({lin.current for lin in lineages})
        return swap_id, ",".join(previous)

    def commit_swap(self, swap_id: str) -> str:
        """Make the revision given at `begin_swap` current; returns it."""
        with self._lock:
            lineages = [
                lin for lin in self._lineages.values() if swap_id and lin.swap_id == swap_id
            ]
            if not lineages:
                raise InvalidRequestError(f"no draft swap {swap_id!r} is under way")
            revision = lineages[0].swap_revision
            for lin in lineages:
                now = lin.namespaces[lin.current]
                spec = self._registry.spec_of(now)
                reg = self._registry.get(now)
                assert spec is not None
                assert reg is not None
                new = self._registry.register(spec.with_draft_revision(revision), reg.chunk_bytes)
                self._cpu.accept(new)
                lin.namespaces.setdefault(revision, new.namespace)
                lin.swap_id = lin.swap_revision = ""
                if revision != lin.current:
                    self._switch(lin, revision)
                else:
                    lin.epoch += 1
        return revision

    def states(self) -> dict[bytes, DraftState]:
        """Each draft pool's state, by `NamespaceSpec.draft_lineage`."""
        with self._lock:
            return {
                key: DraftState(lin.current, bool(lin.swap_id), lin.epoch)
                for key, lin in self._lineages.items()
            }

    def revisions(self, counts: dict[str, Counter[bytes]]) -> list[DraftRevision]:
        """Every revision still known, with its chunks per tier out of ``counts`` (tier ->
        chunks per namespace)."""
        out = []
        with self._lock:
            for lin in self._lineages.values():
                for revision, ns in lin.namespaces.items():
                    chunks = {tier: held[ns] for tier, held in counts.items()}
                    out.append(
                        DraftRevision(
                            lin.model,
                            lin.draft_model,
                            revision,
                            ns,
                            revision == lin.current,
                            chunks,
                        )
                    )
        return out

    def gc(self, grace_s: float | None = None) -> int:
        """Delete, from every tier, the chunks of draft revisions retired longer than the
        grace ago; returns how many went."""
        grace = self._grace_s if grace_s is None else grace_s
        now = time.monotonic()
        due: list[bytes] = []
        with self._lock:
            for lin in self._lineages.values():
                for revision, since in list(lin.retired_at.items()):
                    if now - since >= grace:
                        del lin.retired_at[revision]
                        due.append(lin.namespaces.pop(revision))
        dropped = 0
        for namespace in due:
            for tier in self._tiers:
                dropped += tier.evict(namespace=namespace)
            self._cpu.reinstate(namespace)
            if self._lmdb is not None:
                self._lmdb.reinstate(namespace)
        self._counters.add("draft_gc_chunks", dropped)
        return dropped

    def gc_when_due(self) -> None:
        """`gc`, at most once a second: called from the write-back loop."""
        if time.monotonic() >= self._next_gc:
            self._next_gc = time.monotonic() + _GC_EVERY_S
            self.gc()
