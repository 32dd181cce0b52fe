"""The store as the object tier reaches it: its backend and local index, the identity it runs
as (static keys are refused unless allowed, loudly), whether it is counted on (identity resolved,
breaker closed; a thread of its own resolves the identity and sends trials), and the names of
its objects. `tier.ObjectTier` writes and reads over it."""

from __future__ import annotations

import functools
import logging
import socket
import threading
import uuid
from abc import abstractmethod
from collections.abc import Sequence

from kvtier.core.config import ObjectStoreConfig
from kvtier.core.counters import Counters
from kvtier.core.errors import ConfigError, ObjectStoreError
from kvtier.core.keys import NAMESPACE_BYTES, ChunkKey, namespace_of
from kvtier.core.pools import PoolRegistry
from kvtier.tiers.base import Tier
from kvtier.tiers.objstore.backend import ObjectBackend, open_backend
from kvtier.tiers.objstore.budget import StoreBudget
from kvtier.tiers.objstore.index import ObjectIndex
from kvtier.tiers.objstore.pins import FleetPins
from kvtier.tiers.objstore.resilience import CircuitBreaker, RequestGuard

# the tier's logger, which operators filter on
log = logging.getLogger("kvtier.tiers.objstore.tier")

META_NODE = "kvtier-node"
"""The id of the node that uploaded the object."""
COMPANION_SUFFIX = ".lineage"
"""Beside an object: its chunks' lineage, for the announcement of its deletion; a name no listing
mistakes for a chunk's (`ObjectStore.key_of`)."""


UNKNOWN_PRINCIPAL = "unknown"
"""The principal until the identity has been resolved (in the background)."""
_IDENTITY_FIX = {
    "s3": "use IRSA (AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE), EKS Pod Identity or the "
    "instance role, and remove the keys",
    "gs": "use GKE Workload Identity (unset GOOGLE_APPLICATION_CREDENTIALS), or workload "
    "identity federation (an external_account file in GOOGLE_APPLICATION_CREDENTIALS)",
}


def _new_node_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:12]}"


