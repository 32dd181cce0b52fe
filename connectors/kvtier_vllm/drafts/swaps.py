"""Following the draft model through weight swaps.

vLLM gives connectors no hook for a draft-weight update, so the connector learns of one in two
ways, whichever comes first:

- kvtier says so (an admin ``draft-swap``: begin, then commit with the new revision);
- the workers see the draft weights' fingerprint change. They take it when the scheduler asks
  (the first step, after ``reset_cache()``, every ``draft_check_steps`` steps) and before any
  step that moves draft chunks, so no chunk of another revision is loaded as current or stored
  under the wrong one.

A swap changes only the draft pool's namespace (its revision). Until the new revision has a chunk,
the draft pages of a target hit are filled by policy: the previous revision's chunk, or zeros.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvtier.core.errors import KVTierError
from kvtier.core.keys import NamespaceSpec, make_key
from kvtier.core.protocol import DraftState, SlotRef, TierClient
from kvtier_vllm.shared.settings import FillPolicy

log = logging.getLogger(__name__)

_SAMPLES = 16  # elements read per weight tensor
UNKNOWN = "unknown"  # the fingerprint of weights the worker cannot see
_STACK_DEPTH = 12


class Fill(StrEnum):
    """How a request's draft pages were set; the ``fill`` label of acceptance."""

    NONE = "none"
    PREVIOUS = "previous"
    ZEROS = "zeros"


def fingerprint(model: Any) -> str:
    """A cheap digest of a model's weights: a fixed sample of every tensor, and its shape.

    A swap rewrites the weights, so the sample moves; reading a few elements per tensor keeps
    this to one small gather per tensor, whatever the model's size. Tensors a backend moved out
    of the parameters (the CPU build packs linear weights) are not seen.
    """
    import torch

    digest = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        samples = []
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            flat = param.detach().reshape(-1)
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
            if flat.numel() == 0:
                continue
            index = torch.linspace(0, flat.numel() - 1, _SAMPLES, device=flat.device).long()
            samples.append(flat[index].float())
        if samples:
            digest.update(torch.cat(samples).cpu().numpy().tobytes())
    return digest.hexdigest()


def find_draft_model_source() -> Callable[[], Any] | None:
    """What returns the worker's draft model now, found from the model runner that is
    registering the KV caches (it calls the connector); None outside one."""
    frame = inspect.currentframe()
    try:
        for _ in range(_STACK_DEPTH):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            if owner is not None and callable(getattr(owner, "get_draft_model", None)):
                return _draft_model_of(weakref.ref(owner))
            frame = frame.f_back
        return None
    finally:
        del frame


def _draft_model_of(runner: weakref.ref[Any]) -> Callable[[], Any]:
    def draft_model() -> Any:
        found = runner()
        return None if found is None else found.get_draft_model()

    return draft_model


def combined(fingerprints: dict[int, str]) -> str:
    """One fingerprint for every worker's shard."""
    return hashlib.blake2b(
        ";".join(f"{rank}={fp}" for rank, fp in sorted(fingerprints.items())).encode(),
        digest_size=16,
    ).hexdigest()


