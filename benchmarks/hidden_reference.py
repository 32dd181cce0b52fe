"""vLLM's `ExampleHiddenStatesConnector`, runnable on the CPU build: the reference kvtier's
captured hidden states are compared with.

Its extraction (the request's slot mapping, `extract_from_kv_cache`) and its file format are
vLLM's own; only the device copy is replaced, as it needs CUDA streams and pinned memory: here
the states are copied and written at once, and the lock file released.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Landed:
    """A copy event that has completed."""

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        save_file(
            {"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename
        )
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)
        landed: Any = _Landed()
        self._req_copy_events[pending.req_id] = landed
