"""Hidden-state capture: the reference a finished request hands back, and its tail chunk.

With vLLM's ``extract_hidden_states``, the hidden pool's whole chunks are stored and loaded
with the target's. What a request adds is its tail: the tokens past its last whole chunk,
stored as one more chunk named by its content. A prompt's tail is stored in the step that
computes the prompt's last token; with ``include_output_tokens``, the tail is known only at the
end, and vLLM keeps the request's blocks until the workers copied it. The reference
(`kvtier.hidden.reader.HiddenStatesRef`) names every chunk, in the request's ``kv_transfer_params``
under ``kvtier_hidden_states``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.client import ArenaAtPath, ArenaMemory
from kvtier.core.errors import KVTierError, PoolLayoutError
from kvtier.core.keys import ChunkKey, chunk_hash_bytes, make_key
from kvtier.core.protocol import TierClient
from kvtier.hidden.reader import (
    MANIFEST_PART_BYTES,
    REF_FIELD,
    HiddenStatesRef,
    manifest_name,
    manifest_parts,
    manifest_spec,
    tail_hash,
)
from kvtier_vllm.layout.plans import PoolPlan
from kvtier_vllm.shared.tier_access import TierAccess

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Tail:
    key: ChunkKey
    blocks: tuple[int, ...]
    """The request's blocks holding the tail's tokens, in order."""


@dataclass(frozen=True, slots=True)
class Capture:
    plan: PoolPlan

    @property
    def tokens_per_block(self) -> int:
        return self.plan.spec.layout.tokens_per_block

    @property
    def chunk_tokens(self) -> int:
        return self.tokens_per_block * self.plan.blocks_per_chunk

    @staticmethod
    def with_outputs(request: Any) -> bool:
        """Whether the request asked for its outputs' states too (``include_output_tokens``)."""
        return bool((request.kv_transfer_params or {}).get("include_output_tokens", False))

    def token_ids(self, request: Any) -> list[int]:
        """The tokens whose states are captured: the prompt's, or with ``include_output_tokens``
        every token but the last (an output never fed back has no hidden state)."""
        if self.with_outputs(request):
            return list(request.all_token_ids)[:-1]
        return list(request.prompt_token_ids or [])

    def _hashes(self, request: Any, ids: list[int]) -> list[bytes]:
        bpc = self.plan.blocks_per_chunk
        whole = len(ids) // self.chunk_tokens
        hashes = [chunk_hash_bytes(request.block_hashes[(c + 1) * bpc - 1]) for c in range(whole)]
        if len(ids) > whole * self.chunk_tokens:
            tail = ids[whole * self.chunk_tokens :]
            hashes.append(tail_hash(hashes[-1] if hashes else b"", tail))
        return hashes

    def reference(self, request: Any) -> HiddenStatesRef:
        ids = self.token_ids(request)
        return HiddenStatesRef(
            spec=self.plan.spec,
            chunks=tuple(self._hashes(request, ids)),
            tokens=len(ids),
            token_ids=tuple(ids),
        )

    def tail(self, ref: HiddenStatesRef, namespace: bytes, block_ids: list[int]) -> Tail | None:
        """The reference's chunk of the tokens past the last whole one, and the blocks holding
        them; None where the tokens end on a whole chunk."""
        whole = ref.tokens // self.chunk_tokens
        if ref.tokens == whole * self.chunk_tokens:
            return None
        first, end = whole * self.plan.blocks_per_chunk, -(-ref.tokens // self.tokens_per_block)
        return Tail(make_key(namespace, ref.chunks[-1]), tuple(block_ids[first:end]))

    def stored_tail(
        self, request: Any, ref: HiddenStatesRef, namespace: bytes, block_ids: list[int]
    ) -> Tail | None:
        """`tail`, when the blocks holding it are all still there to copy from."""
        tail = self.tail(ref, namespace, block_ids)
        if tail is not None and (not tail.blocks or not all(tail.blocks)):
            log.warning(
                "kvtier: request %s's last blocks are gone: its hidden-state tail is not stored",
                request.request_id,
            )
            return None
        return tail


class Manifests:
    """Writes each reference's manifest beside the states
    (`kvtier.hidden.reader.manifest_parts`), so that ``kvtier hidden export --namespace`` can list
    a pool's requests from the tiers alone.
    The parts are written into the arena from this process, as the workers write chunks; a
    failed call is reported to ``calls``, which commits or aborts later what it could not."""

    def __init__(self, calls: TierAccess) -> None:
        self.calls = calls
        self._client: TierClient | None = None
        self._pools: dict[bytes, bool] = {}
        """Per manifest pool registered with ``_client``, whether the tiers took it."""
        self._arena: ArenaAtPath | None = None

    def reference(self, capture: Capture, request: Any) -> tuple[HiddenStatesRef, dict[str, Any]]:
        """A finished request's reference, as its ``kv_transfer_params``; its manifest is
        written beside the states (a failure loses only the listing, the reference stands)."""
        ref = capture.reference(request)
        client = self.calls.client
        if client is not None:
            try:
                self.write(client, ref)
            except KVTierError as exc:
                self.calls.failed("manifest", exc)
        # Speculators names a generated sample by its ``handle``: the manifest's name
        return ref, {REF_FIELD: ref.to_json(), "handle": manifest_name(ref).hex()}

    def write(self, client: TierClient, ref: HiddenStatesRef) -> int:
        """Parts committed (0: present already, no room, the tiers refuse manifests, or the
        commit failed and is retried on a later step); raises `KVTierError`."""
        spec = manifest_spec(ref.namespace, ref.spec.tenant)
        manifests = spec.digest()
        if client is not self._client:  # a new session: its pools are registered anew
            self._client, self._pools = client, {}
        if manifests not in self._pools:
            try:
                client.register_pool(spec, MANIFEST_PART_BYTES)
                self._pools[manifests] = True
            except PoolLayoutError as exc:  # a setting, not a passing failure: said once
                log.error(
                    "kvtier: manifests of captured hidden states are not stored (%s); export "
                    "them from the references requests hand back (kvtier hidden export --refs)",
                    exc,
                )
                self._pools[manifests] = False
        if not self._pools[manifests]:
            return 0
        parts = manifest_parts(ref)
        slots = client.reserve([make_key(manifests, name) for name, _ in parts])
        written = [s for s in slots if s is not None]
        if not written:
            return 0
        try:
            arena = self._memory(client.arena_path)
            for slot, (_, payload) in zip(slots, parts, strict=True):
                if slot is not None:
                    arena.view(slot.offset, len(payload))[:] = payload
        except BaseException:
            self.calls.abort(written)
            raise
        return self.calls.commit(written)

    def _memory(self, path: Path) -> ArenaMemory:
        if self._arena is None or self._arena.path != path:
            self.close()
            # a few small parts per request: mapping every page would stall the scheduler
            self._arena = ArenaAtPath(path, populate=False)
        return self._arena.current()  # mapped again for a restarted daemon's new file

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None
