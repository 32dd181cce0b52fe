"""kvtierd gives arena memory back across a model switch: the next model's chunk size stores
within seconds of the last one's session ending, and a namespace no open session holds expires,
so `server.max_namespaces` counts live ones. A real daemon, its data plane over gRPC."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvtier.core.errors import CapacityError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import TierCode
from kvtier.rpc import GrpcTierClient
from tests.integration.daemon_harness import Processes, wait_for, write_config
from tests.support import keys_for, layout, target_spec

KiB = 1 << 10
DEADLINE_S = 20.0
# three layers where A has two: chunks of 384 KiB, another slot class
MODEL_B = target_spec(model="b", layout=layout(3))


def _store(client: GrpcTierClient, keys: list[ChunkKey]) -> int:
    return client.commit([r for r in client.reserve(keys) if r is not None])


def _client(socket: Path) -> GrpcTierClient:
    return GrpcTierClient(socket, "r0", timeout_s=10.0, tune_memory=False)


def test_the_next_model_stores_after_the_last_one_filled_the_arena(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    files = write_config(
        tmp_path,
        shm_path,
        {
            "arena": {"reclaim_idle_s": 0.5, "prefault": False},
            "server": {"max_namespaces": 1, "namespace_idle_s": 0.5},
        },
    )
    daemon = procs.start_daemon(files)
    first = _client(files.socket)
    a = first.register_pool(target_spec(model="a"), 256 * KiB)
    a_keys = keys_for(a, 160)  # 40 MiB of chunks into a 32 MiB arena
    assert sum(_store(first, a_keys[i : i + 16]) for i in range(0, 160, 16)) >= 100
    first.close()  # the engine of model A goes away

    second = _client(files.socket)
    try:
        register: Callable[[], bytes] = lambda: second.register_pool(  # noqa: E731
            MODEL_B, 384 * KiB
        )

        def registered() -> bool:
            try:
                register()
            except CapacityError:  # A's namespace has not expired yet
                return False
            return True

        wait_for(registered, DEADLINE_S, "model B registered once A's namespace expired")
        b_keys = keys_for(MODEL_B.digest(), 50)
        committed: set[ChunkKey] = set()

        def stored() -> bool:
            todo = [k for k in b_keys if k not in committed]
            refs = [r for r in second.reserve(todo) if r is not None]
            second.commit(refs)
            committed.update(r.key for r in refs)
            return len(committed) >= 45

        wait_for(stored, DEADLINE_S, "model B's chunks committed")
        assert second.lookup(b_keys).hits >= 45
        gauges = {name: value for name, _, value in daemon.metrics()}
        assert gauges["kvtier_namespaces"] == 1
        assert gauges["kvtier_arena_slot_classes"] <= 2
    finally:
        second.close()


def test_a_closed_engines_extents_go_to_the_next_model_before_anything_expires(
    procs: Processes, tmp_path: Path, shm_path: Path
) -> None:
    # nothing goes idle or times out within the test: only the closing client ends A's session
    hour = 3600.0
    files = write_config(
        tmp_path,
        shm_path,
        {
            "arena": {"reclaim_idle_s": hour, "prefault": False},
            "server": {"namespace_idle_s": hour, "session_timeout_s": hour},
        },
    )
    daemon = procs.start_daemon(files)
    first = _client(files.socket)
    a = first.register_pool(target_spec(model="a"), 256 * KiB)
    a_keys = keys_for(a, 128)  # every slot of the 32 MiB arena's 2 MiB extents
    assert sum(_store(first, a_keys[i : i + 16]) for i in range(0, 128, 16)) >= 100
    first.close()  # the engine of model A goes away

    second = _client(files.socket)
    try:
        b = second.register_pool(MODEL_B, 384 * KiB)
        b_keys = keys_for(b, 80)

        def held() -> bool:
            _store(second, b_keys)  # those the arena holds already get no slot
            in_arena = sum(second.lookup([k]).tier_codes.count(TierCode.CPU) for k in b_keys)
            return in_arena >= 60  # 22.5 MiB: more than levelling with a busy A leaves B

        wait_for(held, DEADLINE_S, "model B took A's extents")
        gauges = {name: value for name, _, value in daemon.metrics()}
        assert gauges["kvtier_sessions"] == 1  # A's ended when its client closed
    finally:
        second.close()