class ObjectStore(Tier):
    """The backend, identity, health and naming under `tier.ObjectTier`."""

    def __init__(
        self,
        config: ObjectStoreConfig,
        registry: PoolRegistry,
        backend: ObjectBackend | None = None,
    ) -> None:
        super().__init__(registry)
        if config.url is None and backend is None:
            raise ValueError("the object tier needs object.url")
        self.config = config
        self.backend = backend or open_backend(str(config.url), config.request_timeout_s)
        self.index = ObjectIndex(config.index_path, int(config.index_map_bytes))
        self.counters = Counters()
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_reset_s)
        self.guard = RequestGuard(self.breaker, config.retries, config.backoff_s, self.counters)
        try:
            self._refuse_static_keys()
            self.node_id = self.index.node_id(_new_node_id)
        except BaseException:
            self.close_index_and_backend()
            raise
        self.pins = FleetPins(self.backend, self.guard, self.index, self.node_id)
        limit = int(config.budget_bytes) if config.budget_bytes is not None else None
        self.budget = StoreBudget(limit, self.index, self.pins, self.delete_objects, self.counters)
        self.principal = UNKNOWN_PRINCIPAL
        self.principal_resolved = threading.Event()
        """Set once the first attempt to resolve the identity has ended, either way."""
        self._identity_known = False
        self._closing = threading.Event()
        self._checker = threading.Thread(
            target=self._check_loop, name="kvtier-object-check", daemon=True
        )
        self._checker.start()

    def _refuse_static_keys(self) -> None:
        source = self.backend.static_credentials()
        if source is None:
            return
        scheme = self.backend.location.scheme
        if self.config.allow_static_keys:
            log.warning(
                "object store %s: STATIC CREDENTIALS IN USE: %s; long-lived keys leak and do "
                "not rotate: %s",
                self.backend.url,
                source,
                _IDENTITY_FIX.get(scheme, "use a workload identity"),
            )
            return
        raise ConfigError(
            "object.url",
            f"static credentials are refused: {source}; "
            f"{_IDENTITY_FIX.get(scheme, 'use a workload identity')}. "
            "To run with them anyway, set object.allow_static_keys: true",
        )

    def _check_loop(self) -> None:
        """Resolves the identity, then sends trials while the store is not sound; on its own
        thread, so a slow identity or store never holds up a caller."""
        self._resolve_principal()
        interval = max(0.05, min(1.0, self.config.breaker_reset_s / 4))
        while not self._closing.wait(interval):
            try:
                if self.check() and self.index.intents.orphans:
                    self.resolve_orphans()
                if self.pins.due():
                    self.publish_pins()
            except Exception:  # never let the checker die silently
                if self._closing.is_set():
                    return  # the backend was closed under a trial
                log.exception("object store check failed")

    def _resolve_principal(self) -> None:
        try:
            principal = self.backend.principal()
        except ObjectStoreError as exc:
            self.breaker.failure(exc, trip=True)
            log.error(
                "object store %s: no usable identity (%s); the tier answers misses until it "
                "recovers",
                self.backend.url,
                exc,
            )
            return
        finally:
            self.principal_resolved.set()
        self._known_as(principal)

    def _known_as(self, principal: str) -> None:
        self.principal = principal
        self._identity_known = True
        log.info("object store %s: running as %s", self.backend.url, principal)

    @property
    def healthy(self) -> bool:
        """Whether the store is counted on: the identity has been resolved, the breaker is
        closed and the last request that reached a verdict succeeded. A half-open breaker,
        trial in flight or not, is not healthy; only a request that succeeds makes it so."""
        return self._identity_known and self.breaker.sound

    def check(self) -> bool:
        """Send a trial request unless the store is sound (the tier's own thread calls this,
        so a store that recovered is noticed without traffic); True when the store is sound.
        Blocks for as long as the request takes."""
        if not self.healthy and self.breaker.admit_peek():
            try:
                if not self._identity_known:
                    self._known_as(self.guard.call(self.backend.principal))
                else:
                    self.guard.call(self.backend.ping)
            except ObjectStoreError:
                return False
        return self.healthy

    # -- naming ---------------------------------------------------------------------------

    def object_name(self, key: ChunkKey) -> str:
        reg = self.registry.resolve(key)
        digest = key[NAMESPACE_BYTES:].hex()
        return f"{reg.tenant}/{namespace_of(key).hex()}/{digest[:2]}/{digest}"

    @staticmethod
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

    def close_index_and_backend(self) -> None:
        self.index.close()
        self.backend.close()

    @abstractmethod
    def delete_objects(self, names: Sequence[str]) -> bool:
        """Delete objects from the store (the tier's); False when the store refused."""

    def _withdraw(self, name: str, with_lineage: bool) -> bool:
        """Delete an object of this node's never announced (so its removal is not either), and
        the lineage it wrote beside it; one that cannot be deleted now stays an orphan to
        resolve at the next start, logged."""
        doomed = [name, name + COMPANION_SUFFIX] if with_lineage else [name]
        try:
            self.guard.call(lambda: self.backend.delete(doomed))
        except ObjectStoreError as exc:
            log.error("%s, uploaded and not indexed, is left for the next start: %s", name, exc)
            return False
        self.index.intents.settle(name)
        return True

    def resolve_orphans(self) -> bool:
        """Find the uploads that may have been written and were never recorded (sent before
        the last stop, or failed without an answer): an object of this node's found is adopted
        (indexed and counted as its own, so a drain cut short loses nothing), one of another
        writer's or none at all is only forgotten. True once none is left."""
        for name in list(self.index.intents.orphans):
            entry = self.index.objects.get(name)
            if entry is not None and entry.owned:  # stopped between the index and the intent
                self.index.intents.settle(name)
                continue
            try:
                info = self.guard.call(functools.partial(self.backend.head, name))
            except ObjectStoreError as exc:
                log.warning("an upload before the last stop, %s, unresolved: %s", name, exc)
                return False
            if info is not None and info.metadata.get(META_NODE) == self.node_id:
                if not self.adopt(name):
                    return False
                self.counters.add("orphans_adopted", 1)
            self.index.intents.settle(name)
        return True

    def _claim_if_own(self, name: str) -> None:
        """The name was taken by this node itself (an upload whose answer was lost, a put
        that landed after it timed out): count the object as its own, or it would leak."""
        try:
            info = self.guard.call(functools.partial(self.backend.head, name))
        except ObjectStoreError:
            return  # left as learned; gc deletes it past the retention
        own = info is not None and info.metadata.get(META_NODE) == self.node_id
        if own and self.index.claim(name):
            self.index.intents.settle(name)
            self.counters.add("orphans_claimed", 1)

    @abstractmethod
    def adopt(self, name: str) -> bool:
        """Index an object of this node's found in the store as its own (the tier's: read and
        verified first); False when that cannot be done now."""

    @abstractmethod
    def publish_pins(self) -> bool:
        """Publish this node's pins for the fleet's gc (the tier's); the checker thread calls
        it when they changed."""
