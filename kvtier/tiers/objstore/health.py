"""Whether the object store is counted on: the identity the tier runs as (static keys are
refused unless allowed, loudly), resolved in the background, and the breaker's verdict. The tier's
checker thread sends the trials (`StoreHealth.check`) while the store is not sound."""

from __future__ import annotations

import logging
import threading

from kvtier.core.config import ObjectStoreConfig
from kvtier.core.errors import ConfigError, ObjectStoreError
from kvtier.tiers.objstore.backend import ObjectBackend
from kvtier.tiers.objstore.resilience import CircuitBreaker, RequestGuard

# the tier's logger, which operators filter on
log = logging.getLogger("kvtier.tiers.objstore.tier")

UNKNOWN_PRINCIPAL = "unknown"
"""The principal until the identity has been resolved (in the background)."""
_IDENTITY_FIX = {
    "s3": "use IRSA (AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE), EKS Pod Identity or the "
    "instance role, and remove the keys",
    "gs": "use GKE Workload Identity (unset GOOGLE_APPLICATION_CREDENTIALS), or workload "
    "identity federation (an external_account file in GOOGLE_APPLICATION_CREDENTIALS)",
}


def refuse_static_keys(backend: ObjectBackend, config: ObjectStoreConfig) -> None:
    """Raise `ConfigError` when the backend found long-lived keys, unless they are allowed
    (then a warning names them and the fix)."""
    source = backend.static_credentials()
    if source is None:
        return
    fix = _IDENTITY_FIX.get(backend.location.scheme, "use a workload identity")
    if config.allow_static_keys:
        log.warning(
            "object store %s: STATIC CREDENTIALS IN USE: %s; long-lived keys leak and do "
            "not rotate: %s",
            backend.url,
            source,
            fix,
        )
        return
    raise ConfigError(
        "object.url",
        f"static credentials are refused: {source}; {fix}. "
        "To run with them anyway, set object.allow_static_keys: true",
    )


class StoreHealth:
    """The identity resolved and the breaker closed, or not; trials that find out again."""

    def __init__(
        self, backend: ObjectBackend, breaker: CircuitBreaker, guard: RequestGuard
    ) -> None:
        self.backend = backend
        self.breaker = breaker
        self.guard = guard
        self.principal = UNKNOWN_PRINCIPAL
        self.principal_resolved = threading.Event()
        """Set once the first attempt to resolve the identity has ended, either way."""
        self._identity_known = False

    def resolve_principal(self) -> None:
        """Ask the store who the tier runs as; a failure trips the breaker (a miss per read
        until a trial succeeds)."""
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
        """Send a trial request unless the store is sound; True when the store is sound.
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
