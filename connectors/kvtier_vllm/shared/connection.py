"""Opening the tiers for the scheduler side, and keeping them open.

Embedded mode runs the tiers in this process; sidecar mode opens a session with kvtierd. The
first open happens at start; after a failure the connector serves as if unconnected and opens
again on a thread of its own, since registering may take longer than a step may wait. An
embedded arena ends with the process, so its chunks are written to lmdb while the engine is
idle, and at exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtier.client import InProcessClient, shared_embedded
from kvtier.core.config import DemoteMode, load_config
from kvtier.core.errors import KVTierError, PoolLayoutError
from kvtier.core.keys import NamespaceSpec, Pool
from kvtier.core.priority import enter_background
from kvtier.core.protocol import TierClient
from kvtier.rpc import GrpcTierClient
from kvtier_vllm.shared.settings import Mode, TiersConfig

log = logging.getLogger(__name__)


class Registered(Protocol):
    """A pool a session registers (the KV connector's `PoolPlan`, or the encoder cache's)."""

    @property
    def key(self) -> str: ...
    @property
    def pool(self) -> Pool: ...
    @property
    def spec(self) -> NamespaceSpec: ...
    @property
    def chunk_bytes(self) -> int: ...


class DraftRevision(Protocol):
    """The draft pool's namespace at the revision swapped to (the KV connector's tracker)."""

    def current_spec(self) -> NamespaceSpec: ...


class JournalFollower(Protocol):
    """What reads the tiers' journal from each new client on (the KV connector's events)."""

    def follow(self, client: TierClient) -> None: ...


RECONNECT_S = 5
_WRITE_TXN_BYTES = 16 << 20  # per lmdb transaction: a request arriving mid-write waits for one


def open_client(cfg: TiersConfig, replica: str, chunk_bytes: int = 0) -> TierClient:
    if cfg.mode is Mode.SIDECAR:
        socket = cfg.socket_path or load_config(cfg.kvtier_config).server.socket_path
        return GrpcTierClient(socket, replica, deadlines=cfg.deadlines())
    config = load_config(cfg.kvtier_config)
    update: dict[str, Any] = {}
    if cfg.write_through:
        update["demote_mode"] = DemoteMode.WRITE_THROUGH
    elif chunk_bytes:
        # the connector's idle writer decides when chunks reach lmdb (see IdleWriter): it
        # knows when the engine is busy, and a reserve of the manager's own would write beside
        # forwards once the arena is full
        batch = max(1, _WRITE_TXN_BYTES // chunk_bytes)
        update["writeback_batch_chunks"] = min(config.manager.writeback_batch_chunks, batch)
        update["clean_reserve"] = 0.0
    if update:
        manager = config.manager.model_copy(update=update)
        config = config.model_copy(update={"manager": manager})
    return shared_embedded(config, replica)  # the engine's other connector may hold it


def close_client(client: TierClient) -> None:
    """Close a client; an embedded one first writes what the arena holds to lmdb, and says how
    long that took (where vLLM kills the engine process first, the next start at the arena's
    path keeps what it held: kvtier.tiers.arena_salvage)."""
    if isinstance(client, InProcessClient):
        pending = client.writeback_pending()
        started = time.monotonic()
        client.flush()
        left = client.writeback_pending()
        log.info(
            "kvtier: closing wrote %d arena chunks to lmdb in %.2f s%s",
            pending - left,
            time.monotonic() - started,
            f"; {left} are not written" if left else "",
        )
    client.close()


class IdleWriter:
    """Embedded mode: writes committed arena chunks to lmdb while the engine has no request, or
    while more than ``backlog`` chunks are held only in the arena. Writing next to a forward
    would take CPU time from it; what is left at shutdown is written by the client's close."""

    def __init__(self, client: InProcessClient, idle_s: float, backlog: int) -> None:
        self._client = client
        self._idle_s = idle_s
        self._backlog = backlog
        self._active = False
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-idle-writer", daemon=True)
        self._thread.start()

    def touch(self, active: bool) -> None:
        """The engine did something; ``active``: it holds requests."""
        self._active = active
        self._last = time.monotonic()

    def _due(self) -> bool:
        pending = self._client.writeback_pending()
        if pending > self._backlog:
            return True
        idle = not self._active and time.monotonic() - self._last >= self._idle_s
        return pending > 0 and idle

    def _run(self) -> None:
        enter_background()  # the tiers' write-back, run from the engine's process
        while not self._stop.wait(self._idle_s / 2):
            try:
                while self._due() and not self._stop.is_set():
                    # one transaction per call: flush checks its deadline after each
                    self._client.flush(timeout=0)
            except Exception:  # never let the writer die silently
                log.exception("kvtier: writing arena chunks to lmdb failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Session:
    """The scheduler side's client: opened with every pool registered, opened again after a
    failure, and (embedded) written back when idle and at exit.

    ``namespaces`` is the caller's dict, per plan key: an open fills it. ``on_exit`` runs at
    interpreter exit unless `stop` ran first; it is held weakly, so the owner can go away."""

    def __init__(
        self,
        cfg: TiersConfig,
        replica: str,
        plans: Sequence[Registered],
        namespaces: dict[str, bytes],
        on_exit: Callable[[], None],
        draft: DraftRevision | None = None,
        events: JournalFollower | None = None,
    ) -> None:
        self.cfg = cfg
        self.replica = replica
        self.plans = list(plans)
        self.namespaces = namespaces
        self.draft = draft
        self.events = events
        self.client: TierClient | None = None
        self.writer: IdleWriter | None = None
        self._on_exit = weakref.WeakMethod(on_exit)
        self._at_exit: Callable[[], None] | None = None
        self._next_connect = 0.0
        self._opening: threading.Thread | None = None
        self._opened: tuple[TierClient, dict[str, bytes], int] | None = None

    def connect(self, wait: bool = False) -> bool:
        """Whether a client is open; on failure serve as if unconnected and try again later.
        Only the first try (``wait``, at start) is made here: later ones run on a thread of
        their own, taken up by the call after they succeed."""
        if self.client is not None:
            return True
        if self._opening is not None:
            if self._opening.is_alive():
                return False
            self._opening = None
        if self._opened is not None:
            client, namespaces, chunk_bytes = self._opened
            self._opened = None
            self._adopt(client, namespaces, chunk_bytes)
            return True
        now = time.monotonic()
        if now < self._next_connect or not self.plans:
            return False
        self._next_connect = now + RECONNECT_S
        if not wait:
            self._opening = threading.Thread(target=self._open, name="kvtier-connect", daemon=True)
            self._opening.start()
            return False
        self._open()
        return self.connect()

    def _open(self) -> None:
        """Open a client and register every pool; the result waits in ``_opened``."""
        client: TierClient | None = None
        namespaces: dict[str, bytes] = {}
        try:
            chunk_bytes = max(plan.chunk_bytes for plan in self.plans)
            client = open_client(self.cfg, self.replica, chunk_bytes)
            for plan in self.plans:
                try:
                    spec = plan.spec
                    if plan.pool is Pool.DRAFT and self.draft is not None:
                        spec = self.draft.current_spec()  # the revision swapped to, if any
                    namespaces[plan.key] = client.register_pool(spec, plan.chunk_bytes)
                except PoolLayoutError as exc:
                    if plan.pool is not Pool.DRAFT:  # every hit needs the target's and hidden's
                        raise
                    # without a draft pool, draft pages of hits are filled instead of loaded
                    log.error("kvtier: no %s pool: %s", plan.pool, exc)
            if self.events is not None:
                self.events.follow(client)
        except KVTierError as exc:  # never take the engine down
            if client is not None:
                client.close()
            log.error(
                "kvtier unavailable, serving without it (retry in %d s): %s", RECONNECT_S, exc
            )
            return
        self._opened = (client, namespaces, chunk_bytes)

    def _adopt(self, client: TierClient, namespaces: dict[str, bytes], chunk_bytes: int) -> None:
        self.namespaces.update(namespaces)
        self.client = client
        if isinstance(client, InProcessClient):
            self._keep_on_exit(client, chunk_bytes)

    def _keep_on_exit(self, client: InProcessClient, chunk_bytes: int) -> None:
        """The arena ends with this process: write it to lmdb when idle, and at exit if nobody
        shut the connector down."""
        if not self.cfg.write_through:
            # half the arena at most stays dirty: stores always find clean or free slots
            most = min(self.cfg.writeback_backlog_mib << 20, client.arena_bytes // 2)
            backlog = most // chunk_bytes
            idle_s = self.cfg.writeback_idle_ms / 1000
            self.writer = IdleWriter(client, idle_s, backlog)
        on_exit = self._on_exit

        def at_exit() -> None:
            call = on_exit()
            if call is not None:
                call()

        self._at_exit = at_exit
        atexit.register(at_exit)

    def touch(self, active: bool) -> None:
        """The engine did something (``active``: it holds requests): writing to lmdb waits,
        here or in kvtierd."""
        if self.writer is not None:
            self.writer.touch(active)
        if self.client is not None:
            self.client.set_busy(active)

    def stop(self) -> None:
        """Stop the at-exit hook and the idle writer, and close a client opened but never
        taken up; the client in use stays, for the caller to hand back what it holds."""
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self._opened is not None:  # opened after the last step: never used
            self._opened[0].close()
            self._opened = None

    def detach(self) -> TierClient | None:
        """The client in use, no longer this session's (the caller closes it)."""
        client, self.client = self.client, None
        return client
