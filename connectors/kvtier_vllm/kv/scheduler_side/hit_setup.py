"""What every request's hit decision shares (`HitSetup`): the tier client, the pool plans and
their namespaces, the waits, the verifier, the load chooser and the leases of planned loads;
and the requests whose lookups are still with kvtierd, asked again next step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.client import reader_at, release_reader
from kvtier.core.keys import ChunkKey, Pool
from kvtier.core.protocol import Answer, LookupResult, TierClient, TierCode
from kvtier_vllm.drafts.pool import DraftPool
from kvtier_vllm.drafts.swaps import DraftTracker
from kvtier_vllm.kv.scheduler_side.leases import Leases, LoadLeases
from kvtier_vllm.kv.scheduler_side.load_chooser import LoadChooser, WholeHit
from kvtier_vllm.kv.scheduler_side.prompt_keys import targets_of
from kvtier_vllm.kv.scheduler_side.tier_calls import TierCalls
from kvtier_vllm.kv.scheduler_side.verify import Verifier
from kvtier_vllm.layout.plans import PoolPlan
from kvtier_vllm.shared.connection import Session

CPU = int(TierCode.CPU)
LMDB = int(TierCode.LMDB)


class HitSetup:
    """The parts and settings a request's `HitDecision` works with, over ``client``.

    ``namespaces`` (per plan key) is read at each call: the draft's follows its swaps, and a
    draft pool without one is not waited for. A release that fails is handed back later by
    ``calls``."""

    def __init__(
        self,
        client: TierClient,
        plans: Sequence[PoolPlan],
        namespaces: dict[str, bytes],
        *,
        chunk_tokens: int,
        blocks_per_chunk: int,
        checkpoint: int = 0,
        drop_last: bool = False,
        wait_s: float = 0.0,
        lookup_wait_s: float = 0.0,
        recompute_wait: Callable[[int], float] | None = None,
        draft: DraftTracker | None = None,
        draft_pool: DraftPool | None = None,
        leases: Leases | None = None,
        calls: TierCalls | None = None,
        lmdb_path: str = "",
        verifier: Verifier | None = None,
        chooser: LoadChooser | None = None,
        session: Session | None = None,
    ) -> None:
        self.namespaces = namespaces
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = blocks_per_chunk
        self.checkpoint = checkpoint
        """Chunks between the sliding windows kept for shorter prefixes (0: none)."""
        self.drop_last = drop_last
        """A hit's last chunk is recomputed (EAGLE-style drafters)."""
        self.wait_s = wait_s
        """How long a request may be asked again for its promotions (or the draft's check)."""
        self.lookup_wait_s = lookup_wait_s
        """How long an ask waits for a lookup asked in the background."""
        self.recompute_wait = recompute_wait
        """How long a hit of so many tokens may be waited for past ``wait_s`` (a share of what
        recomputing it takes: `StepTimings.recompute_wait`)."""
        self.targets = targets_of(plans)
        assert self.targets, "a hit needs a target plan"
        self.anchor = self.targets[0]
        self.windowed = any(p.window for p in self.targets)
        """A shorter hit moves the sliding windows' first chunks."""
        self.draft_plan = next((p for p in plans if p.pool is Pool.DRAFT), None)
        self.draft = draft
        self.draft_pool = draft_pool
        self.loadable = bytes([CPU, LMDB] if lmdb_path else [CPU])
        """The tiers a load reads: lmdb's chunks load from there (``lmdb_path``), unpromoted."""
        self._lmdb = reader_at(lmdb_path) if lmdb_path else None
        self._lmdb_path = lmdb_path
        self.client = client
        """The client every lookup, lease and promotion goes over."""
        self.calls = calls if calls is not None else TierCalls(client)
        self.leases = LoadLeases(
            leases if leases is not None else Leases(2),
            self.calls,
            chunk_tokens=chunk_tokens,
            in_lmdb=bool(lmdb_path),
            windowed=self.windowed,
            draft=draft,
            draft_plan=self.draft_plan,
        )
        self.verifier = verifier if verifier is not None else Verifier(0.0, 0.0, {})
        self.chooser: LoadChooser = chooser if chooser is not None else WholeHit()
        """How much of a hit to load."""
        self.session = session
        """Told of each ask: writing to lmdb waits while the engine is busy."""
        self.unanswered: list[Answer[LookupResult]] = []
        """The lookups of requests asked again next step, still with kvtierd."""

    @property
    def reads_lmdb(self) -> bool:
        """Whether lmdb's map is read here (`in_lmdb` says whether it holds a chunk)."""
        return self._lmdb is not None

    def in_lmdb(self, key: ChunkKey) -> bool | None:
        """Whether lmdb holds ``key``, where hits load from lmdb's map: read from the map with no
        call (a hit there is worth a lookup in the step, as one in the arena's index is); None
        where the map could not be read."""
        return self._lmdb.holds(key) if self._lmdb is not None else False

    def close(self) -> None:
        """The client is given up: lmdb's reader goes back."""
        if self._lmdb is not None:
            self._lmdb = None
            release_reader(self._lmdb_path)

    def next_step(self, wait_s: float | None) -> None:
        """A new step: the requests whose lookups were on their way are asked again in it;
        with ``wait_s`` (nothing else runs in it) their answers are waited for first, each at
        most ``wait_s``: all were sent before, so the engine waits once for them all."""
        unanswered, self.unanswered = self.unanswered, []
        if wait_s is not None:
            for answer in unanswered:
                answer.wait(wait_s)
