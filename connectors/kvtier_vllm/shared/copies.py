"""How the worker moves bytes between vLLM's KV pages and arena slots, by device.

On the CPU a copy is a plain ``copy_``, done when it returns. On a GPU the arena is registered
with CUDA (``cudaHostRegister``) so copies are DMA from pinned memory; they run on a dedicated
stream, and events say when they are done:

- loads: the forward stream waits on the load event, on the device. A slot's generation is
  checked only once the event completed (a slot rewritten before its bytes were read passes a
  check made when the copy was queued): for synchronous loads the host waits for the event
  after the forward was launched, asynchronous ones are checked when a query finds it done;
- stores: a store is reported to the scheduler only once its event completed, so a slot is
  committed only after its bytes arrived.

`DeferredCopies` runs on the CPU with a device's timing, so that tests catch code that trusts a
copy before its fence passed.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def _landed() -> bool:
    return True


def _nothing() -> None:
    """Nothing left to wait for."""


class Fence:
    """The copies issued before it was taken: calling it says whether they landed, without
    blocking; `wait` blocks until they did."""

    __slots__ = ("_query", "_wait")

    def __init__(
        self, query: Callable[[], bool] = _landed, wait: Callable[[], None] = _nothing
    ) -> None:
        self._query = query
        self._wait = wait

    def __call__(self) -> bool:
        return self._query()

    def wait(self) -> None:
        self._wait()


_PASSED = Fence()


class CpuCopies:
    """Synchronous copies: every fence is already passed."""

    immediate = True
    """A copy is done when `copy` returns: its source may change right after."""

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

    def end_stores(self) -> Fence:
        """Passed once every store issued since `begin_stores` landed."""
        return self.fence()

    def fence(self) -> Fence:
        """Passed once every copy issued so far landed."""
        return _PASSED


class CudaCopies(CpuCopies):
    """Copies between device pages and a pinned arena on one side stream, fenced by events."""

    immediate = False

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

    def fence(self) -> Fence:
        event = torch.cuda.Event()
        event.record(self.stream)
        return Fence(event.query, event.synchronize)


Pair = tuple[torch.Tensor, torch.Tensor]
"""(destination, source) of one copy."""


class DeferredCopies(CpuCopies):
    """CPU copies with a device's timing: `copy` only queues, and the bytes move, in issue
    order, at the latest point a device could still be moving them: when a fence is asked or
    waited on, at `end_loads` (the forward that reads them runs next, on the host), and before
    the arena is mapped again or unmapped. A slot looked at while its copy is queued is seen as
    it was then, not as it is when the bytes are read.

    ``before_landing(copies, pairs)`` runs whenever queued copies are about to land, with those
    copies: what it changes meanwhile (a slot evicted and rewritten) is what they read.
    ``busy_queries``: how many times each fence answers "not yet" before its copies land.
    """

    immediate = False

    def __init__(
        self,
        before_landing: Callable[[DeferredCopies, list[Pair]], None] | None = None,
        busy_queries: int = 0,
    ) -> None:
        super().__init__()
        self.before_landing = before_landing
        self.busy_queries = busy_queries
        self._queue: deque[Pair] = deque()
        self._issued = 0
        self._landed = 0
        self._arena: torch.Tensor | None = None

    def attach(self, arena: torch.Tensor) -> None:
        self._land(self._issued)
        self._arena = arena

    def detach(self) -> None:
        self._land(self._issued)
        self._arena = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._queue.append((dst, src))
        self._issued += 1

    def end_loads(self) -> None:
        self._land(self._issued)

    def fence(self) -> Fence:
        upto = self._issued
        busy = self.busy_queries

        def query() -> bool:
            nonlocal busy
            if upto > self._landed and busy > 0:
                busy -= 1
                return False
            self._land(upto)
            return True

        return Fence(query, lambda: self._land(upto))

    @property
    def pending(self) -> int:
        """Copies queued that have not landed."""
        return self._issued - self._landed

    def arena_offset(self, tensor: torch.Tensor) -> int | None:
        """Where ``tensor`` starts in the attached arena; None if it lies outside it."""
        arena = self._arena
        if arena is None:
            return None
        offset = tensor.data_ptr() - arena.data_ptr()
        return offset if 0 <= offset < arena.numel() else None

    def _land(self, upto: int) -> None:
        if upto <= self._landed:
            return
        pairs = [self._queue.popleft() for _ in range(upto - self._landed)]
        self._landed = upto  # before the hook, which may ask a fence again
        if self.before_landing is not None:
            self.before_landing(self, pairs)
        for dst, src in pairs:
            dst.copy_(src)


def copies_for(device: torch.device) -> CpuCopies:
    return CudaCopies(device) if device.type == "cuda" else CpuCopies()
