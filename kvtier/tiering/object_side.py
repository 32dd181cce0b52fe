"""The parts that exist only with an object store: the tier, its uploader, hit admission and,
with ``events.endpoint``, the announcements of what the store holds."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import zmq

from kvtier.core.config import Admission, KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.pools import PoolRegistry
from kvtier.fleet.event_log import EventLog
from kvtier.fleet.publisher import EventPublisher
from kvtier.fleet.shared_tier import SharedTierEvents
from kvtier.tiering.admission import HitAdmission
from kvtier.tiers.lmdb_tier import LmdbTier
from kvtier.tiers.objstore.tier import REMOTE_REPLICA, ObjectTier
from kvtier.tiers.objstore.uploader import Uploader


@dataclass(slots=True)
class ObjectSide:
    tier: ObjectTier
    uploader: Uploader
    admission: HitAdmission | None
    events: SharedTierEvents | None

    def close(self, flush_timeout: float) -> None:
        """Uploads first (each announces itself), then the announcements, then the store."""
        try:
            self.uploader.close(flush_timeout)
        finally:
            if self.events is not None:
                self.events.close()


def open_object_side(
    config: KVTierConfig, lmdb: LmdbTier | None, registry: PoolRegistry
) -> ObjectSide | None:
    if config.object.url is None:
        if config.events.endpoint is not None:
            raise ConfigError("events.endpoint", "announces the object tier: set object.url")
        return None
    if lmdb is None:
        raise ConfigError("object.url", "the object tier needs the lmdb tier enabled")
    tier = ObjectTier(config.object, registry)
    try:
        events = _open_events(config, registry, tier)
    except BaseException:
        tier.close()
        raise
    tier.events = events
    uploader = Uploader(tier, lmdb, config.object, tier.counters)
    if config.object.admission is Admission.ALL:
        # uploads queued or failed when the process last stopped
        uploader.resume(
            lambda limit: lmdb.newest_chunks(limit, REMOTE_REPLICA),
            lambda: [reg.namespace for reg in registry.registrations()],
        )
    admission = None
    if config.object.admission is Admission.HITS:
        admission = HitAdmission(uploader, config.object)
    return ObjectSide(tier, uploader, admission, events)


def _open_events(
    config: KVTierConfig, registry: PoolRegistry, tier: ObjectTier
) -> SharedTierEvents | None:
    events = config.events
    if events.endpoint is None:
        return None
    path = events.log_path or config.lmdb.path.parent / "events"
    event_log = EventLog(path, events.log_bytes, tier.counters)
    try:
        publisher = EventPublisher(
            events.endpoint, events.replay_endpoint, event_log, tier.counters
        )
    except BaseException as exc:
        with contextlib.suppress(Exception):
            event_log.close()
        if isinstance(exc, zmq.ZMQError):
            raise ConfigError("events.endpoint", f"cannot open the event sockets: {exc}") from exc
        raise
    return SharedTierEvents(events, publisher, registry, tier.counters)
