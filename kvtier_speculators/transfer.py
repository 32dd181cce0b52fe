"""`KVTierHiddenStates`: Speculators' `HiddenStatesTransfer` reading kvtier's captured hidden
states, so a drafter trains on what serving captured, with no file in between.

A sample's states are found by its token ids among the requests the hidden pool's manifests
list (`kvtier_speculators.samples`); one generated online is read from the reference its
request hands back. Either way the chunks come from whichever tier holds them, through kvtierd
(its arena, leased) or through tiers of the trainer's own (embedded), verified on the way up,
fp8 decoded to the captured dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hs_connectors.transfer import HiddenStatesTransfer

from kvtier.core.config import KVTierConfig, load_config
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import TierClient
from kvtier.hidden.export import from_lmdb, manifest_keys, refs_of_manifests
from kvtier.hidden.reader import (
    REF_FIELD,
    HiddenStates,
    HiddenStatesError,
    HiddenStatesReader,
    HiddenStatesRef,
    manifest_name,
    manifest_spec,
)
from kvtier_speculators.samples import (
    MAX_SAMPLES,
    ChunkCache,
    SampleIndex,
    SampleReader,
    manifest_key,
)

HANDLE_FIELD = "handle"
"""What Speculators names a generated sample by in ``kv_transfer_params``."""


def as_sample(states: HiddenStates) -> dict[str, torch.Tensor]:
    """Speculators' sample: ``hidden_states`` [tokens, layers, hidden] in the captured dtype
    (the last layer is the verifier's), ``token_ids`` int64."""
    if states.token_ids is None:
        raise HiddenStatesError("a reference without token ids cannot be a training sample")
    tensor = torch.from_numpy(states.states)
    if states.dtype == "bfloat16":  # numpy holds bfloat16 as its raw bits
        tensor = tensor.view(torch.bfloat16)
    return {
        "hidden_states": tensor,
        "token_ids": torch.from_numpy(np.asarray(states.token_ids, dtype=np.int64)),
    }


@dataclass
class _Session:
    """What a process opened: the client, its reader, and how it lists manifests."""

    client: TierClient
    reader: HiddenStatesReader
    list_keys: Callable[[bytes], Sequence[ChunkKey]]

    def close(self) -> None:
        self.reader.close()
        self.client.close()


class KVTierHiddenStates(HiddenStatesTransfer):
    """Hidden states from kvtier's tiers, for Speculators' datasets.

    ``config`` is a kvtier config (a path or loaded): with ``through_daemon`` the chunks are
    read through the kvtierd at its ``server.socket_path`` and manifests listed from its lmdb;
    without, the trainer opens the tiers itself (arena, lmdb, object store; an engine of the
    same process shares them) and lists the object store's manifests too, so it finds what any
    node of the fleet captured.
    ``namespace`` is the hidden pool (hex, a reference's ``namespace``); without it, the first
    generated sample's pool. ``token_ids(i)`` gives sample ``i``'s tokens; without it, the
    ``input_ids`` column of the dataset at ``data_path`` (what `ArrowDataset` reads).
    ``max_samples`` bounds the samples known by their token ids (each holds its tokens and
    chunk hashes); past it the least recently read is dropped and looked up again when asked
    for, so a dataset larger than it lists the manifests again on such reads.
    """

    def __init__(
        self,
        config: KVTierConfig | str | Path,
        namespace: str | bytes | None = None,
        *,
        token_ids: Callable[[int], Sequence[int]] | None = None,
        data_path: str | Path | None = None,
        tenant: str = "default",
        through_daemon: bool = True,
        cache_bytes: int = 256 << 20,
        timeout_s: float = 30.0,
        refresh_s: float = 5.0,
        max_samples: int = MAX_SAMPLES,
    ) -> None:
        self.config = config if isinstance(config, KVTierConfig) else load_config(Path(config))
        self.namespace = bytes.fromhex(namespace) if isinstance(namespace, str) else namespace
        self.token_ids = token_ids
        self.data_path = data_path
        self.tenant = tenant
        self.through_daemon = through_daemon
        self.cache_bytes = cache_bytes
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.max_samples = max_samples
        self._session: _Session | None = None
        self._samples: SampleReader | None = None
        self._index: SampleIndex | None = None
        self._generated: dict[str, HiddenStatesRef] = {}
        self._tokens: Callable[[int], Sequence[int]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Dataloader workers each open their own session: nothing open is pickled."""
        state = dict(self.__dict__)
        state.update(_session=None, _samples=None, _index=None, _generated={}, _tokens=None)
        return state

    def setup(self) -> None:
        if self._session is None:
            self._session = self._open()
            self._samples = SampleReader(self._session.reader, ChunkCache(self.cache_bytes))
        if self._tokens is None:
            self._tokens = self.token_ids or self._dataset_tokens()

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        self.setup()
        index = self._sample_index()
        if index is None:
            return None
        assert self._tokens is not None  # set by setup
        ref = index.find(self._tokens(file_idx))
        if ref is None:
            return None
        try:
            return self._load(ref)
        except HiddenStatesError:
            return None  # evicted since it was listed: Speculators generates it again

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        self.setup()
        doc = hs_transfer_params.get(REF_FIELD)
        if doc is None:
            return None
        ref = HiddenStatesRef.from_json(doc)
        if self.namespace is None:
            self.namespace = ref.namespace
        index = self._sample_index()
        if index is not None and ref.namespace == self.namespace:
            index.add(ref)  # found by its tokens from now on, without listing
        self._generated[manifest_name(ref).hex()] = ref
        return self._load(ref)

    def delete(self, handle: str) -> None:
        """Forget a generated sample: its chunks leave this process's cache. The states stay in
        the tiers, where they are deduplicated with other requests' and may be another node's
        (kvtier evicts them by its own budgets); every read's lease was already released."""
        ref = self._generated.pop(handle, None)
        if ref is not None and self._samples is not None:
            self._samples.forget(ref)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = self._samples = self._index = None

    def _load(self, ref: HiddenStatesRef) -> dict[str, torch.Tensor]:
        assert self._samples is not None  # set by setup
        return as_sample(self._samples.load(ref))

    def _sample_index(self) -> SampleIndex | None:
        if self._index is None and self.namespace is not None:
            assert self._session is not None
            session, namespace, tenant = self._session, self.namespace, self.tenant

            def read(keys: Sequence[ChunkKey]) -> Iterable[HiddenStatesRef]:
                return refs_of_manifests(session.reader, namespace, list(keys), tenant)[0]

            self._index = SampleIndex(
                lambda: session.list_keys(namespace),
                read,
                key_of=lambda ref: manifest_key(ref, tenant),
                refresh_s=self.refresh_s,
                max_samples=self.max_samples,
            )
        return self._index

    def _open(self) -> _Session:
        if self.through_daemon:
            from kvtier.rpc import GrpcTierClient
            from kvtier.tiers.lmdb_env import stored_keys_read_only

            config = self.config
            client: TierClient = GrpcTierClient(config.server.socket_path, "speculators")

            def listed(namespace: bytes) -> Sequence[ChunkKey]:
                manifests = manifest_spec(namespace, self.tenant).digest()
                if not config.lmdb.path.exists():
                    return []
                return stored_keys_read_only(config.lmdb.path, manifests)

            return _Session(client, HiddenStatesReader(client, self.timeout_s), listed)
        from kvtier.client import shared_embedded

        # an engine in this process may own the arena already: an arena has one owner
        own = shared_embedded(self.config, "speculators")
        reader = HiddenStatesReader(own, self.timeout_s, below=from_lmdb(own.manager))
        return _Session(own, reader, lambda ns: manifest_keys(own.manager, ns, self.tenant))

    def _dataset_tokens(self) -> Callable[[int], Sequence[int]]:
        if self.data_path is None:
            raise ValueError("KVTierHiddenStates needs token_ids or the dataset's data_path")
        from datasets import load_from_disk

        column = load_from_disk(str(self.data_path)).with_format(None)

        def tokens(file_idx: int) -> Sequence[int]:
            ids: Sequence[int] = column[file_idx]["input_ids"]
            return ids

        return tokens
