"""What each replica holds in the arena's pools, and its quota there: a pool's capacity is its
share of the arena's extents, a replica's quota a share of that capacity unless an operator set
one (`quota_bytes`)."""

from __future__ import annotations

from collections import Counter

from kvtier.core.config import ArenaConfig
from kvtier.core.protocol import UsageStats


class ReplicaUsage:
    """Bytes and chunks per replica and pool, committed and reserved, as `cpu_slots.ArenaSlots`
    moves its slots (under its lock). Replicas are numbered in the order they first store."""

    def __init__(self, config: ArenaConfig, num_extents: int, extent_bytes: int) -> None:
        self._config = config
        self._num_extents = num_extents
        self._extent_bytes = extent_bytes
        self._numbers: dict[str, int] = {}
        self._names: list[str] = []
        self._used: Counter[tuple[int, str]] = Counter()  # (replica, pool) -> bytes
        self._inflight: Counter[tuple[int, str]] = Counter()  # reserved, not committed
        self._chunks: Counter[tuple[int, str]] = Counter()  # (replica, pool) -> chunks
        self._quota_override: dict[tuple[str, str], int] = {}

    def number(self, name: str) -> int:
        """The replica's number, given on its first use."""
        q = self._numbers.get(name)
        if q is None:
            q = self._numbers[name] = len(self._names)
            self._names.append(name)
        return q

    def find(self, name: str) -> int | None:
        """The replica's number; None when it never stored."""
        return self._numbers.get(name)

    def name_of(self, q: int) -> str:
        return self._names[q]

    def pool_capacity_bytes(self, pool: str) -> int:
        share = self._config.pools[pool].max_share
        return max(1, int(self._num_extents * share)) * self._extent_bytes

    def quota_bytes(self, replica: str, pool: str) -> int:
        override = self._quota_override.get((replica, pool))
        if override is not None:
            return override
        return int(self.pool_capacity_bytes(pool) * self._config.pools[pool].replica_share)

    def set_quota(self, replica: str, pool: str, nbytes: int | None) -> None:
        if nbytes is None:
            self._quota_override.pop((replica, pool), None)
        else:
            self._quota_override[(replica, pool)] = nbytes

    def reserved(self, q: int, pool: str, nbytes: int) -> None:
        self._inflight[(q, pool)] += nbytes

    def unreserved(self, q: int, pool: str, nbytes: int) -> None:
        """A reservation given back uncommitted."""
        self._inflight[(q, pool)] -= nbytes

    def committed(self, q: int, pool: str, nbytes: int) -> None:
        self._inflight[(q, pool)] -= nbytes
        self._used[(q, pool)] += nbytes
        self._chunks[(q, pool)] += 1

    def freed(self, q: int, pool: str, nbytes: int) -> None:
        """A committed chunk left the arena."""
        self._used[(q, pool)] -= nbytes
        self._chunks[(q, pool)] -= 1

    def over_quota(self, q: int, pool: str, nbytes: int) -> bool:
        """Whether ``nbytes`` more would take the replica past its quota, reservations counted."""
        held = self._used[(q, pool)] + self._inflight[(q, pool)]
        return held + nbytes > self.quota_bytes(self._names[q], pool)

    def over_quota_replicas(self, pool: str) -> list[int]:
        """Replicas whose committed chunks exceed their quota, the furthest over first."""
        over = []
        for name, q in self._numbers.items():
            excess = self._used[(q, pool)] - self.quota_bytes(name, pool)
            if excess > 0:
                over.append((excess, q))
        return [q for _excess, q in sorted(over, reverse=True)]

    def stats(self) -> dict[tuple[str, str], UsageStats]:
        """Per (replica, pool); a replica that has emptied stays, at zero, so its quota stays in
        view."""
        return {
            (self._names[q], pool): UsageStats(
                used_bytes=used,
                chunks=self._chunks[(q, pool)],
                capacity_bytes=self.quota_bytes(self._names[q], pool),
            )
            for (q, pool), used in self._used.items()
        }
