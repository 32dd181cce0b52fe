"""lmdb's disk on the GPU-ratio model (benchmarks/harness/disk_throttle.py,
benchmarks/gpu_ratio.py): the bandwidth scaled from a GPU node's NVMe, and a real blkio cgroup
that holds a process's reads of a dropped file to it, goes when left and is swept after its
maker was SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.fleet_costs import GPU_FIGURES, gpu_node
from benchmarks.gpu_ratio import (
    DiskBandwidth,
    cold_load_bytes,
    measure_loads,
    node_scaled_disk,
    reads_throttled,
)
from benchmarks.harness.disk_throttle import (
    DiskThrottle,
    ThrottleUnavailable,
    disk_of,
    hierarchy,
)
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import KiB, MiB
from benchmarks.serving_cases import LMDB_BACKED, SIDECAR
from tests.bench.serving_harness import small_servers

ROOT = Path(__file__).resolve().parents[2]
BANDWIDTH = 20_000_000
"""Small enough that an unthrottled read (GB/s here) exceeds it many times over."""


def _why_not_throttled(path: Path) -> str:
    if os.geteuid() != 0:
        return "not root: no cgroup can be made"
    try:
        hierarchy()
        disk_of(path)
    except ThrottleUnavailable as exc:
        return str(exc)
    return ""


@pytest.fixture
def on_disk(tmp_path: Path) -> Path:
    why = _why_not_throttled(tmp_path)
    if why:
        pytest.skip(f"no read throttle here: {why}")
    return tmp_path


def _blkio_cgroup(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        if "blkio" in controllers.split(",") or (controllers == "" and where):
            return where
    return ""


def _dropped_file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages drop
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


# -- the bandwidth ------------------------------------------------------------------------------


def test_the_disk_reads_a_tokens_kv_in_the_share_of_its_prefill_an_nvme_does_on_the_gpu() -> None:
    nvme = GPU_FIGURES["nvme_bytes_per_s"][0]
    gpu_kv = int(GPU_FIGURES["kv_bytes_per_token"][0])
    gpu_prefill = gpu_node().prefill_s_per_token
    # the GPU node's own token: its NVMe's bandwidth
    assert node_scaled_disk(gpu_prefill, gpu_kv).bytes_per_s == pytest.approx(nvme, rel=1e-6)
    # an eighth of the KV a token, prefilled twice as slowly: a sixteenth
    here = node_scaled_disk(2 * gpu_prefill, gpu_kv // 8)
    assert here.bytes_per_s == pytest.approx(nvme / 16, rel=1e-6)
    read_share_here = (gpu_kv // 8) / here.bytes_per_s / (2 * gpu_prefill)
    assert read_share_here == pytest.approx(gpu_kv / nvme / gpu_prefill, rel=1e-6)
    assert "6.9 GB/s" in here.how
    assert f"{gpu_kv // 8:,}" in here.how


def test_a_prefill_time_that_is_no_time_scales_no_disk_and_throttles_nothing() -> None:
    disk = node_scaled_disk(-1e-6, 16 * KiB)
    assert disk.bytes_per_s == 0
    with reads_throttled(Path("/"), disk, [os.getpid()]) as said:
        assert said.startswith("not throttled: a prefill time of -1e-06")
    with reads_throttled(Path("/"), None, [os.getpid()]) as said:
        assert said == "not throttled: no prefill time measured to scale the disk to"


def test_a_partition_is_throttled_on_its_whole_disk(tmp_path: Path) -> None:
    dev = os.stat(tmp_path).st_dev
    disk = tmp_path / "devices" / "vdz"
    (disk / "vdz1").mkdir(parents=True)
    (disk / "dev").write_text("254:16\n")
    (disk / "vdz1" / "partition").write_text("1\n")
    sys_block = tmp_path / "dev-block"
    sys_block.mkdir()
    (sys_block / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(disk / "vdz1")
    assert disk_of(tmp_path, sys_block) == "254:16"
    (disk / "vdz1" / "partition").unlink()  # a whole disk is its own
    assert disk_of(tmp_path, sys_block) == f"{os.major(dev)}:{os.minor(dev)}"
    with pytest.raises(ThrottleUnavailable, match="which is no block device"):
        disk_of(tmp_path, tmp_path / "empty")


def test_without_a_block_io_controller_the_throttle_says_so(tmp_path: Path) -> None:
    with pytest.raises(ThrottleUnavailable, match="no cgroup v1 blkio throttle"):
        hierarchy(tmp_path / "v1", tmp_path / "v2")
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cgroup.controllers").write_text("cpu memory pids\n")
    with pytest.raises(ThrottleUnavailable, match="no cgroup v2 io controller"):
        hierarchy(tmp_path / "v1", tmp_path / "v2")
    (tmp_path / "v2" / "cgroup.controllers").write_text("cpu io memory pids\n")
    assert hierarchy(tmp_path / "v1", tmp_path / "v2") == (tmp_path / "v2", True)


# -- a real cgroup ------------------------------------------------------------------------------

_READER = """
import os, sys, time
sys.stdin.readline()  # placed in the throttle by now
started = time.perf_counter()
with open(sys.argv[1], "rb", buffering=0) as f:
    read = len(f.read())
