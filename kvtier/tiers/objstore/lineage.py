"""An object's lineage beside it (its companion, `naming.COMPANION_SUFFIX`), for routers to
hear of what the store holds: written once this node's upload won the name, deleted and
announced with the object. A node that writes no lineage deletes none it did not write."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Protocol

from kvtier.core.counters import Counters
from kvtier.core.errors import ObjectNotFoundError, ObjectStoreError
from kvtier.core.keys import ChunkKey
from kvtier.tiers.objstore.backend import ObjectBackend
from kvtier.tiers.objstore.naming import COMPANION_SUFFIX
from kvtier.tiers.objstore.resilience import RequestGuard

# the tier's logger, which operators filter on
log = logging.getLogger("kvtier.tiers.objstore.tier")


class Announcer(Protocol):
    """Tells routers what the store holds (`kvtier.fleet.shared_tier.SharedTierEvents`)."""

    def companion(self, keys: Sequence[ChunkKey]) -> bytes | None: ...
    def stored(self, companion: bytes) -> None: ...
    def removed(self, companion: bytes) -> None: ...


class Lineage:
    """Companions written and deleted over the tier's guarded backend; `events` is set when
    routers listen (`kvtier.tiering.object_side`)."""

    def __init__(self, backend: ObjectBackend, guard: RequestGuard, counters: Counters) -> None:
        self.backend = backend
        self.guard = guard
        self.counters = counters
        self.events: Announcer | None = None

    def write(self, name: str, keys: Sequence[ChunkKey]) -> bytes | None:
        """Write the lineage of an object this node just wrote beside it; None when there is
        none (no events, or the write failed: the object then goes unannounced)."""
        companion = self.events.companion(keys) if self.events is not None else None
        if companion is None:
            return None
        try:
            self.guard.call(lambda: self.backend.put(name + COMPANION_SUFFIX, companion, {}))
        except ObjectStoreError as exc:
            log.warning("lineage of %s not written, the object goes unannounced: %s", name, exc)
            self.counters.add("lineage_unwritten", 1)
            return None
        return companion

    def delete_objects(self, names: Sequence[str]) -> bool:
        """Delete objects with their companions, and announce what left; False when the store
        refused (nothing is announced then)."""
        if not names:
            return True
        events = self.events
        # only companions found: a node that writes none deletes none it did not write
        companions = self._companions(names) if events is not None else {}
        doomed = [*names, *companions]
        try:
            self.guard.call(lambda: self.backend.delete(doomed))
        except ObjectStoreError as exc:
            log.warning("deleting %d objects failed: %s", len(names), exc)
            return False
        if events is not None:
            for companion in companions.values():
                events.removed(companion)
        return True

    def _companions(self, names: Sequence[str]) -> dict[str, bytes]:
        """The lineage companions beside ``names``, by the companion's name."""
        found = {}
        for name in names:
            companion = functools.partial(self.backend.get, name + COMPANION_SUFFIX)
            try:
                found[name + COMPANION_SUFFIX] = self.guard.call(companion)
            except ObjectNotFoundError:
                continue  # uploaded unannounced: nothing to withdraw
            except ObjectStoreError as exc:
                log.warning("lineage of %s unreadable, its removal not announced: %s", name, exc)
                self.counters.add("lineage_unreadable", 1)
        return found
