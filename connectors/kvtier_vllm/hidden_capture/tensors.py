"""Captured hidden states as torch tensors, for training code: `load` reads a request's
reference (``kv_transfer_params["kvtier_hidden_states"]``) through any kvtier client."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvtier.core.protocol import TierClient
from kvtier.hidden.reader import HiddenStates, HiddenStatesReader, HiddenStatesRef


def as_tensor(states: HiddenStates) -> torch.Tensor:
    """[tokens, layers, hidden] in the captured dtype."""
    raw = torch.from_numpy(np.ascontiguousarray(states.states))
    dtype = getattr(torch, states.dtype)
    return raw if raw.dtype == dtype else raw.view(dtype)


def load(
    ref: HiddenStatesRef | dict[str, Any], client: TierClient, timeout_s: float = 30.0
) -> tuple[torch.Tensor, list[int] | None]:
    """(the states, their token ids) of one reference, read through ``client``."""
    reader = HiddenStatesReader(client, timeout_s=timeout_s)
    try:
        states = reader.load(ref)
    finally:
        reader.close()
    ids = list(states.token_ids) if states.token_ids is not None else None
    return as_tensor(states), ids
