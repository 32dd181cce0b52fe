"""Finished requests whose blocks wait for their stores: vLLM frees a request's blocks once it is
reported sent, so each is held behind the fence of the stores issued for it and reported once,
when that fence passed.

The scheduler side names a request here (`KVTierMetadata.sending`) only after vLLM finished it
and kept its blocks for it, in the metadata of that step or of a later one (stores asked for
and answered steps later), so no request is reported before vLLM finished it; and vLLM may ask
for what was sent before the step's stores were issued (it finishes a step's saves after), so
a request named in a step goes out with a later one."""

from __future__ import annotations

from kvtier_vllm.shared.copies import Fence


class PendingSends:
    def __init__(self) -> None:
        self._waiting: list[tuple[Fence, set[str]]] = []

    def after(self, fence: Fence, requests: list[str]) -> None:
        """Hold ``requests`` until the stores issued before ``fence`` landed."""
        # once each: vLLM frees a request's blocks at its first report, and fails on a second
        fresh = set(requests).difference(*(reqs for _, reqs in self._waiting))
        if fresh:
            self._waiting.append((fence, fresh))

    def sent(self) -> set[str]:
        """Finished requests whose last stores landed: their blocks may go."""
        sent: set[str] = set()
        waiting = []
        for fence, requests in self._waiting:
            if fence():
                sent |= requests
            else:
                waiting.append((fence, requests))
        self._waiting = waiting
        return sent

    def release_all(self) -> set[str]:
        """Every request waiting, as sent (a store that did not land is never committed, so its
        blocks may go)."""
        sent = {r for _, reqs in self._waiting for r in reqs}
        self._waiting = []
        return sent
