"""Background threads' CPU priority (`kvtier.core.priority`): real threads of this process,
their nice value and name read from /proc; and a TierManager's movers and the connector's idle
writer, embedded as in an engine, at `manager.background_nice` while the thread calling them
keeps its own."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvtier_vllm.shared.connection import IdleWriter

from kvtier.client import embedded
from kvtier.core import priority
from kvtier.core.priority import DEFAULT_NICE, enter_background, set_background_nice
from kvtier.tiering.manager import TierManager
from tests.integration.daemon_harness import wait_for
from tests.support import keys_for, manager_config, payload_for, target_spec, thread_nices

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="nice values are per thread on Linux"
)
CHUNK = 64 << 10


@pytest.fixture(autouse=True)
def default_nice() -> Iterator[None]:
    yield
    set_background_nice(DEFAULT_NICE)


def my_nice() -> int:
    return thread_nices(os.getpid())[threading.get_native_id()][1]


def on_thread(first: Callable[[], None], name: str = "kvtier-test") -> tuple[str, int]:
    """Run ``first`` then `enter_background` on a new thread; its (name, nice) afterwards."""
    seen: list[tuple[str, int]] = []

    def run() -> None:
        first()
        enter_background()
        seen.append(thread_nices(os.getpid())[threading.get_native_id()])

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    return seen[0]


def test_a_background_thread_takes_the_nice_value_and_its_name_its_starter_keeps_its_own() -> None:
    before = my_nice()
    set_background_nice(min(19, before + 5))
    assert on_thread(lambda: None, "kvtier-a-long-thread-name") == (
        "kvtier-a-long-t",
        min(19, before + 5),
    )
    assert my_nice() == before


def test_a_thread_already_nicer_keeps_its_own_and_zero_lowers_nothing() -> None:
    nicer = min(19, my_nice() + 9)
    set_background_nice(min(19, my_nice() + 3))
    renice = lambda: os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nicer)  # noqa: E731
    assert on_thread(renice)[1] == nicer
    set_background_nice(0)
    assert on_thread(lambda: None)[1] == my_nice()


def test_a_nice_value_that_cannot_be_set_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refused(which: int, who: int, nice: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refused)
    monkeypatch.setattr(priority, "_told", threading.Event())
    set_background_nice(19)
    caplog.set_level(logging.WARNING, "kvtier.core.priority")
    for _ in range(3):
        assert on_thread(lambda: None)[1] == my_nice()  # it runs on, as it was
    assert [r.getMessage() for r in caplog.records] == [
        "cannot lower the background threads' priority to nice 19: [Errno 1] Operation not "
        "permitted; they run at the priority of the threads serving calls"
    ]


def test_an_embedded_managers_movers_run_at_its_nice_and_its_caller_at_its_own(
    shm_path: Path, tmp_path: Path
) -> None:
    before = my_nice()
    nice = min(19, before + 4)
    m = TierManager(manager_config(shm_path, tmp_path, background_nice=nice))
    try:
        ns = m.register_pool(target_spec(), CHUNK)
        keys = keys_for(ns, 4)
        refs = [r for r in m.reserve(keys, "r0") if r is not None]
        for ref in refs:
            m.cpu.view(ref)[:] = payload_for(ref.key, CHUNK)
        assert m.commit(refs) == len(keys)
        assert m.flush(10.0)

        def movers() -> dict[str, int]:
            threads = thread_nices(os.getpid()).values()
            return {n: v for n, v in threads if n in ("kvtier-writebac", "kvtier-promote")}

        # each names itself and lowers its priority as it starts running, which a busy
        # machine may delay
        expected = {"kvtier-writebac": nice, "kvtier-promote": nice}
        wait_for(lambda: movers() == expected, 10.0, f"the movers at nice {nice}: {movers()}")
        assert my_nice() == before
    finally:
        m.close()


def test_an_engines_idle_writer_runs_at_the_managers_nice(shm_path: Path, tmp_path: Path) -> None:
    nice = min(19, my_nice() + 6)
    client = embedded(manager_config(shm_path, tmp_path, background_nice=nice))
    writer = IdleWriter(client, idle_s=0.01, backlog=1)
    try:

        def writer_nice() -> int | None:
            found = [v for n, v in thread_nices(os.getpid()).values() if n == "kvtier-idle-wri"]
            return found[0] if found else None

        wait_for(lambda: writer_nice() is not None, 10.0, "the idle writer named")
        assert writer_nice() == nice
    finally:
        writer.close()
        client.close()
