"""A router's view of a real node: a vLLM engine publishing its own KV events over ZMQ, kvtierd
beside it uploading to S3 (moto, through IRSA) and publishing the object tier's events, and a
router decoding both with vLLM's classes. Its index of the object tier matches the bucket chunk
for chunk, under the engine's own block hashes, through uploads, gc and a kvtierd restart."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.core.lineage import unpack
from kvtier.fleet.kv_events import external_hash
from kvtier.tiers.objstore.backend import open_backend
from kvtier.tiers.objstore.tier import COMPANION_SUFFIX
from tests.e2e.models import ModelSet, generate_tokens, running_llm
from tests.e2e.test_connector import kvtier_config
from tests.integration.daemon_harness import DaemonFiles, Processes, RunningDaemon, object_node
from tests.objstore.fixtures import AwsIrsa
from tests.router_index import RouterIndex

pytestmark = pytest.mark.slow

SETTLE_S = 60.0


def node(root: Path, url: str) -> DaemonFiles:
    return object_node(
        root,
        url,
        {
            "arena": {"size_bytes": 64 << 20, "min_slot_bytes": 16 << 10},
            "events": {
                "endpoint": f"ipc://{root}/kvtierd-pub.sock",
                "replay_endpoint": f"ipc://{root}/kvtierd-replay.sock",
            },
        },
        admission="all",
        pack_linger_ms=20,
        request_timeout_s=5.0,
    )


def bucket_blocks(url: str) -> set[int | bytes]:
    """The block hashes named by the lineage companions of the bucket's objects."""
    backend = open_backend(url, 10.0)
    try:
        names = {info.name for info in backend.list()}
        held: set[int | bytes] = set()
        for name in names:
            # a companion goes up before its object: without one, it is not announced yet
            if name.endswith(COMPANION_SUFFIX) and name.removesuffix(COMPANION_SUFFIX) in names:
                for _, lineage in unpack(backend.get(name))[1]:
                    held.update(external_hash(h, True) for h in lineage.block_hashes)
        return held
    finally:
        backend.close()


def object_chunks(daemon: RunningDaemon) -> tuple[int, int]:
    """(lmdb, object) chunks kvtierd holds."""
    tiers = {t.tier: t.usage.chunks for t in daemon.stats().tiers}
    return tiers.get("lmdb", 0), tiers.get("object", 0)


def settle(router: RouterIndex, url: str, ready: Callable[[], bool]) -> set[int | bytes]:
    """Take batches as they come until ``ready`` and the router's object tier is the bucket's
    (replaying what did not come); returns it."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        router.take_live()
        if ready():
            held = bucket_blocks(url)
            if router.blocks_of("object") != held:
                router.replay(router.last_seq + 1)  # what did not come live
            if router.blocks_of("object") == held:
                return held
        assert time.monotonic() < deadline, (
            f"router holds {len(router.blocks_of('object'))} object blocks, "
            f"the bucket {len(bucket_blocks(url))}"
        )
        time.sleep(0.2)


def engine_events(root: Path) -> object:
    from vllm.config import KVEventsConfig

    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{root}/engine-pub.sock",
        replay_endpoint=f"ipc://{root}/engine-replay.sock",
        topic="kv@pod-a@tiny",
    )


def test_a_router_index_of_the_object_tier_matches_the_bucket_under_the_engines_hashes(
    tiny_models: ModelSet,
    prompts: list[list[int]],
    fresh_prompts: list[list[int]],
    tmp_path: Path,
    procs: Processes,
    s3_store: str,
    aws_irsa: AwsIrsa,
) -> None:
    files = node(tmp_path / "node", s3_store)
    daemon = procs.start_daemon(files)
    events = engine_events(tmp_path)
    kvtierd = RouterIndex(
        f"ipc://{tmp_path}/node/kvtierd-pub.sock", f"ipc://{tmp_path}/node/kvtierd-replay.sock"
    )
    engine = RouterIndex(
        f"ipc://{tmp_path}/engine-pub.sock", f"ipc://{tmp_path}/engine-replay.sock"
    )
    connector = kvtier_config({"mode": "sidecar", "socket_path": str(files.socket)})
    try:
        with running_llm(
            tiny_models.target, kv_transfer_config=connector, kv_events_config=events
        ) as llm:
            generate_tokens(llm, prompts, max_tokens=4)
            daemon.admin().drain()

            def uploaded() -> bool:
                lmdb, obj = object_chunks(daemon)
                return obj >= lmdb > 0

            held = settle(kvtierd, s3_store, uploaded)
            engine.replay(engine.last_seq + 1)
        assert held
        assert kvtierd.live > 0
        # the engine's own hashes: every block the object tier holds, the GPU held first
        assert held <= engine.seen_of("gpu")
        assert held <= engine.seen_of("cpu")  # through the arena, announced by the connector

        list(daemon.admin().gc(retention_s=0))
        assert settle(kvtierd, s3_store, lambda: object_chunks(daemon)[1] == 0) == set()

        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(30) == 0
        before = kvtierd.last_seq
        daemon = procs.start_daemon(files)
        with running_llm(
            tiny_models.target, kv_transfer_config=connector, kv_events_config=events
        ) as llm:
            generate_tokens(llm, fresh_prompts, max_tokens=4)
            daemon.admin().drain()
            # numbered on from before the restart: a router that dropped numbers it had seen
            # would miss every new batch, and this would never settle
            # chunks lmdb kept from before gc go up again unannounced (their lineage was in
            # the old process's memory): wait for the new prompts' announced uploads
            held = settle(kvtierd, s3_store, lambda: bool(bucket_blocks(s3_store)))
        assert held
        assert kvtierd.last_seq > before
    finally:
        kvtierd.close()
        engine.close()