@dataclass
class DraftTracker:
    """The scheduler side's view of the draft pool: its revision and namespace, the previous
    one (a fill source), and whether draft chunks may move now."""

    spec: NamespaceSpec
    register: Callable[[NamespaceSpec], bytes]
    """Registers a revision of the draft pool with kvtier; returns its namespace."""
    policy: FillPolicy = FillPolicy.PREVIOUS
    check_steps: int = 16
    namespace: bytes | None = None
    previous: bytes | None = None
    revision: str = ""
    bound: dict[int, str] = field(default_factory=dict)
    """The workers' fingerprints of ``revision``'s weights; empty until the first report."""
    swapping: bool = False
    """kvtier's admin swap has begun and not been committed."""
    awaiting: bool = False
    """reset_cache() was called: draft chunks wait for a fresh fingerprint."""
    local_cache_stale: bool = False
    """vLLM's own prefix cache may hold draft KV of an older revision (no reset since a swap)."""
    swaps: list[str] = field(default_factory=list)
    """Sources of swaps not yet reported in stats."""
    _revision_of: dict[str, str] = field(default_factory=dict)
    _epoch: int | None = None
    _steps: int = 0
    _check_next: bool = True

    def __post_init__(self) -> None:
        self.revision = self.spec.draft_revision or ""
        self.lineage = self.spec.draft_lineage()

    @property
    def active(self) -> bool:
        """Draft chunks of the current revision may be loaded and stored."""
        return self.namespace is not None and not self.swapping and not self.awaiting

    def fill_sources(self) -> list[bytes]:
        """Where a `previous` fill reads from, best first: the last revision; while the weights
        may be in flux, the revision in use so far, then the one before it (a swap back)."""
        if self.policy is not FillPolicy.PREVIOUS:
            return []
        found = [self.previous] if self.active else [self.namespace, self.previous]
        return [ns for ns in found if ns is not None]

    def follow(self, states: dict[bytes, DraftState]) -> None:
        """kvtier's view of the pool (an admin swap), read every step."""
        state = states.get(self.lineage)
        if state is None:
            return
        self.swapping = state.swapping
        seen, self._epoch = self._epoch, state.epoch
        if state.swapping or seen is None or seen == state.epoch:
            return
        if state.revision != self.revision:
            self._switch(state.revision, "admin")
            self.bound = {}  # the next fingerprint is the new revision's
            self.awaiting = False  # the commit says which weights run now
            self._check_next = True

    def reset(self) -> None:
        """reset_cache(): vLLM dropped its prefix cache, maybe for a draft update."""
        self.awaiting = True
        self.local_cache_stale = False
        self._check_next = True

    def check_due(self) -> bool:
        """Whether this step asks the workers for a fingerprint."""
        self._steps += 1
        due = self._check_next or (self.check_steps > 0 and self._steps >= self.check_steps)
        if due:
            self._steps = 0
            self._check_next = False
        return due

    def reported(self, fingerprints: dict[int, str]) -> None:
        """The workers' fingerprints of the draft weights they run with."""
        if not fingerprints:
            return
        self.awaiting = False
        if not self.bound:
            self.bound = dict(fingerprints)
            self._revision_of[combined(fingerprints)] = self.revision
            return
        if fingerprints == self.bound or self.swapping:
            return  # during an admin swap the commit names the revision
        key = combined(fingerprints)
        revision = self._revision_of.get(key) or f"{self.spec.draft_revision}+fp-{key[:12]}"
        log.warning(
            "kvtier: the draft weights changed (revision %s -> %s); target chunks stay valid",
            self.revision,
            revision,
        )
        self._switch(revision, "fingerprint")
        self.bound = dict(fingerprints)
        self._revision_of[key] = revision

    def current_spec(self) -> NamespaceSpec:
        """The draft pool at the revision in use (what a reconnect registers)."""
        return self.spec.with_draft_revision(self.revision)

    def _switch(self, revision: str, source: str) -> None:
        try:
            namespace: bytes | None = self.register(self.spec.with_draft_revision(revision))
        except KVTierError as exc:  # draft pages are filled until the pool is registered
            log.error("kvtier: cannot register draft revision %s: %s", revision, exc)
            namespace = None
        if namespace != self.namespace:
            self.previous = self.namespace
        self.namespace = namespace
        self.revision = revision
        self.local_cache_stale = True
        self.swaps.append(source)


class DraftWatch:
    """The worker side: fingerprints the draft weights when asked and before moving draft
    chunks, and says whether they are still the weights the scheduler planned for."""

    def __init__(self, source: Callable[[], Any] | None, rank: int, on_transfers: bool) -> None:
        self.source = source
        self.rank = rank
        self.on_transfers = on_transfers
        self.unverified = 0
        """Draft chunks loaded as current since the last fingerprint."""

    def check(self, asked: bool, moves: bool, expected: dict[int, str]) -> tuple[bool, str]:
        """(the planned draft chunks may move, the fingerprint taken or "")."""
        if not (asked or (moves and self.on_transfers)):
            return True, ""
        model = self.source() if self.source is not None else None
        if model is None:  # still an answer: the scheduler waits for one after reset_cache()
            return True, UNKNOWN if asked else ""
        taken = fingerprint(model)
        bound = expected.get(self.rank, "")
        return not bound or bound == taken, taken

    def stale_after(self, ok: bool) -> int:
        """Chunks that may have been loaded as current under other weights: those loaded
        since the last fingerprint, when this one differs."""
        stale = 0 if ok else self.unverified
        self.unverified = 0
        return stale


@dataclass
class AcceptanceMeter:
    """Speculative tokens proposed and accepted per request and step, from the scheduler's
    own bookkeeping: a step that verifies d draft tokens and accepts a of them advances the
    request's computed tokens by a + 1 (vLLM rolls the rejected ones back)."""

    _pending: dict[str, tuple[int, int, str, str]] = field(default_factory=dict)

    def scheduled(self, req_id: str, computed: int, drafted: int, revision: str, fill: str) -> None:
        if drafted > 0:
            self._pending[req_id] = (computed, drafted, revision, fill)

    def progressed(self, req_id: str, computed: int) -> tuple[str, str, int, int] | None:
        """(revision, fill, drafted, accepted) of the request's last step with drafts."""
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return None
        before, drafted, revision, fill = pending
        accepted = min(drafted, max(0, computed - before - 1))
        return revision, fill, drafted, accepted

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)


def lease_draft(
    client: TierClient, tracker: DraftTracker, hashes: Sequence[bytes]
) -> tuple[list[SlotRef | None] | None, Fill, list[SlotRef]]:
    """Leases on the draft chunks of a target hit (one engine block hash per chunk): the current
    revision's when it has them all, else the fill source's, else none (zeros). Also returns
    partial leases, to give back."""
    back: list[SlotRef] = []
    sources: list[tuple[bytes, Fill]] = []
    if tracker.active and tracker.namespace is not None:
        sources.append((tracker.namespace, Fill.NONE))
    sources.extend((ns, Fill.PREVIOUS) for ns in tracker.fill_sources())
    for namespace, fill in sources:
        refs = client.lease([make_key(namespace, h) for h in hashes])
        held = [r for r in refs if r is not None]
        if len(held) == len(refs):
            return refs, fill, back
        back.extend(held)
    return None, Fill.ZEROS, back
