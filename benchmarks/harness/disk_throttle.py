"""A read bandwidth on the disk under a path, for chosen processes: a child cgroup of the block
I/O controller (cgroup v1 ``blkio.throttle.read_bps_device``, or cgroup v2 ``io.max`` where the
machine has only the unified hierarchy) that the processes are moved into, and so their later
children too. The kernel charges a read to the cgroup of the process whose access brought it to
the disk, page faults on an mmap (lmdb's reads) included.

The kernel meters a cgroup's reads in slices of ``SLICE_S`` and grants a whole slice's bytes
(``DiskThrottle.allowance_bytes``) at once to a cgroup that idled a slice: a read no longer than
that passes at the disk's own speed, and any read is held to the bandwidth within about one
slice. Only reads lasting many slices at the bandwidth are held to it closely.

Each cgroup is named for its benchmark and the pid that made it; a throttle entered sweeps its
benchmark's cgroups whose maker has died (a run killed before its exit), moving what still runs
there back to the hierarchy's root. Where no throttle can be set, entering raises
``ThrottleUnavailable`` with the reason in one line.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import time
from pathlib import Path
from types import TracebackType

BLKIO_V1 = Path("/sys/fs/cgroup/blkio")
UNIFIED = Path("/sys/fs/cgroup")
SYS_BLOCK = Path("/sys/dev/block")
PREFIX = "kvtier-"
SLICE_S = 0.1
"""The block throttle's slice (block/blk-throttle.c ``DFL_THROTL_SLICE``, HZ / 10), the same on
every device since Linux dropped the 20 ms slice of non-rotational queues (f76581f9f1d2, in
stable kernels too: in 6.18.44 a non-rotational loop device gets 100 ms)."""
_made = itertools.count()


class ThrottleUnavailable(Exception):
    """No read bandwidth can be set here; the message says why, in one line."""


def disk_of(path: Path, sys_block: Path = SYS_BLOCK) -> str:
    """``major:minor`` of the whole disk holding ``path`` (a partition's parent disk)."""
    dev = os.stat(path).st_dev
    found = f"{os.major(dev)}:{os.minor(dev)}"
    node = sys_block / found
    if not node.exists():
        raise ThrottleUnavailable(f"{path} is on {found}, which is no block device")
    if (node / "partition").exists():  # the disk is the partition's parent in sysfs
        return (node.resolve().parent / "dev").read_text().strip()
    return found


def hierarchy(v1: Path = BLKIO_V1, unified: Path = UNIFIED) -> tuple[Path, bool]:
    """The block I/O controller's hierarchy root and whether it is cgroup v2."""
    if (v1 / "blkio.throttle.read_bps_device").exists():
        return v1, False
    controllers = unified / "cgroup.controllers"
    if controllers.exists() and "io" in controllers.read_text().split():
        return unified, True
    raise ThrottleUnavailable("no cgroup v1 blkio throttle and no cgroup v2 io controller")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _procs(cgroup: Path) -> list[int]:
    try:
        return [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def _move(pid: int, cgroup: Path) -> None:
    with contextlib.suppress(ProcessLookupError):  # it has ended: nothing to move
        (cgroup / "cgroup.procs").write_text(f"{pid}\n")


def _remove(cgroup: Path, home: dict[int, Path], default_home: Path) -> bool:
    """Move everything in ``cgroup`` out (each pid to its home, else ``default_home``), then
    remove it; False where it still held a process after a few tries."""
    for _ in range(50):
        for pid in _procs(cgroup):
            _move(pid, home.get(pid, default_home))
        try:
            cgroup.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # EBUSY: a process forked in the meantime, or one still leaving
            time.sleep(0.02)
    return False


def sweep(root: Path, benchmark: str) -> list[str]:
    """Remove ``benchmark``'s cgroups under ``root`` whose maker has died; their names."""
    pattern = re.compile(rf"{re.escape(PREFIX + benchmark)}-(\d+)-\d+")
    swept = []
    for cgroup in sorted(root.glob(f"{PREFIX}{benchmark}-*")):
        match = pattern.fullmatch(cgroup.name)
        if match and not _alive(int(match.group(1))) and _remove(cgroup, {}, root):
            swept.append(cgroup.name)
    return swept


class DiskThrottle:
    """While entered, processes ``place``d read the disk under ``path`` at ``bytes_per_s`` at
    most; leaving moves them (and their children) back where they were and removes the
    cgroup."""

    def __init__(
        self,
        benchmark: str,
        path: Path,
        bytes_per_s: int,
        *,
        v1: Path = BLKIO_V1,
        unified: Path = UNIFIED,
    ) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"a read bandwidth is positive, not {bytes_per_s}")
        self.benchmark = benchmark
        self.path = path
        self.bytes_per_s = int(bytes_per_s)
        self._v1, self._unified = v1, unified
        self.cgroup: Path | None = None
        self.device = ""
        self.swept: list[str] = []
        self._root = v1
        self._v2 = False
        self._home: dict[int, Path] = {}

    @property
    def allowance_bytes(self) -> int:
        """What a read after an idle slice gets at the disk's own speed."""
        return round(self.bytes_per_s * SLICE_S)

    def describe(self) -> str:
        kind = "cgroup v2 io.max" if self._v2 else "blkio v1"
        return (
            f"reads at {self.bytes_per_s / 1e6:.0f} MB/s ({kind} on {self.device}; the first "
            f"{self.allowance_bytes / 1e6:.1f} MB after {SLICE_S * 1e3:.0f} ms idle unheld)"
        )

    def __enter__(self) -> DiskThrottle:
        if os.geteuid() != 0:
            raise ThrottleUnavailable("not root: a cgroup cannot be made")
        self._root, self._v2 = hierarchy(self._v1, self._unified)
        self.device = disk_of(self.path)
        self.swept = sweep(self._root, self.benchmark)
        name = f"{PREFIX}{self.benchmark}-{os.getpid()}-{next(_made)}"
        cgroup = self._root / name
        try:
            if self._v2:
                self._enable_io()
            cgroup.mkdir()
            self.cgroup = cgroup
            if self._v2:
                (cgroup / "io.max").write_text(f"{self.device} rbps={self.bytes_per_s}\n")
            else:
                limit = cgroup / "blkio.throttle.read_bps_device"
                limit.write_text(f"{self.device} {self.bytes_per_s}\n")
        except OSError as exc:
            self.__exit__(None, None, None)
            raise ThrottleUnavailable(f"cannot throttle {self.device} in {cgroup}: {exc}") from exc
        return self

    def _enable_io(self) -> None:
        control = self._root / "cgroup.subtree_control"
        if "io" not in control.read_text().split():
            control.write_text("+io\n")

    def place(self, pid: int) -> None:
        """Move ``pid`` (its whole process, later children too) under the throttle."""
        if self.cgroup is None:
            raise RuntimeError("the throttle is not entered")
        self._home.setdefault(pid, self._cgroup_of(pid))
        (self.cgroup / "cgroup.procs").write_text(f"{pid}\n")

    def _cgroup_of(self, pid: int) -> Path:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, where = line.split(":", 2)
            ours = controllers == "" if self._v2 else "blkio" in controllers.split(",")
            if ours:
                return self._root / where.lstrip("/")
        return self._root

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        cgroup, self.cgroup = self.cgroup, None
        home, self._home = self._home, {}
        if cgroup is not None and not _remove(cgroup, home, self._root) and exc is None:
            # left for the sweep of a later run once this process has ended
            raise RuntimeError(f"{cgroup} still holds {_procs(cgroup)}")
