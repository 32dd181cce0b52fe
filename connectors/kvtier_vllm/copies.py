"""How the worker moves bytes between vLLM's KV pages and arena slots, by device.

On the CPU a copy is a plain ``copy_``, done when it returns. On a GPU the arena is registered
with CUDA (``cudaHostRegister``) so copies are DMA from pinned memory; they run on a dedicated
stream, and events say when they are done:

- loads: the forward stream waits on the load event (on the device; the host never blocks);
- stores: a store is reported to the scheduler only once its event completed, so a slot is
  committed only after its bytes arrived.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

Done = Callable[[], bool]
"""Whether the copies issued before it was taken are complete."""


def _done() -> bool:
    return True


class CpuCopies:
    """Synchronous copies: every fence is already passed."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def attach(self, arena: torch.Tensor) -> None:
        """The arena's bytes, mapped (again); nothing to register on the CPU."""

    def detach(self) -> None:
        """The arena is about to be unmapped."""

    def begin_loads(self) -> None:
        """Loads follow; on a GPU they wait for nothing."""

    def begin_stores(self) -> None:
        """Stores follow, of what the forward just wrote."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def end_loads(self) -> None:
        """Make the forward see every load issued since `begin_loads`."""

    def end_stores(self) -> Done:
        """A check that turns true once every store issued since `begin_stores` landed."""
        return self.fence()

    def fence(self) -> Done:
        """A check that turns true once every copy issued so far landed."""
        return _done


class CudaCopies(CpuCopies):
    """Copies between device pages and a pinned arena on one side stream, fenced by events."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._registered: int | None = None

    def attach(self, arena: torch.Tensor) -> None:
        self.detach()
        cudart: Any = torch.cuda.cudart()
        # cudaHostRegisterPortable (1): pinned for every context of the process
        err = cudart.cudaHostRegister(arena.data_ptr(), arena.numel(), 1)
        if int(err) != 0:
            # still correct, only slower: copies from pageable memory stage through a bounce
            log.warning(
                "kvtier: cudaHostRegister of the arena failed (%s); copies stay pageable", err
            )
            return
        self._registered = arena.data_ptr()

    def detach(self) -> None:
        if self._registered is not None:
            torch.cuda.synchronize(self.device)  # no copy may still read the mapping
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None

    def begin_loads(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def begin_stores(self) -> None:
        # the forward (and the draft's) wrote the pages on the current stream
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def end_loads(self) -> None:
        event = torch.cuda.Event()
        event.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(event)

    def fence(self) -> Done:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event.query


def copies_for(device: torch.device) -> CpuCopies:
    return CudaCopies(device) if device.type == "cuda" else CpuCopies()
