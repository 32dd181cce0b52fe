"""A router's view of KV events, kept as llm-d keeps it: decoded with vLLM's own classes, the
model read from the topic (``kv@<pod>@<model>``), each block indexed under its lowercased medium,
and the longest prefix answered per tier. Missed batches (a sequence gap) are fetched from the
replay socket, as a router that keeps up must."""

from __future__ import annotations

import time
from collections import defaultdict

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class RouterIndex:
    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.blocks: defaultdict[tuple[str, str], set[int | bytes]] = defaultdict(set)
        """(model, tier) -> the block hashes that tier holds."""
        self.seen: defaultdict[str, set[int | bytes]] = defaultdict(set)
        """tier -> every block hash ever stored there, of any model."""
        self.last_seq = -1
        self.live = 0
        self.replayed = 0

    # -- receiving ------------------------------------------------------------------------

    def catch_up(self, through: int, live_wait_s: float = 10.0) -> None:
        """Apply batches until ``through`` is seen: live ones first, then replay what is missing."""
        deadline = time.monotonic() + live_wait_s
        while self.last_seq < through and time.monotonic() < deadline:
            self._take_live(100)
        if self.last_seq < through:
            self.replay(self.last_seq + 1)

    def take_live(self) -> None:
        """Apply every batch already received on the subscription."""
        while self._take_live(0):
            pass

    def _take_live(self, wait_ms: int) -> bool:
        if not self._sub.poll(wait_ms):
            return False
        topic, seq, payload = self._sub.recv_multipart()
        number = int.from_bytes(seq, "big")
        if number > self.last_seq + 1:
            self.replay(self.last_seq + 1)  # a gap: fill it before this one
        if self._apply(topic, number, payload):
            self.live += 1
        return True

    def replay(self, start: int) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not dealer.poll(10_000):
                    raise TimeoutError("no answer from the replay socket")
                _, topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return
                if self._apply(topic, int.from_bytes(seq, "big"), payload):
                    self.replayed += 1
        finally:
            dealer.close(linger=0)

    def _apply(self, topic: bytes, seq: int, payload: bytes) -> bool:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if seq <= self.last_seq:
            return False  # seen already (replay overlaps what came live)
        self.last_seq = seq
        model = topic.decode().split("@", 2)[2]
        for event in self._decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                tier = (event.medium or "gpu").lower()
                self.blocks[(model, tier)].update(event.block_hashes)
                self.seen[tier].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks[(model, (event.medium or "gpu").lower())].difference_update(
                    event.block_hashes
                )
            elif isinstance(event, AllBlocksCleared):
                for key in [k for k in self.blocks if k[0] == model]:
                    self.blocks[key].clear()
        return True

    # -- answering ------------------------------------------------------------------------

    def blocks_of(self, tier: str) -> set[int | bytes]:
        """What ``tier`` holds now, of every model."""
        return set().union(*(held for (_, t), held in self.blocks.items() if t == tier))

    def seen_of(self, tier: str) -> set[int | bytes]:
        return set(self.seen[tier])

    def longest_prefix(self, model: str, tier: str, hashes: list[int | bytes]) -> int:
        """Leading blocks of ``hashes`` that ``tier`` holds."""
        held = self.blocks[(model, tier)]
        for i, block in enumerate(hashes):
            if block not in held:
                return i
        return len(hashes)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()