print(read, time.perf_counter() - started, flush=True)
"""


def test_a_placed_child_reads_a_dropped_file_no_faster_than_the_bound(on_disk: Path) -> None:
    data = _dropped_file(on_disk / "data", 8 * MiB)
    child = subprocess.Popen(
        [sys.executable, "-c", _READER, str(data)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with DiskThrottle("test-read", on_disk, BANDWIDTH) as throttle:
            assert throttle.cgroup is not None
            cgroup = throttle.cgroup
            throttle.place(child.pid)
            assert _blkio_cgroup(child.pid) == f"/{cgroup.name}"
            out, _ = child.communicate("go\n", timeout=60)
            read, elapsed = out.split()
        assert int(read) == 8 * MiB
        assert int(read) / float(elapsed) <= BANDWIDTH * 1.5
        assert not cgroup.exists()
    finally:
        child.kill()
        child.communicate()


def test_leaving_moves_a_placed_process_and_its_children_home_and_removes_the_cgroup(
    on_disk: Path,
) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; sys.stdin.readline(); "
         "c = subprocess.Popen(['sleep', '60']); print(c.pid, flush=True); c.wait()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    home = _blkio_cgroup(parent.pid)
    assert parent.stdin is not None
    assert parent.stdout is not None
    grandchild = 0
    try:
        with DiskThrottle("test-leave", on_disk, BANDWIDTH) as throttle:
            assert throttle.cgroup is not None
            cgroup = throttle.cgroup
            throttle.place(parent.pid)
            parent.stdin.write("go\n")
            parent.stdin.flush()
            grandchild = int(parent.stdout.readline())
            assert _blkio_cgroup(grandchild) == f"/{cgroup.name}"  # children follow
        assert not cgroup.exists()
        assert _blkio_cgroup(parent.pid) == home
        assert _blkio_cgroup(grandchild) == home
    finally:
        if grandchild:
            os.kill(grandchild, signal.SIGKILL)
        parent.kill()
        parent.communicate()


_KILLED_RUN = """
import os, subprocess, sys
from pathlib import Path
from benchmarks.harness.disk_throttle import DiskThrottle
throttle = DiskThrottle("test-sweep", Path(sys.argv[1]), 20_000_000).__enter__()
throttle.place(os.getpid())
# left running in the cgroup, as a server would be
child = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL)
print(throttle.cgroup, child.pid, flush=True)
sys.stdin.readline()
"""


def test_a_sigkilled_runs_cgroup_is_swept_by_the_next_start(on_disk: Path) -> None:
    run = subprocess.Popen(
        [sys.executable, "-c", _KILLED_RUN, str(on_disk)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.stdout is not None
    left, survivor = run.stdout.readline().split()
    leftover = Path(left)
    try:
        run.send_signal(signal.SIGKILL)
        run.communicate()
        assert leftover.parent == hierarchy()[0]
        assert leftover.exists()  # nothing removed it: its maker never left
        with DiskThrottle("test-sweep", on_disk, BANDWIDTH) as throttle:
            assert throttle.swept == [leftover.name]
            assert throttle.cgroup is not None
            assert throttle.cgroup.exists()
        assert not leftover.exists()
        assert _blkio_cgroup(int(survivor)) == "/"  # back in the hierarchy's root
    finally:
        os.kill(int(survivor), signal.SIGKILL)
        if leftover.exists():
            leftover.rmdir()


def test_the_lmdb_load_is_timed_on_the_throttled_disk(on_disk: Path) -> None:
    home = _blkio_cgroup(os.getpid())
    disk = DiskBandwidth(BANDWIDTH, "a test's")
    loads = measure_loads(16 * KiB, 128, total_bytes=8 * MiB, reps=1, disk=disk)
    assert loads.lmdb_disk.startswith("reads at 20 MB/s (")
    assert loads.lmdb_disk.endswith(": a test's")
    # every token's KV came from the disk, at the bound at most
    assert 16 * KiB / loads.lmdb_cold_s_per_token <= BANDWIDTH * 1.5
    assert _blkio_cgroup(os.getpid()) == home


def test_the_cold_load_reads_ten_slices_at_the_bound_at_least() -> None:
    assert cold_load_bytes(64 * MiB, DiskBandwidth(465_000_000, "")) == 465_000_000
    assert cold_load_bytes(64 * MiB, DiskBandwidth(20_000_000, "")) == 64 * MiB
    assert cold_load_bytes(64 * MiB, DiskBandwidth(0, "")) == 64 * MiB
    assert cold_load_bytes(64 * MiB, None) == 64 * MiB


def test_a_cold_load_within_a_slices_allowance_is_still_held_to_the_bound(on_disk: Path) -> None:
    # 2 MiB fits the 4 MB a slice grants at once after idling: read alone, it passes unheld
    disk = DiskBandwidth(2 * BANDWIDTH, "a test's")
    loads = measure_loads(16 * KiB, 128, total_bytes=2 * MiB, reps=1, disk=disk)
    assert "the first 4.0 MB after 100 ms idle unheld" in loads.lmdb_disk
    assert 16 * KiB / loads.lmdb_cold_s_per_token <= disk.bytes_per_s * 1.5


def test_kvtierd_and_the_engines_processes_below_an_arena_read_lmdb_throttled_while_it_serves(
    on_disk: Path,
) -> None:
    servers = small_servers(on_disk)
    servers.scale_lmdb_disk(60e-6)
    daemon = Kvtierd(on_disk / "kvtierd", servers.shm("throttled"), 64 * MiB, 32 * MiB)
    # an engine's processes as vLLM's server runs them: a front end whose child loads the hits
    engine = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        daemon.start()
        assert daemon.pid is not None
        engine_core = _child_of(engine.pid)
        readers = [daemon.pid, engine.pid, engine_core]
        home = {pid: _blkio_cgroup(pid) for pid in readers}
        with servers.lmdb_reads(LMDB_BACKED, daemon, "lmdb-backed", engine.pid):
            for pid in readers:
                assert _blkio_cgroup(pid).startswith("/kvtier-gpu-ratio-")
        assert servers.lmdb_throttles["lmdb-backed"].startswith("reads at 467 MB/s (")
        assert {pid: _blkio_cgroup(pid) for pid in readers} == home
        with servers.lmdb_reads(SIDECAR, daemon, "arena-backed", engine.pid):  # arena holds all
            assert {pid: _blkio_cgroup(pid) for pid in readers} == home
        assert "arena-backed" not in servers.lmdb_throttles
    finally:
        daemon.stop()
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
        servers.close()


def _child_of(pid: int) -> int:
    """``pid``'s one child, once it has started."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for _ in range(500):
        found = children.read_text().split()
        if found:
            return int(found[0])
        time.sleep(0.01)
    raise AssertionError(f"{pid} started no child")
