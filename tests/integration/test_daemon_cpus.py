"""kvtierd on the CPUs it is given (`server.cpus`): every thread, those its calls and movers
start later included, and a refused start for a CPU it may not use. Real daemon processes; the
masks are read from /proc."""

from __future__ import annotations

import os
from contextlib import closing
from pathlib import Path

import pytest
import yaml

from kvtier.core.cpus import format_cpu_list
from tests.integration.daemon_harness import ArenaClient, DaemonFiles, Processes, wait_for

ALLOWED = os.sched_getaffinity(0)


def thread_masks(pid: int) -> dict[str, str]:
    """Each thread's name and ``Cpus_allowed_list``, by thread id."""
    masks: dict[str, str] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = dict(
                line.split(":\t", 1) for line in (task / "status").read_text().splitlines()
            )
        except FileNotFoundError:  # the thread ended
            continue
        masks[f"{task.name} {status['Name']}"] = status["Cpus_allowed_list"].strip()
    return masks


def with_cpus(files: DaemonFiles, cpus: str) -> DaemonFiles:
    tree = yaml.safe_load(files.config.read_text())
    tree["server"]["cpus"] = cpus
    files.config.write_text(yaml.safe_dump(tree))
    return files


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs to leave one out")
def test_every_thread_of_kvtierd_runs_on_the_cpus_it_is_given(
    procs: Processes, files: DaemonFiles
) -> None:
    given = format_cpu_list({max(ALLOWED)})
    daemon = procs.start_daemon(with_cpus(files, given))
    with closing(ArenaClient(files.socket, "dp0")) as client:
        # calls and an idle client's write-back: the gRPC and mover threads are running
        assert client.store(range(16)) == list(range(16))
        wait_for(lambda: daemon.chunks_moved("demote") == 16, 10.0, "the stores written back")
        verdicts, _ = client.load(range(16), keep=False)
        assert verdicts == [True] * 16
        masks = thread_masks(daemon.proc.pid)
    assert len(masks) > 4, masks
    assert {name: mask for name, mask in masks.items() if mask != given} == {}
    assert f"kvtierd runs on CPUs {given}" in daemon.log_text()


def test_a_cpu_kvtierd_may_not_use_refuses_the_start_naming_the_key(
    procs: Processes, files: DaemonFiles
) -> None:
    beyond = max(ALLOWED) + 1
    rc, out, err = procs.run_daemon_to_exit(with_cpus(files, f"0,{beyond}"))
    assert rc == 2, err
    assert f"server.cpus: CPU {beyond} is not one kvtierd may run on" in err
    assert f"it may use {format_cpu_list(ALLOWED)}" in err
    assert "kvtierd ready" not in out
    assert not files.socket.exists()


@pytest.mark.parametrize("text", ["", "one", "3-1", "1,,2", "-1"])
def test_a_malformed_cpu_list_refuses_the_start_naming_the_key(
    procs: Processes, files: DaemonFiles, text: str
) -> None:
    rc, out, err = procs.run_daemon_to_exit(with_cpus(files, text))
    assert rc == 2, err
    assert "invalid configuration" in err
    assert "server.cpus" in err
    assert "kvtierd ready" not in out
