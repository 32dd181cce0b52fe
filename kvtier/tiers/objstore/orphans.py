"""Uploads whose fate this node does not know: sent before the last stop, or failed without an
answer (`intents.UploadIntents`), and names it found taken that may be its own. An object of
this node's is adopted (read, verified, indexed and counted as its own), so nothing it wrote
leaks and a drain cut short loses nothing; one of another writer's is only forgotten."""

from __future__ import annotations

import functools
import logging

from kvtier.core.counters import Counters
from kvtier.core.errors import ObjectStoreError
from kvtier.tiers.objstore.backend import ObjectBackend
from kvtier.tiers.objstore.index import ObjectIndex
from kvtier.tiers.objstore.naming import COMPANION_SUFFIX, META_NODE
from kvtier.tiers.objstore.reads import ObjectReads
from kvtier.tiers.objstore.resilience import RequestGuard

# the tier's logger, which operators filter on
log = logging.getLogger("kvtier.tiers.objstore.tier")


class Orphans:
    """Resolves the index's orphaned intents, over the guarded backend, as node ``node_id``."""

    def __init__(
        self,
        backend: ObjectBackend,
        guard: RequestGuard,
        index: ObjectIndex,
        reads: ObjectReads,
        node_id: str,
        counters: Counters,
    ) -> None:
        self.backend = backend
        self.guard = guard
        self.index = index
        self.reads = reads
        self.node_id = node_id
        self.counters = counters

    def _is_own(self, name: str) -> bool:
        """Whether the store holds ``name``, uploaded by this node; raises `ObjectStoreError`."""
        info = self.guard.call(functools.partial(self.backend.head, name))
        return info is not None and info.metadata.get(META_NODE) == self.node_id

    def resolve(self) -> bool:
        """Find the uploads that may have been written and were never recorded: an object of
        this node's found is adopted, one of another writer's or none at all is only
        forgotten. True once none is left."""
        for name in list(self.index.intents.orphans):
            entry = self.index.objects.get(name)
            if entry is not None and entry.owned:  # stopped between the index and the intent
                self.index.intents.settle(name)
                continue
            try:
                own = self._is_own(name)
            except ObjectStoreError as exc:
                log.warning("an upload before the last stop, %s, unresolved: %s", name, exc)
                return False
            if own:
                if not self._adopt(name):
                    return False
                self.counters.add("orphans_adopted", 1)
            self.index.intents.settle(name)
        return True

    def _adopt(self, name: str) -> bool:
        """Index an object of this node's found in the store as its own, read and verified
        first; False when that cannot be done now."""
        try:
            # a corrupt one is deleted, a gone one forgotten
            found = self.reads.fetch(name, hits=False)
        except ObjectStoreError as exc:
            log.warning("reading %s, an upload before the last stop, failed: %s", name, exc)
            return False
        return found is None or self.index.claim(name)

    def claim_if_own(self, name: str) -> None:
        """The name was taken by this node itself (an upload whose answer was lost, a put
        that landed after it timed out): count the object as its own, or it would leak."""
        try:
            own = self._is_own(name)
        except ObjectStoreError:
            return  # left as learned; gc deletes it past the retention
        if own and self.index.claim(name):
            self.index.intents.settle(name)
            self.counters.add("orphans_claimed", 1)

    def withdraw(self, name: str, with_lineage: bool) -> bool:
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
