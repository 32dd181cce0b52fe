"""KV event batches over ZMQ, framed as vLLM's publisher frames them: PUB messages
``(topic, seq as 8 bytes big-endian, payload)``, and a ROUTER that answers ``(identity, b"",
start seq)`` with every kept batch from it on, then ``(b"", -1 as 8 bytes, b"")``.

One thread owns both sockets (ZMQ sockets are not thread-safe); callers hand it batches through a
queue and never wait on a subscriber.
"""

from __future__ import annotations

import logging
import queue
import threading

import zmq

from kvtier.core.counters import Counters
from kvtier.core.priority import enter_background
from kvtier.fleet.event_log import EventLog

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_QUEUE = 1 << 16
_POLL_MS = 100
_HWM = 100_000


def _bound(sock: zmq.Socket[bytes], endpoint: str) -> None:
    # as vLLM: wildcard and local endpoints are bound, the rest connected to
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class EventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        event_log: EventLog,
        counters: Counters,
    ) -> None:
        self.log = event_log
        self._counters = counters
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(_QUEUE)
        self._flushed: list[threading.Event] = []  # waiters woken when the queue reaches them
        self._flushed_lock = threading.Lock()
        self._stopping = False
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(_HWM)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            _bound(self._pub, endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        )
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()

    def publish(self, topic: str, payload: bytes) -> None:
        """Queue a batch; a full queue drops it (counted), since the tiers must never wait."""
        try:
            self._queue.put_nowait((topic.encode(), payload))
        except queue.Full:
            self._counters.add("event_batches_dropped", 1)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch is sent; True when none is left."""
        done = threading.Event()
        with self._flushed_lock:
            self._flushed.append(done)
        self._queue.put(None)
        return done.wait(timeout)

    def _run(self) -> None:
        enter_background()
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                try:
                    self._answer_replay()
                except Exception:  # one subscriber's replay must not end the stream
                    log.exception("kvtier: answering a KV event replay failed")
            try:
                item = self._queue.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            if item is None:
                with self._flushed_lock:
                    waiting, self._flushed = self._flushed, []
                for event in waiting:
                    event.set()
                if self._stopping:
                    return
                continue
            topic, payload = item
            try:
                seq = self.log.append(topic, payload)
                if seq is None:  # no space to keep it (counted): a replay could not give it
                    self._counters.add("event_batches_dropped", 1)
                    continue
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._counters.add("event_batches", 1)
            except Exception:  # a failing disk or socket must not end the thread
                log.exception("kvtier: publishing a KV event batch failed")
                self._counters.add("event_batches_dropped", 1)

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kvtier: malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        sent = 0
        for seq, topic, payload in self.log.since(int.from_bytes(start, "big")):
            self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
            sent += 1
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        self._counters.add("event_replays", 1)
        self._counters.add("event_batches_replayed", sent)

    def close(self) -> None:
        self._stopping = True
        self.flush(timeout=2.0)
        self._thread.join(2.0)
        self._close_sockets()
        self.log.close()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
