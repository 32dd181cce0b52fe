"""Finished requests whose blocks wait for their stores: vLLM frees a request's blocks once it is
reported sent, so each is held behind the fence of the stores issued for it and reported once,
when vLLM said it finished and that fence passed."""

from __future__ import annotations

from kvtier_vllm.shared.copies import Fence


class PendingSends:
    def __init__(self) -> None:
        self._waiting: list[tuple[Fence, set[str]]] = []
        self._finished: set[str] = set()
        """Requests vLLM said finished, not yet reported sent (it takes only those)."""

    def after(self, fence: Fence, requests: list[str]) -> None:
        """Hold ``requests`` until the stores issued before ``fence`` landed."""
        # once each: vLLM frees a request's blocks at its first report, and fails on a second
        fresh = set(requests).difference(*(reqs for _, reqs in self._waiting))
        if fresh:
            self._waiting.append((fence, fresh))

    def sent(self, finished: set[str]) -> set[str]:
        """Finished requests whose last stores landed: their blocks may go."""
        self._finished |= finished
        sent: set[str] = set()
        waiting = []
        for fence, requests in self._waiting:
            ready = requests & self._finished
            if ready and fence():
                sent |= ready
                requests -= ready
            if requests:
                waiting.append((fence, requests))
        self._waiting = waiting
        self._finished -= sent
        self._finished &= {r for _, reqs in waiting for r in reqs} | finished
        return sent

    def release_all(self) -> set[str]:
        """Every request waiting, as sent (a store that did not land is never committed, so its
        blocks may go)."""
        sent = {r for _, reqs in self._waiting for r in reqs}
        self._waiting = []
        return sent
