"""Object-store admission by hits (``object.admission: hits``): a chunk is offered for upload
once engines loaded it ``object.admission_min_hits`` times."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from kvtier.core.config import ObjectStoreConfig
from kvtier.core.keys import ChunkKey
from kvtier.tiers.objstore.uploader import Uploader

_MAX_TRACKED = 1 << 17  # bound on per-key hit counts


class HitAdmission:
    def __init__(self, uploader: Uploader, config: ObjectStoreConfig) -> None:
        self._uploader = uploader
        self._threshold = config.admission_min_hits
        self._counts: Counter[ChunkKey] = Counter()
        self._lock = threading.Lock()

    def loaded(self, keys: Sequence[ChunkKey], replica: str) -> None:
        """Engines loaded these chunks: offer the ones loaded often enough now."""
        hot = []
        with self._lock:
            if len(self._counts) > _MAX_TRACKED:
                self._counts.clear()
            for key in keys:
                self._counts[key] += 1
                if self._counts[key] == self._threshold:
                    hot.append(key)
        if hot:
            self._uploader.offer(hot, replica)
